"""QA-HiRA (Shen et al., arXiv 2407.17029): one pooled matrix per layer, merging exactly into group-wise INT4
zero-points.

With ``QAHiRAConfig(r=...)`` the matrix is factorised as in QA-LoRA (Xu et al., arXiv 2309.14717), which merges the
same way. Bases: dense ``nn.Linear``, bitsandbytes 4-bit, HQQ ``HQQLinear`` and hf_dtrain's ``Int4Linear``.
"""

from ...quantization.int4 import Int4Linear, dequantize_int4, pack_int4, quantize_int4, quantize_model_int4, unpack_int4
from .config import QAHiRAConfig
from .layer import Linear, QAHiRALayer
from .model import QAHiRAModel

__all__ = [
    "Int4Linear",
    "Linear",
    "QAHiRAConfig",
    "QAHiRALayer",
    "QAHiRAModel",
    "dequantize_int4",
    "pack_int4",
    "quantize_int4",
    "quantize_model_int4",
    "unpack_int4",
]
