"""QA-HiRA (Shen et al., arXiv 2407.17029): one pooled matrix per layer, merging exactly into group-wise INT4
zero-points.

With ``QAHiRAConfig(r=...)`` the matrix is factorised as in QA-LoRA (Xu et al., arXiv 2309.14717), which merges the
same way. Bases: dense ``nn.Linear``, bitsandbytes 4-bit, HQQ ``HQQLinear`` and hf_dtrain's ``Int4Linear``
(:mod:`hf_dtrain.quantization.int4`). Importing the folder registers its fine-tuning entry; the peft classes load on
first use.
"""

import lazy_loader as lazy

from . import method  # noqa: F401

__getattr__, __dir__, __all__ = lazy.attach(
    __name__,
    submod_attrs={"config": ["QAHiRAConfig"], "layer": ["Linear", "QAHiRALayer"], "model": ["QAHiRAModel"]},
)
