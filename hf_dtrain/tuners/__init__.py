"""hf_dtrain's peft tuners. Importing this package registers every method with peft (idempotently)."""

from ._registry import extend_peft_type, register

# The PeftType members must exist before the config classes are instantiated (their __post_init__ uses them).
for _name in ("SMT", "LORAFA", "QAHIRA", "QBARA"):
    extend_peft_type(_name)

from .lorafa import LoraFAConfig, LoraFAModel  # noqa: E402
from .qahira import QAHiRAConfig, QAHiRAModel  # noqa: E402
from .qbara import QBaRAConfig, QBaRAModel  # noqa: E402
from .smt import SMTConfig, SMTModel  # noqa: E402

register("smt", SMTConfig, SMTModel, prefix="smt_")
register("lorafa", LoraFAConfig, LoraFAModel, prefix="lorafa_")
register("qahira", QAHiRAConfig, QAHiRAModel, prefix="qahr_")
register("qbara", QBaRAConfig, QBaRAModel, prefix="qbara_")

# each tuner pushes its fine-tuning job entry (hf_dtrain.tuners.finetune_method) when its job.py is imported
# the order below is the order --method lists the tuners in
# isort: off
from .lorafa import job as _lorafa_job  # noqa: E402,F401
from .smt import job as _smt_job  # noqa: E402,F401
from .qbara import job as _qbara_job  # noqa: E402,F401
from .qahira import job as _qahira_job  # noqa: E402,F401
# isort: on

__all__ = [
    "LoraFAConfig",
    "LoraFAModel",
    "QAHiRAConfig",
    "QAHiRAModel",
    "QBaRAConfig",
    "QBaRAModel",
    "SMTConfig",
    "SMTModel",
]
