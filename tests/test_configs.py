"""Every engine setting is reachable from ``hf-dtrain finetune`` / ``pretrain`` and from a YAML section, through one
typed object that reaches the engine unchanged; every Trainer setting is a flag and a YAML key of the fine-tuning
job."""

import dataclasses
import typing
import warnings

import pytest
import torch

from hf_dtrain.cli import build_parser
from hf_dtrain.comm import CommHookConfig
from hf_dtrain.decentralized import GossipConfig
from hf_dtrain.fault import SnapshotConfig
from hf_dtrain.jobs.pretrain import PretrainConfig
from hf_dtrain.jobs.sft.config import FinetuneConfig
from hf_dtrain.memory import DeltaConfig
from hf_dtrain.optim import EvaConfig, OneBitLambConfig
from hf_dtrain.run.flags import job_config_from_args
from hf_dtrain.run.job import JobRun

# every engine config, found in hf_dtrain's packages independently of the sections' registry: a new engine config
# must be listed here and held by the job configs (the assertion below names it otherwise)
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


CHOICES = {
    ("CommHookConfig", "method"): "s2_reducer",
    ("CommHookConfig", "exchange"): "alltoall",
    ("DeltaConfig", "granularity"): "submodule",
    ("DeltaConfig", "objective"): "memory",
    ("DeltaConfig", "method"): "delta",
    ("EvaConfig", "method"): "foof",
    ("GossipConfig", "topology"): "torus",
    ("GossipConfig", "mode"): "cta",
    ("SnapshotConfig", "persist_dir"): "/tmp/p",
    ("SnapshotConfig", "directory"): "/tmp/d",
    ("DeltaConfig", "budget"): 0.25,
    ("SnapshotConfig", "group_size"): 3,
    ("SnapshotConfig", "trainable_only"): True,
}
# a section that must be selected for its settings to be taken
SELECTOR = {
    "eva": ["--optimizer", "eva"],
    "onebit_lamb": ["--optimizer", "onebit_lamb"],
    "gossip": ["--optimizer", "decentlam"],
}


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
    parser = build_parser(command)
    flags = {s for a in parser._actions for s in a.option_strings}
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
            ns = parser.parse_args([*extra, flag, *argv])
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
    from hf_dtrain.fault import InMemoryFaultToleranceCallback, SnapshotEngine
    from hf_dtrain.memory import DeltaCallback
    from hf_dtrain.testing import stop_snapshot_processes, tiny_llama

    cfg = FinetuneConfig.from_dict(
        {
            "delta": {"budget": 0.3, "objective": "memory", "allow_offload": False},
            "fault_tolerance": {
                "parity": 0,
                "idle_exit": 5.0,
                "directory": str(tmp_path),
                "persist_dir": str(tmp_path / "disk"),
            },
        }
    )

    def callbacks(cfg):
        run = JobRun(cfg, output_dir=str(tmp_path / "out"), start=False)
        found = run.callbacks()
        return tuple(
            next(cb for cb in found if isinstance(cb, kind)) for kind in (DeltaCallback, InMemoryFaultToleranceCallback)
        )

    delta_cb, ft = callbacks(cfg)
    assert delta_cb.config is cfg.delta and ft.config is cfg.fault_tolerance
    # the jobs' one default: disk snapshots (every persist_every-th, and the one a preemption notice writes) under
    # <output_dir>/snapshots when no persist_dir is given
    for persisting in (
        dataclasses.replace(cfg.fault_tolerance, persist_dir=None, persist_every=5),
        dataclasses.replace(cfg.fault_tolerance, persist_dir=None),  # preempt_deadline 30 s by default
    ):
        _, ft = callbacks(dataclasses.replace(cfg, fault_tolerance=persisting))
        assert ft.config == dataclasses.replace(persisting, persist_dir=str(tmp_path / "out" / "snapshots"))
    off = dataclasses.replace(cfg.fault_tolerance, persist_dir=None, preempt_deadline=0)
    assert callbacks(dataclasses.replace(cfg, fault_tolerance=off))[1].config is off
    model = tiny_llama()
    try:
        engine = SnapshotEngine(model, config=cfg.fault_tolerance)
        assert engine.config is cfg.fault_tolerance and engine.idle_exit == 5.0 and engine.base == str(tmp_path)
        engine.close(shutdown=True)
    finally:
        stop_snapshot_processes(tmp_path)


