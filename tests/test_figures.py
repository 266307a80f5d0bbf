"""Every benchmark figure README.md and docs/ mark with its result file and key is that file's value at the
precision it is printed with, and every marked table is its result file's table (``benchmarks/render_docs.py``
renders them; a figure typed by hand, or left behind when its benchmark ran again, fails here)."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import render_docs  # noqa: E402


@pytest.mark.parametrize("path", render_docs.DOCS, ids=lambda p: p.name)
def test_every_marked_figure_is_its_result_files_value(path):
    text = path.read_text()
    rendered, problems = render_docs.render_text(text)
    assert not problems, f"{path.name}: marks whose file or key is missing:\n" + "\n".join(problems)
    wrong = [
        f"line {n}: quoted {old.strip()[:200]!r}\n   file says {new.strip()[:200]!r}"
        for n, (old, new) in enumerate(zip(text.splitlines(), rendered.splitlines()), 1)
        if old != new
    ]
    assert not wrong, (
        f"{path.name}: figures that differ from their result files (python benchmarks/render_docs.py):\n"
        + "\n".join(wrong)
    )


def test_the_readme_marks_its_figures():
    """The README's measured claims are marked (the marks above are what keeps them true)."""
    text = (ROOT / "README.md").read_text()
    assert render_docs.marks(text) >= 40


def test_a_figure_or_a_result_changed_alone_fails(tmp_path, monkeypatch):
    results = tmp_path / "results"
    results.mkdir()
    (results / "b.json").write_text(json.dumps({"rows": [{"plan": "a", "ratio": 1.2345}, {"plan": "b", "ratio": 2.5}]}))
    (results / "t.md").write_text("# t\n\n| a |\n|---|\n| 1 |\n\nnotes\n\n## Environment\n- x\n")
    monkeypatch.setattr(render_docs, "RESULTS", results)
    good = (
        "at **1.23x**<!-- b.json rows.[plan=a].ratio --> and 250%<!-- b.json rows.-1.ratio*100 -->\n"
        "<!-- table:t -->\n| a |\n|---|\n| 1 |\n\nnotes\n<!-- /table:t -->\n"
    )
    assert render_docs.render_text(good) == (good, [])
    assert render_docs.render_text(good.replace("1.23x", "1.24x"))[0] == good  # the typed figure is rendered back
    assert render_docs.render_text(good.replace("| 1 |\n\nnotes", "| 2 |\n\nnotes"))[0] == good
    (results / "b.json").write_text(json.dumps({"rows": [{"plan": "a", "ratio": 1.3}, {"plan": "b", "ratio": 2.5}]}))
    assert render_docs.render_text(good)[0] != good  # the file re-measured: the quote is stale
    _, problems = render_docs.render_text("9.9x<!-- b.json rows.[plan=c].ratio --> 1<!-- nofile.json a -->")
    assert len(problems) == 2 and "matches 0 rows" in problems[0] and "no result file" in problems[1]
