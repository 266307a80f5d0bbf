"""The shared tiny bases (``tiny_base`` in tests/conftest.py) are read-only by contract, and the contract is checked:
a session in which a test writes into one fails at its end, naming the file."""

import os
import shutil
import sys

from hf_dtrain import processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WRITER = """
import os


def test_writes_into_the_shared_base(tiny_base):
    with open(os.path.join(tiny_base(5), "config.json"), "a") as f:
        f.write(" ")
"""


def test_a_test_that_writes_into_a_shared_base_fails_the_session_naming_the_file(tmp_path):
    inner = tmp_path / "inner"
    inner.mkdir()
    shutil.copy(os.path.join(ROOT, "tests", "conftest.py"), inner / "conftest.py")  # the fixture as the suite has it
    (inner / "test_writer.py").write_text(WRITER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = processes.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(inner), str(inner)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(inner),
        env=env,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]  # the test itself passed; the session's teardown failed
    assert "1 passed, 1 error" in out, out[-3000:]
    assert "a test wrote into a shared tiny base (copy it first)" in out and "config.json" in out, out[-3000:]
