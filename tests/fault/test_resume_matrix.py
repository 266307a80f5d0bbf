"""The resume matrix in docs/fault_tolerance.md names, for each method, engine and restore source, the test that
shows it resumes bit for bit: every test it names exists (a renamed or deleted test leaves the table wrong)."""

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _matrix() -> str:
    text = open(os.path.join(ROOT, "docs", "fault_tolerance.md")).read()
    found = re.search(r"<!-- resume-matrix -->\n(.*?)<!-- /resume-matrix -->", text, re.S)
    assert found, "docs/fault_tolerance.md has no resume matrix between its markers"
    return found.group(1)


def _tests_in(path: str) -> set[str]:
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


def test_every_test_the_resume_matrix_names_exists():
    refs = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", _matrix())
    assert len(refs) >= 20, refs  # the table is read, not skipped
    missing = [f"{path}::{name}" for path, name in refs if name not in _tests_in(path)]
    assert not missing, f"the resume matrix names tests that do not exist: {missing}"
    rows = [line for line in _matrix().splitlines() if line.startswith("| ") and not line.startswith("| method")]
    assert all(line.count("|") == 7 for line in rows), [line[:80] for line in rows if line.count("|") != 7]
