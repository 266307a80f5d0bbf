"""Every flag, Python name and file path that README, docs and recipes quote exists.

A flag belongs to the command named last before it in the same place (a code line, a paragraph, a table cell; in a
table, a cell without a command belongs to its column's header): an ``hf-dtrain`` job's flag must be accepted by that
job's parser (in prose with no command named, by one of the jobs' parsers), a ``trl sft`` flag by TRL's own parser,
a flag of one of our scripts (``python benchmarks/x.py``, ``python -m hf_dtrain.testing.gpu_check``, a recipe) must be
an ``add_argument`` of that script; flags of outside tools (pip, torchrun, SLURM, ...) are theirs and not checked.
``--section.*`` is a section of some job. Every dotted ``hf_dtrain.`` name resolves (a module, then attributes; or
an entry-point group the package reads), and every ``hf_dtrain/``, ``benchmarks/``, ``recipes/``, ``tests/`` path
exists. A typo in any of them fails here, naming the file, the line and what it quotes."""

from __future__ import annotations

import ast
import functools
import glob
import importlib
import importlib.util
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# CHANGELOG.md is history: it quotes flags and names as they were then
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RECIPES = sorted((ROOT / "recipes").rglob("*.yaml")) + sorted((ROOT / "recipes").rglob("*.py"))
# placeholders the docs use on purpose when they explain the flag scheme (not flags anyone can type)
PLACEHOLDERS = {
    "--section.field": "docs/compose.md explains the scheme: one flag per field of a section",
    "--mymethod.*": "docs/architecture.md's example of a new method's own section",
}
JOB_NAMES = ("finetune", "pretrain", "sweep", "fed", "elastic", "plan", "build-base")
# a command: what names it, in text (the owner of the flags after it)
COMMANDS = [
    (re.compile(r"(?:hf-dtrain|-m hf_dtrain\.cli)\s+(" + "|".join(JOB_NAMES) + r")\b"), "job"),
    (re.compile(r"\btrl sft\b"), "trl"),
    (re.compile(r"\b(?:python3?\s+)?((?:benchmarks|recipes)/[\w/]+\.py)\b"), "script"),
    (re.compile(r"\b(?:python3?\s+-m\s+)?(hf_dtrain\.testing\.gpu_check|gpu_check)\b"), "module"),
    (
        re.compile(
            r"\b(pip3? (?:install|download)|torchrun|accelerate (?:launch|config)|SLURM|sbatch|srun|pytest|git|"
            r"docker|deepspeed|ruff|uv|nvidia-smi|tc|ip netns|mpirun|twine)\b"
        ),
        "outside",
    ),
]
FLAG = re.compile(r"(?<![\w-])(--[A-Za-z][\w.*/<>-]*)")
NAME = re.compile(r"(?<![\w./])hf_dtrain(?:\.[A-Za-z_]\w*)+")
PATH = re.compile(r"(?<![\w./-])((?:hf_dtrain|benchmarks|recipes|tests)/[\w./*{}<>-]*[\w/*}>])")


# ---- where each quoted flag, name and path is --------------------------------------------------------------------


def _regions(path: Path):
    """``(line number, text, context, is code)`` of each place a flag's owner is looked for in: a code line (no
    context), a paragraph (context: the headings above it) or a table cell (its column's header and the headings)."""
    text = path.read_text(encoding="utf-8")
    if path.suffix in (".yaml", ".py"):  # comments and docstrings: every line its own place
        for i, line in enumerate(re.sub(r"\\\n", " ", text).splitlines(), 1):
            yield i, line, "", True
        return
    lines = re.sub(r"\\\n", " ", text).splitlines()  # a shell command continued on the next line: one line
    in_code, para, para_start, header, headings = False, [], 1, None, {}

    def paragraph():
        return para_start, " ".join(para), " ".join(headings[k] for k in sorted(headings)), False

    for i, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            if para:
                yield paragraph()
                para = []
            in_code = not in_code
            continue
        if in_code:
            yield i, line, "", True
            continue
        if line.startswith("#"):
            if para:
                yield paragraph()
                para = []
            level = len(line) - len(line.lstrip("#"))
            headings = {k: v for k, v in headings.items() if k < level}
            headings[level] = line
            continue
        if line.startswith("|"):
            if para:
                yield paragraph()
                para = []
            cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))
            if header is None:
                header = cells
            elif not set(line) <= set("|-: "):
                above = " ".join(headings[k] for k in sorted(headings))
                for n, cell in enumerate(cells):
                    yield i, cell, (header[n] if n < len(header) else "") + " " + above, False
            continue
        header = None
        if not line.strip():
            if para:
                yield paragraph()
            para = []
            continue
        if not para:
            para_start = i
        para.append(line)
    if para:
        yield paragraph()


