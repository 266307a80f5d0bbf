import pytest

from .common import METHODS, reference


@pytest.fixture(scope="session")
def references(tmp_path_factory):
    """The single-process run of every method (losses, model, saved adapter), shared by the engines' tests."""
    out = tmp_path_factory.mktemp("reference")
    return out, {method: reference(method, out / method) for method in METHODS}


@pytest.fixture(scope="session")
def mesh_runs(tmp_path_factory):
    """The tensor-parallel, pipeline and 2D runs, in one 4-rank process group (tests/parallel/mesh_jobs.py)."""
    from .mesh_jobs import run_mesh_jobs

    return run_mesh_jobs(str(tmp_path_factory.mktemp("mesh")))
