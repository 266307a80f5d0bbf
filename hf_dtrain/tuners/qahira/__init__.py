"""QA-HiRA (Shen et al., arXiv 2407.17029): one pooled matrix per layer, merging exactly into group-wise INT4 zero-points.

Issue 3 is in progress: the INT4 format and the QA-HiRA tuner on nn.Linear / Int4Linear bases are here; Q-BaRA,
bitsandbytes 4-bit bases, the CLI and the benchmark are not yet.
"""

from .config import QAHiRAConfig
from .layer import Linear, QAHiRALayer
from .model import QAHiRAModel
from .quant import Int4Linear, dequantize_int4, pack_int4, quantize_int4, quantize_model_int4, unpack_int4

__all__ = ["QAHiRAConfig", "QAHiRAModel", "QAHiRALayer", "Linear", "Int4Linear", "quantize_int4", "dequantize_int4",
           "pack_int4", "unpack_int4", "quantize_model_int4"]
