"""Shared fixtures of the fault-tolerance tests."""

import pytest

from hf_dtrain.testing import stop_snapshot_processes


@pytest.fixture
def ft_dir(tmp_path):
    """A snapshot directory whose snapshot processes are stopped after the test, whatever happened."""
    d = str(tmp_path / "ft")
    yield d
    stop_snapshot_processes(d)
