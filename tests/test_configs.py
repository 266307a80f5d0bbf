"""Every engine setting is reachable from ``hf-dtrain finetune`` / ``pretrain`` and from a YAML section, through one
typed object that reaches the engine unchanged; the previous release's flat flags still work and warn."""

import dataclasses
import typing
import warnings

import pytest

from hf_dtrain.cli import build_parser, job_config_from_args
from hf_dtrain.comm import CommHookConfig
from hf_dtrain.compose import LEGACY_KEYS, ComposeOptions
from hf_dtrain.decentralized import GossipConfig
from hf_dtrain.fault import SnapshotConfig
from hf_dtrain.finetune import FinetuneConfig
from hf_dtrain.memory import DeltaConfig
from hf_dtrain.optim import EvaConfig, OneBitLambConfig
from hf_dtrain.pretrain import PretrainConfig

# every engine config, found in hf_dtrain's packages independently of ComposeOptions: a new engine config must be
# listed here and held by ComposeOptions (the assertion below names it otherwise)
ENGINE_CONFIGS = [CommHookConfig, DeltaConfig, SnapshotConfig, EvaConfig, OneBitLambConfig, GossipConfig]


def _sample(tp, default):
    """A valid value different from the default, and its command-line spelling."""
    base = typing.get_args(tp)[0] if type(None) in typing.get_args(tp) else tp
    if base is bool or isinstance(default, bool):
        return (not default), ["false" if default else "true"]
    origin = typing.get_origin(base)
    if origin is tuple:
        value = tuple(round(v * 0.5, 4) for v in default)
        return value, [str(v) for v in value]
    if origin is list:
        return ["x_proj"], ["x_proj"]
    if base is int or isinstance(default, int):
        value = (default or 1) + 2
        return value, [str(value)]
    if base is float or isinstance(default, float):
        value = round((default or 0.5) * 0.5, 6)
        return value, [str(value)]
    return None, None


CHOICES = {("CommHookConfig", "method"): "s2_reducer", ("CommHookConfig", "exchange"): "alltoall",
           ("DeltaConfig", "granularity"): "submodule", ("DeltaConfig", "objective"): "memory",
           ("DeltaConfig", "method"): "delta", ("EvaConfig", "method"): "foof", ("GossipConfig", "topology"): "torus",
           ("GossipConfig", "mode"): "cta", ("SnapshotConfig", "persist_dir"): "/tmp/p",
           ("SnapshotConfig", "directory"): "/tmp/d", ("DeltaConfig", "budget"): 0.25,
           ("SnapshotConfig", "group_size"): 3, ("SnapshotConfig", "trainable_only"): True}
# a section that must be selected for its settings to be taken
SELECTOR = {"eva": ["--optimizer", "eva"], "onebit_lamb": ["--optimizer", "onebit_lamb"],
            "gossip": ["--optimizer", "decentlam"]}


def _sections(job):
    out = {}
    for f in dataclasses.fields(job):
        tp = typing.get_type_hints(job)[f.name]
        inner = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
        if dataclasses.is_dataclass(inner[0]):
            out[inner[0]] = f.name
    return out


@pytest.mark.parametrize("job,command", [(FinetuneConfig, "finetune"), (PretrainConfig, "pretrain")])
def test_every_engine_field_is_a_flag_that_reaches_the_engine_config(job, command):
    sections = _sections(job)
    missing = [c.__name__ for c in ENGINE_CONFIGS if c not in sections]
    assert not missing, f"engine configs not held by {job.__name__}: {missing}"
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    flags = {s for a in sub._actions for s in a.option_strings}
    checked = 0
    for cls in ENGINE_CONFIGS:
        section = sections[cls]
        base = cls(budget=0.5) if cls is DeltaConfig else cls()
        for f in dataclasses.fields(cls):
            flag = f"--{section}.{f.name}".replace("_", "-")
            assert flag in flags, f"{cls.__name__}.{f.name} has no flag {flag}"
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help text"
            default = getattr(base, f.name)
            value = CHOICES.get((cls.__name__, f.name))
            if value is not None:
                argv = [str(value).lower() if isinstance(value, bool) else str(value)]
            else:
                value, argv = _sample(typing.get_type_hints(cls)[f.name], default)
            assert argv is not None, f"no sample value for {cls.__name__}.{f.name}"
            extra = SELECTOR.get(section, [])
            if section == "delta" and f.name != "budget":
                extra = ["--delta", "0.5"]
            ns = parser.parse_args([command, *extra, flag, *argv])
            cfg = job_config_from_args(ns, job)
            built = getattr(cfg, section)
            assert isinstance(built, cls)
            assert getattr(built, f.name) == value != default, (flag, getattr(built, f.name), value, default)
            # the same setting from a YAML section gives the same object
            yaml_data = {section: {f.name: value}}
            if section == "delta" and f.name != "budget":
                yaml_data[section]["budget"] = 0.5
            if section in SELECTOR:
                yaml_data["optimizer"] = SELECTOR[section][1]
            assert getattr(job.from_dict(yaml_data), section) == built
            checked += 1
    assert checked == sum(len(dataclasses.fields(c)) for c in ENGINE_CONFIGS)