def _commands(text: str, end: int | None = None) -> list[tuple[int, str, str]]:
    """``(position, kind, name)`` of every command named in ``text`` (before ``end``), in order."""
    found = []
    for pattern, kind in COMMANDS:
        for m in pattern.finditer(text, 0, len(text) if end is None else end):
            found.append((m.start(), kind, m.group(1) if m.groups() else m.group(0)))
    return sorted(found)


def _where(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def quoted_flags() -> list[tuple[str, int, str, list]]:
    """``(file, line, flag, owners)``: a flag in a code line, or in a `span` that names a command before it, belongs
    to that command alone; a bare flag in prose to any job, or to a command named in its paragraph, cell, column
    header or headings."""
    out = []
    for path in DOCS + RECIPES:
        for line, text, context, code in _regions(path):
            spans = [(0, len(text))] if code else [(m.start(1), m.end(1)) for m in re.finditer(r"`([^`]+)`", text)]
            nearby = [(k, n) for _, k, n in _commands(text) + _commands(context)]
            for start, end in spans:
                for m in FLAG.finditer(text, start, end):
                    before = _commands(text[start:end], m.start() - start)
                    if before:
                        owners = [before[-1][1:]]
                    elif code:
                        continue  # a line that names no command: YAML, a Python call's arguments, output
                    else:
                        owners = [("job", None), *nearby]
                    out.append((_where(path), line, m.group(1).rstrip(".,:;)"), owners))
    return out


def quoted(pattern: re.Pattern) -> list[tuple[str, int, str]]:
    out = []
    for path in DOCS + RECIPES:
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for m in pattern.finditer(line):
                out.append((_where(path), i, m.group(1) if m.groups() else m.group(0)))
    return out


# ---- what exists ---------------------------------------------------------------------------------------------------


def _options(parser) -> set[str]:
    import argparse

    found = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _options(sub)
    return found


@functools.cache
def job_options(job: str) -> frozenset[str]:
    from hf_dtrain import cli

    return frozenset(_options(cli.job_parser(job)))


@functools.cache
def trl_options() -> frozenset[str]:
    from transformers import HfArgumentParser
    from trl import ModelConfig, ScriptArguments, SFTConfig, TrlParser

    found = _options(HfArgumentParser((ScriptArguments, SFTConfig, ModelConfig)))
    if '"--config"' in inspect.getsource(TrlParser):  # TrlParser reads --config itself, before its dataclasses
        found.add("--config")
    return frozenset(found)


@functools.cache
def script_options(script: str) -> frozenset[str]:
    """The option strings a script or module declares with ``add_argument`` (read, not run)."""
    if script.endswith(".py"):
        path = ROOT / script
    else:
        spec = importlib.util.find_spec(script if script.startswith("hf_dtrain.") else f"hf_dtrain.testing.{script}")
        path = Path(spec.origin)
    if not path.is_file():
        return frozenset()
    source = path.read_text(encoding="utf-8")
    trees = [ast.parse(source)]
    if path.parent.name == "benchmarks" and "from _report import" in source:  # the benchmarks' shared flags
        trees.append(ast.parse((path.parent / "_report.py").read_text(encoding="utf-8")))
    found = set()
    for node in (n for tree in trees for n in ast.walk(tree)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            found |= {a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
    return frozenset(found)


def _accepted(flag: str, options: frozenset[str]) -> bool:
    if flag.endswith(".*"):  # a whole section
        return any(o.startswith(flag[:-1]) for o in options)
    if flag.endswith("-*"):
        return any(o.startswith(flag[:-1]) for o in options)
    return flag in options


def _problem(flag: str, owner: tuple) -> str | None:
    kind, name = owner
    if kind == "outside" or flag in ("--help", "-h"):
        return None
    if kind == "job":
        if any(_accepted(flag, job_options(j)) for j in ([name] if name else JOB_NAMES)):
            return None
        return f"hf-dtrain {name or 'job'}"
    if kind == "trl":
        return None if _accepted(flag, trl_options()) else "trl sft"
    return None if _accepted(flag, script_options(name)) else name


def flag_problem(flag: str, owners: list) -> str | None:
    """Why ``flag`` (quoted where ``owners`` may take it) does not exist, or None."""
    if "<" in flag or flag in PLACEHOLDERS:
        return None
    if "/" in flag:  # --tp/--pp/--dp-*: each
        problems = [flag_problem(part, owners) for part in flag.split("/") if part.startswith("--")]
        return next((p for p in problems if p), None)
    missing = [_problem(flag, owner) for owner in owners]
    if any(m is None for m in missing):
        return None
    return f"{flag} is taken by none of: " + ", ".join(dict.fromkeys(missing))


@functools.cache
def entry_point_groups() -> frozenset[str]:
    groups = set()
    for path in (ROOT / "hf_dtrain").rglob("*.py"):
        groups |= set(re.findall(r"entry_points\(group=\"([\w.]+)\"\)", path.read_text(encoding="utf-8")))
    return frozenset(groups)


def name_resolves(name: str) -> bool:
    name = name.rstrip(".")
    if name in entry_point_groups():
        return True
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[i:]:
            if not hasattr(obj, attribute):
                return False
            obj = getattr(obj, attribute)
        return True
    return False


def path_exists(path: str) -> bool:
    if any(c in path for c in "<*{"):  # a pattern: benchmarks/results/gpu/<device>/, recipes/finetune_*.yaml
        stem = re.split(r"[<*{]", path, maxsplit=1)[0]
        return bool(glob.glob(str(ROOT / stem) + "*")) or "gpu" in path
    candidates = [ROOT / path, ROOT / path.rstrip(".")]
    return any(p.exists() for p in candidates) or (path.startswith("benchmarks/results/") and "gpu" in path)


# ---- the tests -----------------------------------------------------------------------------------------------------


def test_every_quoted_flag_is_accepted_by_its_command():
    problems = []
    for where, line, flag, owner in quoted_flags():
        why = flag_problem(flag, owner)
        if why:
            problems.append(f"{where}:{line}: {why}")
    assert not problems, "flags the docs quote that their command does not take:\n" + "\n".join(sorted(set(problems)))


def test_every_quoted_hf_dtrain_name_resolves():
    problems = sorted({f"{w}:{i}: {n}" for w, i, n in quoted(NAME) if not name_resolves(n)})
    assert not problems, "hf_dtrain names the docs quote that do not exist:\n" + "\n".join(problems)


def test_every_quoted_path_exists():
    problems = sorted({f"{w}:{i}: {p}" for w, i, p in quoted(PATH) if not path_exists(p)})
    assert not problems, "paths the docs quote that are not in the tree:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    "text, problem",
    [
        ("Run `hf-dtrain finetune --lora.rr 4`.", "--lora.rr is taken by none of: hf-dtrain finetune"),
        ("Run `hf-dtrain pretrain --lora-r 4`.", "--lora-r is taken by none of: hf-dtrain pretrain"),
        ("The hook's `--comm-hook.fusion_mb` (1 MB).", "--comm-hook.fusion_mb is taken by none of: hf-dtrain job"),
        ("As in `trl sft --use_pef`.", "--use_pef is taken by none of: trl sft"),
        (
            "`python benchmarks/fault_tolerance.py --reshards`",
            "--reshards is taken by none of: benchmarks/fault_tolerance.py",
        ),
        ("Measured by `benchmarks/fault_tolerance.py`: `--recovery` too.", None),
        ("SLURM's `--signal=USR1@60` sends SIGUSR1.", None),
        ("`hf-dtrain pretrain --tp 2 --pp 2` and `--comm-hook.fusion-mb 4`.", None),
    ],
)
def test_a_typo_is_caught_and_outside_tools_are_left_alone(tmp_path, monkeypatch, text, problem):
    """The checker itself, on prose with a typo put in on purpose (and on what must pass)."""
    doc = tmp_path / "doc.md"
    doc.write_text(f"# t\n\n{text}\n")
    monkeypatch.setattr(f"{__name__}.DOCS", [doc])
    monkeypatch.setattr(f"{__name__}.RECIPES", [])
    found = [flag_problem(flag, owner) for _, _, flag, owner in quoted_flags()]
    found = [f for f in found if f]
    assert found == ([problem] if problem else [])
