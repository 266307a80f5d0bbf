"""Every GPU ratio quoted in README.md and docs/ comes from a committed GPU result: each ``N.NNx`` said of an H100 or
H200 (in a sentence's clauses from the one naming the GPU to one naming a CPU, or in a table whose header names the
GPU) carries the mark of its file under ``benchmarks/results/gpu/`` and its key (``0.61x<!-- gpu/.../gpu_check.json
steps.[step=peak_memory].detail.lorafa_vs_lora -->``), and ``tests/test_figures.py`` holds it to that value at the
decimals it is quoted with. (Before the marks this test took any number of any GPU file at those decimals: 88 of the
999 two-decimal values counted, so 0.60x passed for the README's 0.61x.)"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPU = re.compile(r"\bH(100|200)\b")
RATIO = re.compile(r"(?<![\d.])(\d+\.\d+)(?:-(\d+\.\d+))?x(?![\w])")
MARK = re.compile(r"\**<!-- (gpu/[\w./-]+\.json) [^>]+? -->")


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


def test_every_gpu_ratio_in_the_docs_names_its_committed_result():
    unmarked, marked = [], 0
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for path in files:
        for paragraph in re.split(r"\n\s*\n", path.read_text()):
            for passage in _gpu_passages(paragraph):
                for match in RATIO.finditer(passage):
                    mark = MARK.match(passage, match.end())
                    if mark and (ROOT / "benchmarks" / "results" / mark.group(1)).is_file():
                        marked += 1
                    else:
                        unmarked.append(f"{path.relative_to(ROOT)}: {match.group(0)} in {passage.strip()[:160]!r}")
    assert marked, "no marked GPU figures found"
    assert not unmarked, "GPU figures with no committed result file and key:\n" + "\n".join(unmarked)
