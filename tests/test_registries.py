"""The jobs and the run machinery reach methods and sections through the registries only, and the console script
loads nothing it does not use.

* No method hf_dtrain ships (``smt``, ``lorafa``, ``qbara``, ``qahira``) and no section's setting (``delta``,
  ``comm_hook``, ``fsdp``...) is named in the code of ``hf_dtrain/jobs/``, ``hf_dtrain/run/`` or ``hf_dtrain/cli.py``:
  neither as an identifier nor in a string (the methods not in their docstrings and comments either).
* ``hf-dtrain --help``, every job's ``--help`` and a bad flag import neither the optional backends (TRL,
  ``datasets``, DeepSpeed, bitsandbytes, HQQ) nor torch, transformers, peft or accelerate.
* ``import hf_dtrain`` still registers every tuner with peft (a saved adapter of each loads by its type)."""

import io
import json
import os
import re
import sys
import tokenize

import pytest

from hf_dtrain import processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MACHINERY = ["hf_dtrain/jobs", "hf_dtrain/run", "hf_dtrain/cli.py"]
METHODS = ("smt", "lorafa", "qbara", "qahira")
GENERIC = {"optimizer", "parallel"}  # section names that are also the run's own words (run.optimizer(...))


def _files(paths):
    for rel in paths:
        path = os.path.join(ROOT, rel)
        if path.endswith(".py"):
            yield path
            continue
        for dirpath, _, files in os.walk(path):
            yield from (os.path.join(dirpath, f) for f in sorted(files) if f.endswith(".py"))


def _section_words() -> set[str]:
    from hf_dtrain.run.section import SECTIONS, discover

    discover()
    return {name for s in SECTIONS.values() for name, _, _ in s.settings()} - GENERIC


def _docstring_lines(source: str) -> set[int]:
    import ast

    lines = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                lines.add(first.lineno)
    return lines


def named(paths, methods=METHODS, sections=None) -> list[str]:
    """Where ``paths`` name a method or a section: identifiers equal to one, strings holding one (or its flag) as a
    word; the methods also in docstrings and comments."""
    sections = _section_words() if sections is None else sections
    words = set(methods) | set(sections)
    spelled = words | {w.replace("_", "-") for w in words}
    word = re.compile(r"(?<!\w)(" + "|".join(sorted(map(re.escape, spelled), key=len, reverse=True)) + r")(?![\w])")
    method_word = re.compile(r"(?<!\w)(" + "|".join(map(re.escape, methods)) + r")(?!\w)", re.I)
    found = []
    for path in _files(paths):
        source = open(path).read()
        docs = _docstring_lines(source)
        where = os.path.relpath(path, ROOT)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            text, line = tok.string, tok.start[0]
            if tok.type == tokenize.NAME and text in words:
                found.append(f"{where}:{line}: the name {text}")
            elif tok.type == tokenize.STRING and line not in docs and word.search(text):
                found.append(f"{where}:{line}: {word.search(text).group(1)!r} in {text[:60]}")
            elif tok.type in (tokenize.STRING, tokenize.COMMENT) and method_word.search(text):
                found.append(f"{where}:{line}: the method {method_word.search(text).group(1)!r} in {text[:60]}")
    return found


def test_the_jobs_and_the_run_name_no_method_and_no_section():
    found = named(MACHINERY)
    assert not found, "named outside the registries:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source, expected",
    [
        ('if cfg.method == "smt":\n    pass\n', "'smt'"),
        ("x = cfg.delta\n", "the name delta"),
        ('flags = ["--comm-hook.rank"]\n', "'comm-hook'"),
        ("# lorafa builds its own optimizer\n", "the method 'lorafa'"),
    ],
)
def test_the_name_check_catches_a_branch_on_a_method_or_a_section(tmp_path, source, expected):
    path = tmp_path / "job.py"
    path.write_text(source)
    found = named([str(path)])
    assert len(found) == 1 and expected in found[0], found


def _imported_by(argv: list[str]) -> set[str]:
    code = (
        "import runpy, sys, json\n"
        f"sys.argv = {['hf-dtrain', *argv]!r}\n"
        "try:\n    runpy.run_module('hf_dtrain.cli', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "print('MODULES ' + json.dumps(sorted(sys.modules)))\n"
    )
    out = processes.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    line = [x for x in out.stdout.splitlines() if x.startswith("MODULES ")]
    assert line, out.stderr[-2000:]
    return set(json.loads(line[-1][len("MODULES ") :]))


OPTIONAL = ("trl", "datasets", "deepspeed", "bitsandbytes", "hqq")


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["finetune", "--help"],
        ["plan", "--help"],
        ["finetune", "--bad"],
        ["pretrain", "--help"],
        ["sweep", "--help"],
        ["fed", "simulate", "--help"],
        ["elastic", "--help"],
    ],
)
def test_the_console_script_answers_without_loading_what_it_does_not_use(argv):
    loaded = {m.split(".")[0] for m in _imported_by(argv)}
    assert "hf_dtrain" in loaded
    assert not loaded & set(OPTIONAL), sorted(loaded & set(OPTIONAL))
    assert not loaded & {"torch", "transformers", "peft", "accelerate"}, "a job's flags come from light modules"


def test_import_hf_dtrain_registers_every_tuner_with_peft(tmp_path):
    """In a fresh process: ``import hf_dtrain`` (nothing else of it), then peft builds each method's config from
    its saved type, as ``PeftModel.from_pretrained`` does."""
    code = (
        "import hf_dtrain\n"
        "from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING, PEFT_TYPE_TO_TUNER_MAPPING\n"
        "from peft.utils import PeftType\n"
        f"for t in {[m.upper() for m in METHODS]!r}:\n"
        "    assert t in PEFT_TYPE_TO_TUNER_MAPPING, t\n"
        "    print(PEFT_TYPE_TO_CONFIG_MAPPING[PeftType[t]].__name__)\n"
    )
    out = processes.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["SMTConfig", "LoraFAConfig", "QBaRAConfig", "QAHiRAConfig"], out.stdout