# a valid value other than the job's default for the SFTConfig fields whose type does not say which (an enum, a
# JSON object, a path, a name), with what else it needs to be valid
TRAINER_SAMPLES = {
    "lr_scheduler_type": "cosine",
    "optim": "sgd",
    "logging_strategy": "epoch",
    "eval_strategy": "steps",
    "save_strategy": "epoch",
    "hub_strategy": "end",
    "include_num_input_tokens_seen": "all",
    "log_level": "info",
    "log_level_replica": "error",
    "truncation_mode": "keep_end",
    "packing_strategy": "wrapped",
    "loss_type": "dft",
    "train_sampling_strategy": "sequential",
    "dataloader_multiprocessing_context": "spawn",
    "debug": ["underflow_overflow"],
    "lr_scheduler_kwargs": {"num_cycles": 1},
    "activation_checkpointing_kwargs": {"use_reentrant": False},
    "gradient_checkpointing_kwargs": {"use_reentrant": False},
    "liger_kernel_config": {"rope": True},
    "accelerator_config": {"split_batches": True},
    "fsdp_config": {"min_num_params": 10},
    "model_init_kwargs": {"revision": "main"},
    "dataset_kwargs": {"add_special_tokens": False},
    "report_to": "tensorboard",
    "include_for_metrics": ["inputs"],
    "label_names": ["labels"],
    "optim_target_modules": "q_proj",
    "trackio_static_space_id": "org/space",
    "pad_to_multiple_of": 8,
    "output_dir": "/tmp/elsewhere",
    "torch_compile_backend": "inductor",
    "torch_compile_mode": "reduce-overhead",
    "eos_token": "</s>",
    "pad_token": "<pad>",
    "chat_template_path": "template.jinja",
    "dataset_text_field": "body",
    "metric_for_best_model": "loss",
    "resume_from_checkpoint": "/tmp/ckpt",
    "optim_args": "a=1",
    "hub_token": "x",
    "hub_model_id": "o/m",
    "hub_revision": "dev",
    "run_name": "r",
    "project": "p",
    "trackio_space_id": "o/s",
    "trackio_bucket_id": "b",
    "length_column_name": "len",
    "ddp_timeout": 60,
    "max_steps": 7,
    "local_rank": 0,
    "logging_steps": 7,
    "dataloader_prefetch_factor": 3,
    "dataloader_pin_memory": False,
    "ddp_backend": "gloo",
}
TRAINER_NEEDS = {
    "dataloader_prefetch_factor": {"dataloader_num_workers": 1},
    "load_best_model_at_end": {"eval_strategy": "steps", "save_strategy": "steps", "save_steps": 400},
}
# refused by SFTConfig itself on this machine (the job passes the refusal on, naming SFTConfig): a GPU feature, and
# a backend that needs the process group the job creates later
REFUSED_HERE = {"tf32", "ddp_backend"} if not torch.cuda.is_available() else {"ddp_backend"}
# set from Python only: an accelerate ParallelismConfig object (no flag or YAML scalar can carry it)
OBJECT_FIELDS = {"parallelism_config"}
# the names the job's own sections take: hf_dtrain's engines set the Trainer's (DeepSpeed's config, FSDP2)
OWNED = {"fsdp", "deepspeed"}


def _trainer_sample(name, tp, default):
    if name in TRAINER_SAMPLES:
        return TRAINER_SAMPLES[name]
    kinds = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    if bool in kinds or isinstance(default, bool):
        return not bool(default)
    if int in kinds:
        return (default or 1) + 2
    if float in kinds:
        return round((default or 0.5) * 0.5 + 0.25, 6)
    raise AssertionError(f"no sample value for SFTConfig.{name} ({tp}): add one to TRAINER_SAMPLES")


def _words(value):
    import json

    if isinstance(value, bool):
        return ["true" if value else "false"]
    if isinstance(value, dict):
        return [json.dumps(value)]
    if isinstance(value, list):
        return [str(v) for v in value]
    return [str(value)]


def test_every_sft_config_field_is_a_flag_and_a_yaml_key_that_reaches_the_trainer_unchanged():
    """Each field of TRL's SFTConfig (so of TrainingArguments), given as a flag and as a top-level YAML key, reaches
    the arguments the job hands the SFTTrainer as SFTConfig itself makes it from the same value (refusals
    included)."""
    from trl import SFTConfig

    hints = typing.get_type_hints(SFTConfig)
    parser = build_parser("finetune")
    flags = {s for a in parser._actions for s in a.option_strings}
    default = FinetuneConfig().training_args()
    checked, refused = 0, set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for f in dataclasses.fields(SFTConfig):
            if not f.init or f.name in OWNED or f.name in OBJECT_FIELDS:
                assert f"--{f.name}" not in flags or f.name in OWNED, f.name
                continue
            value = _trainer_sample(f.name, hints[f.name], getattr(default, f.name))
            extra = TRAINER_NEEDS.get(f.name, {})
            argv = [f"--{f.name.replace('_', '-')}", *_words(value)]
            for k, v in extra.items():
                argv += [f"--{k}", *_words(v)]
            data = {f.name: value, **extra}
            try:
                cfg = job_config_from_args(parser.parse_args(argv), FinetuneConfig)
                expected = SFTConfig(**{**cfg.training_defaults(), **data})
            except ValueError as e:
                assert f.name in REFUSED_HERE, (f.name, e)
                with pytest.raises(ValueError, match="refused by SFTConfig"):
                    FinetuneConfig.from_dict(data)
                refused.add(f.name)
                continue
            assert set(cfg.training) == set(data), f.name  # the flag gave that setting and nothing else
            got = cfg.training_args()
            assert getattr(got, f.name) == getattr(expected, f.name), (f.name, getattr(got, f.name))
            assert FinetuneConfig.from_dict(data).training_args().to_dict() == got.to_dict(), f.name  # YAML
            checked += 1
    assert refused == REFUSED_HERE
    assert checked == len([f for f in dataclasses.fields(SFTConfig) if f.init]) - len(OWNED | OBJECT_FIELDS | refused)


