"""QA-HiRA (issue 3, in progress): so far the group-wise asymmetric INT4 format with exact zero-point folding."""

from .quant import Int4Linear, dequantize_int4, pack_int4, quantize_int4, quantize_model_int4, unpack_int4

__all__ = ["Int4Linear", "quantize_int4", "dequantize_int4", "pack_int4", "unpack_int4", "quantize_model_int4"]
