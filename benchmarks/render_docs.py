"""Render every benchmark figure README.md and docs/ quote from its result file: the one docs step.

Two kinds of marks, both invisible where markdown is shown:

* a figure: ``0.829<!-- parallel.json summary.tiny.spearman -->``: the number just before the mark is the value at
  that key of that result file (under ``benchmarks/results/``), printed with the decimals (and the thousands commas)
  it is quoted with; ``x``, ``%`` and ``**`` may sit between the number and the mark. A key is dotted: a mapping's
  key, a list's index (``-1`` the last), a list of mappings' one row ``[plan=pp4-dpr1-dps1-tp1-m4]``
  (``[k=v,k2=v2]``, values may hold spaces), and a last ``*100`` scales (a fraction quoted as a percentage);
* a table: ``<!-- table:NAME -->`` ... ``<!-- /table:NAME -->`` holds ``benchmarks/results/NAME.md``'s table and
  notes (what lies between its title and its environment).

``python benchmarks/render_docs.py`` rewrites them all from the files; ``--check`` only says which differ (exit 1).
``tests/test_figures.py`` fails when a quoted figure is not its file's value.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FIGURE = re.compile(
    r"(?P<number>(?:(?<=[\s(|])[-+])?\d[\d,]*(?:\.\d+)?)(?P<after>(?:x|%)?\**)"
    r"<!-- (?P<file>[\w./-]+\.json) (?P<key>[^>]+?) -->"
)
TABLE = re.compile(r"(<!-- table:(?P<name>[\w./-]+) -->\n)(?P<body>.*?)(\n<!-- /table:(?P=name) -->)", re.S)


class FigureError(LookupError):
    """A mark whose file or key does not exist."""


def _json(file: str, cache: dict) -> object:
    if file not in cache:
        path = RESULTS / file
        if not path.is_file():
            raise FigureError(f"no result file benchmarks/results/{file}")
        cache[file] = json.loads(path.read_text())
    return cache[file]


def _segments(key: str) -> list[str]:
    return re.findall(r"\[[^\]]*\]|[^.\[\]]+", key)


def lookup(data: object, key: str) -> float:
    """The number at ``key`` (see the module's doc) of ``data``."""
    scale = 1.0
    if re.search(r"\*\d+(\.\d+)?$", key):
        key, factor = key.rsplit("*", 1)
        scale = float(factor)
    value = data
    parts = _segments(key)
    while parts:
        part = parts.pop(0)
        while isinstance(value, dict) and part not in value and parts and not parts[0].startswith("["):
            part += "." + parts.pop(0)  # a key holding a dot: detail.delta_0.5.peak
        if part.startswith("["):
            wanted = dict(kv.split("=", 1) for kv in part[1:-1].split(","))
            rows = [r for r in value if isinstance(r, dict) and all(str(r.get(k)) == v for k, v in wanted.items())]
            if len(rows) != 1:
                raise FigureError(f"{part} matches {len(rows)} rows, not one")
            value = rows[0]
        elif isinstance(value, list):
            try:
                value = value[int(part)]
            except (ValueError, IndexError) as e:
                raise FigureError(f"no item {part} in a list of {len(value)}") from e
        elif isinstance(value, dict) and part in value:
            value = value[part]
        else:
            raise FigureError(f"no key {part!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FigureError(f"{key} is {value!r}, not a number")
    return value * scale


def formatted(value: float, like: str) -> str:
    """``value`` printed as ``like`` is: its decimals, its thousands commas."""
    decimals = len(like.split(".", 1)[1]) if "." in like else 0
    text = format(value, f"{',' if ',' in like else ''}.{decimals}f")
    return ("+" + text) if like.startswith("+") and value >= 0 else text


def render_text(text: str, cache: dict | None = None) -> tuple[str, list[str]]:
    """``text`` with every mark rendered from its file, and the problems (missing files or keys)."""
    cache = {} if cache is None else cache
    problems = []

    def figure(m: re.Match) -> str:
        try:
            value = lookup(_json(m["file"], cache), m["key"])
        except FigureError as e:
            problems.append(f"{m['number']}<!-- {m['file']} {m['key']} -->: {e}")
            return m.group(0)
        return f"{formatted(value, m['number'])}{m['after']}<!-- {m['file']} {m['key']} -->"

    def table(m: re.Match) -> str:
        path = RESULTS / f"{m['name']}.md"
        if not path.is_file():
            problems.append(f"table:{m['name']}: no result file benchmarks/results/{m['name']}.md")
            return m.group(0)
        body = path.read_text().split("\n", 1)[1].split("\n## Environment", 1)[0].strip()
        return f"{m.group(1)}{body}{m.group(4)}"

    return TABLE.sub(table, FIGURE.sub(figure, text)), problems


def marks(text: str) -> int:
    return len(FIGURE.findall(text)) + len(TABLE.findall(text))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="change nothing; list the figures that differ (exit 1)")
    a = p.parse_args(argv)
    cache, status, count = {}, 0, 0
    for path in DOCS:
        text = path.read_text()
        new, problems = render_text(text, cache)
        count += marks(text)
        for problem in problems:
            print(f"{path.relative_to(ROOT)}: {problem}", file=sys.stderr)
            status = 1
        if new != text:
            if a.check:
                print(f"{path.relative_to(ROOT)}: figures differ from their result files", file=sys.stderr)
                status = 1
            else:
                path.write_text(new)
                print(f"{path.relative_to(ROOT)}: rendered")
    print(f"{count} marks in {len(DOCS)} files")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
