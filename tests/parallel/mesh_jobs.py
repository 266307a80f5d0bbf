"""One 4-rank gloo run for the tensor-parallel, pipeline and 2D tests (one spawn and one process group instead of
three: about 20 s less of the suite); each layout's rank function lives in its test module and writes its own
results under the run's directory."""

import os

from hf_dtrain.testing import run_distributed


def _mesh_rank(rank, world, out):
    from .test_optimus import _rank as optimus_rank
    from .test_pipeline import CASES as PP_CASES
    from .test_pipeline import _pp_rank
    from .test_tensor_parallel import CASES as TP_CASES
    from .test_tensor_parallel import _tp_rank

    _tp_rank(rank, world, TP_CASES, os.path.join(out, "tp.json"))
    os.makedirs(os.path.join(out, "pp"), exist_ok=True)
    _pp_rank(rank, world, PP_CASES, os.path.join(out, "pp"))
    optimus_rank(rank, world, os.path.join(out, "optimus.json"))


def run_mesh_jobs(out: str) -> str:
    run_distributed(_mesh_rank, 4, args=(out,), timeout=900)
    return out