def test_the_config_reaches_the_engine_unchanged(tmp_path):
    """The object the job holds is the object its engine uses, not rebuilt from a subset of its fields (what
    hf-dtrain finetune builds), and the snapshot engine takes its config as given."""
    from hf_dtrain.fault import SnapshotEngine
    from hf_dtrain.finetune import engine_callbacks
    from hf_dtrain.testing import stop_snapshot_processes, tiny_llama

    cfg = FinetuneConfig.from_dict({"delta": {"budget": 0.3, "objective": "memory", "allow_offload": False},
                                    "fault_tolerance": {"parity": 0, "idle_exit": 5.0, "directory": str(tmp_path)}})
    delta_cb, ft = engine_callbacks(cfg, str(tmp_path / "out"))
    assert delta_cb.config is cfg.delta and ft.config is cfg.fault_tolerance
    persisting = dataclasses.replace(cfg.fault_tolerance, persist_every=5)
    _, ft = engine_callbacks(dataclasses.replace(cfg, fault_tolerance=persisting), str(tmp_path / "out"))
    assert ft.config == dataclasses.replace(persisting, persist_dir=str(tmp_path / "out" / "snapshots"))
    model = tiny_llama()
    try:
        engine = SnapshotEngine(model, config=cfg.fault_tolerance)
        assert engine.config is cfg.fault_tolerance and engine.idle_exit == 5.0 and engine.base == str(tmp_path)
        engine.close(shutdown=True)
    finally:
        stop_snapshot_processes(tmp_path)


def test_flat_flags_of_the_previous_release_still_work_and_warn():
    parser = build_parser()
    ns = parser.parse_args(["finetune", "--comm-hook", "acp_sgd", "--comm-rank", "8", "--delta-budget", "0.5",
                            "--delta-granularity", "submodule", "--fault-tolerance", "true", "--ft-parity", "2"])
    with pytest.warns(FutureWarning, match=r"'comm_rank' is deprecated .* use comm_hook.rank \(--comm-hook.rank\)"):
        cfg = job_config_from_args(ns, FinetuneConfig)
    assert cfg.comm_hook == CommHookConfig(method="acp_sgd", rank=8)
    assert cfg.delta == DeltaConfig(budget=0.5, granularity="submodule")
    assert cfg.fault_tolerance == SnapshotConfig(parity=2)
    # a flat setting of a feature that is off turns nothing on, as before
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        cfg = FinetuneConfig.from_dict({"comm_rank": 8, "ft_parity": 2, "delta_granularity": "submodule"})
    assert cfg.comm_hook is None and cfg.fault_tolerance is None and cfg.delta is None
    sub = next(a for a in parser._actions if a.dest == "command").choices["finetune"]
    assert set(LEGACY_KEYS) <= {a.dest for a in sub._actions}


def test_short_forms_and_off():
    cfg = ComposeOptions.from_dict({"comm_hook": "dear", "delta": 2e8, "fault_tolerance": True})
    assert cfg.comm_hook.method == "dear" and cfg.delta.budget == 200_000_000 and cfg.fault_tolerance == SnapshotConfig()
    cfg = ComposeOptions.from_dict({"comm_hook": None, "delta": None, "fault_tolerance": False})
    assert cfg.comm_hook is None and cfg.delta is None and cfg.fault_tolerance is None
    with pytest.raises(ValueError, match=r"ComposeOptions.eva cannot be switched off"):
        ComposeOptions.from_dict({"eva": None})
