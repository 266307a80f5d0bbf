"""hf_dtrain: efficient, distributed and fault-tolerant fine-tuning and pretraining inside the Hugging Face stack.

``import hf_dtrain`` registers its peft methods (SMT, LoRA-FA, Q-BaRA, QA-HiRA) with peft, so ``get_peft_model``,
``PeftModel.from_pretrained`` and ``AutoPeftModelForCausalLM.from_pretrained`` work with them. Import it before
loading a saved hf_dtrain adapter. The import itself is light: the registration runs when peft is imported (at once if
it already is), and the public names below load on first use. ``hf_dtrain.load_adapter(base, path)`` is
``PeftModel.from_pretrained`` that first checks the adapter fits the base (peft drops what does not fit without a
word).
"""

import importlib

import wrapt

from .settings import RELEASE as __version__

_ADAPTERS = ("load_adapter", "check_adapter_fits")


def _register_with_peft(peft) -> None:
    importlib.import_module(f"{__name__}.tuners").register_with_peft()


wrapt.register_post_import_hook(_register_with_peft, "peft")


def __getattr__(name: str):
    """The tuners' public names (``hf_dtrain.LoraFAConfig``, ``hf_dtrain.smt_warmup``...) and ``load_adapter`` /
    ``check_adapter_fits``, loaded on first use."""
    if name in _ADAPTERS:
        return getattr(importlib.import_module(f"{__name__}.adapters"), name)
    tuners = importlib.import_module(f"{__name__}.tuners")
    if name in tuners.__all__:
        return getattr(tuners, name)
    raise AttributeError(f"module 'hf_dtrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_ADAPTERS, *importlib.import_module(f"{__name__}.tuners").__all__])


__all__ = ["__version__", *_ADAPTERS]  # and every tuner's public names (dir(hf_dtrain))