def test_importing_a_tuner_method_module_first_works_and_registers_it():
    """Each tuner pushes its fine-tuning entry when its method.py is imported; the registry imports no tuner, so a
    fresh interpreter can import any method.py first."""
    import subprocess
    import sys

    procs = {}
    for name in ("smt", "lorafa", "qbara", "qahira"):
        code = (
            f"import hf_dtrain.tuners.{name}.method as job; from hf_dtrain.tuners.finetune_method import "
            f"FINETUNE_METHODS; assert FINETUNE_METHODS[{name!r}] is job.METHOD; print('ok')"
        )
        procs[name] = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0 and out.strip().endswith("ok"), (name, err[-2000:])


def test_short_forms_and_off():
    cfg = PretrainConfig.from_dict({"comm_hook": "dear", "delta": 2e8, "fault_tolerance": True})
    assert (
        cfg.comm_hook.method == "dear" and cfg.delta.budget == 200_000_000 and cfg.fault_tolerance == SnapshotConfig()
    )
    cfg = PretrainConfig.from_dict({"comm_hook": None, "delta": None, "fault_tolerance": False})
    assert cfg.comm_hook is None and cfg.delta is None and cfg.fault_tolerance is None
    with pytest.raises(ValueError, match=r"PretrainConfig.eva cannot be switched off"):
        PretrainConfig.from_dict({"eva": None})


def test_the_jobs_train_in_bf16_on_a_cpu_that_computes_it_and_in_fp32_where_it_is_emulated(monkeypatch):
    """The fine-tuning jobs' default precision follows ``hf_dtrain.precision.cpu_bf16`` on a CPU (no GPU here):
    bf16 autocast where AMX or AVX-512 BF16 compute it, fp32 where it is emulated or HF_DTRAIN_CPU_BF16=0 says so;
    gradient checkpointing stays off on CPU either way, and --bf16 false wins."""
    import torch

    from hf_dtrain import precision
    from hf_dtrain.jobs.sft.config import FinetuneConfig, checkpointing_field

    if torch.cuda.is_available():
        pytest.skip("the CPU default: this machine has a GPU, whose bf16 support decides instead")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    monkeypatch.delenv(precision.CPU_BF16_ENV, raising=False)
    defaults = FinetuneConfig().training_defaults()
    assert defaults["bf16"] is True and defaults[checkpointing_field()] is False
    assert FinetuneConfig(training={"bf16": False}).training_args().bf16 is False
    monkeypatch.setenv(precision.CPU_BF16_ENV, "0")
    assert FinetuneConfig().training_defaults()["bf16"] is False
    monkeypatch.delenv(precision.CPU_BF16_ENV)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    assert FinetuneConfig().training_defaults()["bf16"] is False


def test_an_hqq_base_computing_in_float32_trains_in_fp32_and_bf16_is_refused_before_any_step(monkeypatch):
    """HQQ's autograd function ignores autocast: under bf16 autocast its backward meets a bf16 gradient with its
    float32 weight and fails at the first step (seen with QA-HiRA and peft's LoRA on SmolLM2 on a bf16 CPU). So an
    HQQ base computing in float32 trains in fp32 by default, --bf16 with it is refused naming --torch-dtype, and
    with --torch-dtype bfloat16 the default is bf16 again."""
    import torch

    from hf_dtrain import precision
    from hf_dtrain.jobs.sft.config import FinetuneConfig
    from hf_dtrain.settings import SettingsError

    if torch.cuda.is_available():
        pytest.skip("the CPU default: this machine has a GPU, whose bf16 support decides instead")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    monkeypatch.delenv(precision.CPU_BF16_ENV, raising=False)
    assert FinetuneConfig(method="qahira", quantize="int4").training_defaults()["bf16"] is True
    assert FinetuneConfig(method="qahira", quantize="hqq4").training_defaults()["bf16"] is False
    assert FinetuneConfig(method="lora", quantize="hqq4").training_defaults()["bf16"] is False
    cfg = FinetuneConfig(method="qahira", quantize="hqq4", torch_dtype="bfloat16")
    assert cfg.training_defaults()["bf16"] is True
    with pytest.raises(SettingsError, match=r"--bf16 with --quantize hqq4 needs --torch-dtype bfloat16"):
        FinetuneConfig(method="qahira", quantize="hqq4", training={"bf16": True})
