"""Imports run one way (docs/architecture.md, "Layers"): the base never imports an engine, an engine never imports
another engine or anything above it, the package never imports ``hf_dtrain.testing``, and benchmarks import
``hf_dtrain`` (its testing helpers included) but never the tests. Checked on the source with ``ast``, imports inside
functions included."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "hf_dtrain")

# lowest first; a module may import its own unit and any unit of a lower layer
LAYERS = [
    (
        "base",
        {
            "distributed",
            "quantization",
            "models",
            "checkpoints",  # real checkpoints: GGUF files read once into dense folders, the packaged default base
            "precision",  # which compute dtype a CPU path may choose (bf16 only where it is native)
            "tasks",
            "settings",
            "optimizer_wrapper",
            "errors",
            "datafile",
            "adapters",
            "optimizers",  # the registry of --optimizer choices the engines fill
            "run",  # sections, job configs, flags and JobRun: it names no section and imports no engine
            "fast",  # the lean layers' switch, functions and path counts; the step profile
            "estimate",  # a step traced on fake tensors: the memory the planner, DELTA and the jobs will ask of it
            "processes",  # child processes killed with everything they started (no orphan outlives its job)
        },
    ),
    (
        "engines",
        {
            "tuners",
            "comm",
            "optim",
            "decentralized",
            "data",
            "memory",
            "fault",
            "parallel",
            "federated",
            "split",
            "health",
        },
    ),
    # it fuses the tuners' adapters by the forms they register: of the tuners it imports the registry alone
    ("engines over the tuners", {"fused"}),
    ("the callbacks in one place", {"callbacks"}),
    ("jobs", {"jobs"}),  # each job under jobs/, none importing another (what the fine-tuning jobs share: jobs/sft)
    ("cli", {"cli"}),
]
LEVEL = {unit: i for i, (_, units) in enumerate(LAYERS) for unit in units}
NAME = {i: name for i, (name, _) in enumerate(LAYERS)}


def _unit(module: str) -> str:
    """``hf_dtrain.comm.acp_sgd`` -> ``comm``; ``hf_dtrain`` itself -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _job(module: str) -> str | None:
    """``hf_dtrain.jobs.sweep`` -> ``sweep``; ``hf_dtrain.jobs.finetune.trainer`` -> ``finetune``; the package: None."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else None


def _imports(path: str, module: str):
    tree = ast.parse(open(path).read(), path)
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield node.lineno, target
            if node.module is None or (node.level and not node.module):
                for alias in node.names:  # "from . import x" / "from hf_dtrain import x"
                    yield node.lineno, f"{target}.{alias.name}"


def _modules(top: str, prefix: str):
    for dirpath, _, files in os.walk(top):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, os.path.dirname(top))[:-3].replace(os.sep, ".")
                yield path, rel.removesuffix(".__init__")


def violations() -> list[str]:
    found = []
    for path, module in _modules(PACKAGE, "hf_dtrain"):
        unit = _unit(module)
        if unit in ("", "testing"):  # the public API module re-exports; testing may use anything
            continue
        assert unit in LEVEL, f"{module}: the unit {unit!r} has no layer; add it to LAYERS (and docs/architecture.md)"
        for line, target in _imports(path, module):
            if not target.startswith("hf_dtrain"):
                continue
            other = _unit(target)
            where = f"{os.path.relpath(path, ROOT)}:{line} imports {target}"
            if other == "testing":
                found.append(f"{where}: the package never imports its testing helpers")
            elif other == "":
                if target == "hf_dtrain" and LEVEL[unit] < LEVEL["jobs"]:
                    found.append(f"{where}: the top-level package (everything) from the {NAME[LEVEL[unit]]} layer")
            elif other != unit and LEVEL[other] > LEVEL[unit]:
                found.append(f"{where}: {NAME[LEVEL[other]]} from the {NAME[LEVEL[unit]]} layer")
            elif other != unit and LEVEL[other] == LEVEL[unit] == LEVEL["comm"]:
                found.append(f"{where}: one engine imports another (move what they share to the base layer)")
    for path, module in _modules(PACKAGE, "hf_dtrain"):
        if not module.startswith("hf_dtrain.jobs."):
            continue
        job = _job(module)
        for line, target in _imports(path, module):
            other = _job(target) if target.startswith("hf_dtrain.jobs.") else None
            if job not in (None, "sft") and other not in (None, job, "sft"):
                found.append(f"{os.path.relpath(path, ROOT)}:{line} imports {target}: a job never imports another job")
    for path, module in _modules(PACKAGE, "hf_dtrain"):
        if not module.startswith("hf_dtrain.fused"):
            continue
        for line, target in _imports(path, module):
            if target.startswith("hf_dtrain.tuners") and target != "hf_dtrain.tuners.finetune_method":
                found.append(
                    f"{os.path.relpath(path, ROOT)}:{line} imports {target}: fused/ imports no tuner (their fused "
                    "forms come through hf_dtrain.tuners.finetune_method)"
                )
    for path, module in _modules(os.path.join(ROOT, "benchmarks"), "benchmarks"):
        for line, text in enumerate(open(path), 1):
            if "sys.path" in text and '"tests"' in text:
                found.append(
                    f"{os.path.relpath(path, ROOT)}:{line} puts the tests on sys.path: benchmarks import "
                    "hf_dtrain.testing, never the tests"
                )
        for line, target in _imports(path, module):
            if target == "tests" or target.startswith("tests."):
                found.append(
                    f"{os.path.relpath(path, ROOT)}:{line} imports {target}: benchmarks import "
                    "hf_dtrain.testing, never the tests"
                )
    return found


@pytest.mark.smoke
def test_imports_run_one_way():
    found = violations()
    assert not found, "imports against the layers:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source,expected",
    [
        ("from hf_dtrain.tuners.qahira.quant import x\n", "engines from the base layer"),
        ("def f():\n    from ..comm import register\n", "engines from the base layer"),
    ],
)
def test_the_checker_catches_an_upward_import(tmp_path, monkeypatch, source, expected):
    """The checker itself: an upward import written into a base module (at top level or inside a function) is
    reported."""
    pkg = tmp_path / "hf_dtrain"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "distributed").mkdir()
    (pkg / "distributed" / "__init__.py").write_text("")
    (pkg / "distributed" / "collectives.py").write_text(source)
    (tmp_path / "benchmarks").mkdir()
    monkeypatch.setitem(globals(), "PACKAGE", str(pkg))
    monkeypatch.setitem(globals(), "ROOT", str(tmp_path))
    found = violations()
    assert len(found) == 1 and expected in found[0], found
