"""Which compute dtype a CPU path may choose for speed (bf16 only where the CPU computes it natively), and the dtype
a job's Trainer settings compute in under autocast."""

from __future__ import annotations

import os

# "0": treat bf16 as unsupported on this CPU (the fp32 choice wherever a CPU path chose bf16 for speed), as on a CPU
# that only emulates it; CI runs the CPU benchmarks' dry run this way
CPU_BF16_ENV = "HF_DTRAIN_CPU_BF16"


def cpu_bf16() -> tuple[bool, str]:
    """Whether this CPU computes bf16 natively (AMX tiles, or AVX-512 BF16 instructions: torch's own detection) and
    so a CPU path may choose bf16 for speed; with ``HF_DTRAIN_CPU_BF16=0``, never. Returns ``(native, what to
    record)``. Where bf16 is only emulated (AVX2 alone) a bf16 matmul runs about 90x slower than fp32: the paths
    that choose bf16 for speed (the fine-tuning jobs' default precision on CPU, the CPU throughput benchmark,
    ``gpu_check``'s dry run) take fp32 there and say so."""
    import torch

    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    avx512 = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
    native = "bf16 native (AMX)" if amx else "bf16 native (AVX-512 BF16)" if avx512 else None
    if os.environ.get(CPU_BF16_ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return False, f"{native or 'bf16 emulated'}; treated as unsupported ({CPU_BF16_ENV}=0): fp32"
    if native is None:
        return False, "bf16 emulated (no AMX / AVX-512 BF16): fp32"
    return True, native


def autocast_dtype(args):
    """The dtype the Trainer computes in under autocast for these ``TrainingArguments`` (``--bf16`` / ``--fp16``),
    or None: what the estimate's skeleton and a method's prepare passes run under, as the job's step does."""
    import torch

    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
