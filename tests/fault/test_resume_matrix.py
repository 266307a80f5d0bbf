"""The resume matrix in docs/fault_tolerance.md names, for each method, engine and restore source, the test that
shows it resumes bit for bit: every test it names exists (a renamed or deleted test leaves the table wrong) and says,
with its ``@pytest.mark.resume_cell(method, engine, *sources)`` beside its code, that it shows that cell (a cell
pointed at another test fails), and every cell a test claims is in the table; the comparison of final states those
tests end with names every difference."""

import ast
import os
import re

import pytest
import torch
from safetensors.torch import save_file

from hf_dtrain.testing.fault import saved_tensors_differ

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _matrix() -> str:
    text = open(os.path.join(ROOT, "docs", "fault_tolerance.md")).read()
    found = re.search(r"<!-- resume-matrix -->\n(.*?)<!-- /resume-matrix -->", text, re.S)
    assert found, "docs/fault_tolerance.md has no resume matrix between its markers"
    return found.group(1)


SOURCES = ("memory", "parity", "disk", "another world size")  # the table's columns after method and engine


def _tests_in(path: str) -> dict[str, set[tuple[str, str, str]]]:
    """Each test function of ``path`` and the (method, engine, source) cells its ``resume_cell`` marks claim."""
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            cells = set()
            for deco in node.decorator_list:
                if isinstance(deco, ast.Call) and getattr(deco.func, "attr", None) == "resume_cell":
                    method, engine, *sources = [ast.literal_eval(a) for a in deco.args]
                    cells |= {(method, engine, source) for source in sources}
            found[node.name] = cells
    return found


def _cells() -> dict[tuple[str, str, str], list[tuple[str, str]]]:
    """(method, engine, source) -> the tests the table names for it."""
    out = {}
    for line in _matrix().splitlines():
        if not line.startswith("| ") or line.startswith("| method"):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        for source, cell in zip(SOURCES, cells[2:]):
            out[(cells[0], cells[1], source)] = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", cell)
    return out


def test_every_test_the_resume_matrix_names_exists():
    refs = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", _matrix())
    assert len(refs) >= 20, refs  # the table is read, not skipped
    missing = [f"{path}::{name}" for path, name in refs if name not in _tests_in(path)]
    assert not missing, f"the resume matrix names tests that do not exist: {missing}"
    cells = _cells()
    unclaimed = [
        f"{method} / {engine} / {source}: {path}::{name}"
        for (method, engine, source), tests in cells.items()
        for path, name in tests
        if (method, engine, source) not in _tests_in(path)[name]
    ]
    assert not unclaimed, "cells whose test does not say (resume_cell) it shows them:\n" + "\n".join(unclaimed)
    files = {path for tests in cells.values() for path, _ in tests}
    claimed = {(cell, f"{path}::{name}") for path in files for name, got in _tests_in(path).items() for cell in got}
    untabled = sorted(
        f"{c[0]} / {c[1]} / {c[2]}: {t}" for c, t in claimed if t.split("::") not in map(list, cells.get(c, []))
    )
    assert not untabled, "tests claiming cells the table does not give them:\n" + "\n".join(untabled)
    rows = [line for line in _matrix().splitlines() if line.startswith("| ") and not line.startswith("| method")]
    assert all(line.count("|") == 7 for line in rows), [line[:80] for line in rows if line.count("|") != 7]


def test_the_final_state_comparison_names_every_difference(tmp_path):
    """``saved_tensors_differ``, which every resume test's last assertion relies on: equal folders give nothing; a
    value one bit apart, a dtype, a key or a file on one side only are each named; a reference with nothing to compare
    is an error, not a pass."""
    ref, out = tmp_path / "ref", tmp_path / "out"
    ref.mkdir()
    out.mkdir()
    w = torch.randn(4, 4)
    save_file({"w": w, "b": torch.zeros(4)}, ref / "model.safetensors")
    save_file({"w": w.clone(), "b": torch.zeros(4)}, out / "model.safetensors")
    assert saved_tensors_differ(ref, out) == []
    nudged = w.clone()
    nudged.view(-1)[5] = torch.nextafter(nudged.view(-1)[5], torch.tensor(float("inf")))
    save_file({"w": nudged, "b": torch.zeros(4, dtype=torch.float64)}, out / "model.safetensors")
    assert saved_tensors_differ(ref, out) == ["model.safetensors: b", "model.safetensors: w"]
    save_file({"w": w}, out / "model.safetensors")
    save_file({"x": w}, out / "extra.safetensors")
    assert saved_tensors_differ(ref, out) == [
        f"extra.safetensors: only in {out}",
        "model.safetensors: b on one side only",
    ]
    (out / "model.safetensors").unlink()
    assert f"model.safetensors: not in {out}" in saved_tensors_differ(ref, out)
    with pytest.raises(AssertionError, match=r"no \*\.safetensors"):
        saved_tensors_differ(out / "nothing", out)
