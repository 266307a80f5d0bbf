"""Every GPU ratio quoted in README.md and docs/ comes from a committed GPU result: each ``N.NNx`` (and each end of a
``N.NN-N.NNx`` range) said of an H100 or H200 (in a sentence's clauses from the one naming the GPU to one naming a
CPU, or in a table whose header names the GPU) equals, at the decimals it is quoted with, a number in a file under
``benchmarks/results/gpu/`` (the JSON's values, or the markdown's text). A figure from a run whose file was
overwritten fails here (the README's 6.42x and 1.09x did)."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPU = re.compile(r"\bH(100|200)\b")
RATIO = re.compile(r"(?<![\d.])(\d+\.\d+)(?:-(\d+\.\d+))?x\b")


def _numbers(value, out: set) -> None:
    if isinstance(value, dict):
        for v in value.values():
            _numbers(v, out)
    elif isinstance(value, list):
        for v in value:
            _numbers(v, out)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        out.add(float(value))


def _committed() -> tuple[set, str]:
    numbers, text = set(), ""
    for path in (ROOT / "benchmarks" / "results" / "gpu").rglob("*"):
        if path.suffix == ".json":
            _numbers(json.loads(path.read_text()), numbers)
        elif path.suffix in (".md", ".txt"):
            text += path.read_text()
    return numbers, text


def _found(figure: str, numbers: set, text: str) -> bool:
    decimals = len(figure.split(".")[1])
    value = float(figure)
    return figure in text or any(round(n, decimals) == value for n in numbers)


def _gpu_passages(paragraph: str):
    """The clauses of a paragraph's sentences that speak of a GPU, or every row of a table one of whose rows (its
    header) names one."""
    lines = [line for line in paragraph.splitlines() if line.strip()]
    if lines and all(line.startswith("|") for line in lines):
        if any(GPU.search(line) for line in lines):
            yield from lines
        return
    for sentence in re.split(r"(?<=\.)\s+(?=[A-Z*(\[])", " ".join(lines)):
        gpu = False  # a clause is the GPU's from the one that names it to the next that names a CPU
        for clause in sentence.split(";"):
            if GPU.search(clause):
                gpu = True
            elif "CPU" in clause:
                gpu = False
            if gpu:
                yield clause


def test_every_gpu_ratio_in_the_docs_is_in_a_committed_result():
    numbers, text = _committed()
    assert numbers, "no committed GPU results found"
    missing = []
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for path in files:
        for paragraph in re.split(r"\n\s*\n", path.read_text()):
            for passage in _gpu_passages(paragraph):
                for match in RATIO.finditer(passage):
                    for figure in filter(None, match.groups()):
                        if not _found(figure, numbers, text):
                            missing.append(f"{path.relative_to(ROOT)}: {figure}x in {passage.strip()[:160]!r}")
    assert not missing, "GPU figures with no committed result:\n" + "\n".join(missing)
