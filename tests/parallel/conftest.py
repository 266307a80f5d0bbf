import pytest

from .common import METHODS, reference


@pytest.fixture(scope="session")
def references(tmp_path_factory):
    """The single-process run of every method (losses, model, saved adapter), shared by the engines' tests."""
    out = tmp_path_factory.mktemp("reference")
    return out, {method: reference(method, out / method) for method in METHODS}
