"""``hf-dtrain sweep``: a grid of ``hf-dtrain finetune`` jobs trained fused (HFTA) on one base model.

``run_sweep(SweepConfig(jobs=expand_grid(FinetuneConfig(method=..., ...), learning_rate=[1e-4, 3e-4],
lora_r=[8, 16], seed=[0, 1])))`` trains the K jobs as one model (:mod:`hf_dtrain.fused`): the frozen base runs once
per step for all of them, each job keeps its own adapter, rank, alpha, learning rate, schedule, seed (adapter init,
data and data order) and optimizer state. Each job is exactly a :class:`~hf_dtrain.jobs.sft.config.FinetuneJob`: alone,
``hf-dtrain finetune`` with the same settings trains the same adapter. Each job gets a standard peft adapter
directory with a model card and ``results.json`` under ``<output_dir>/<job>/``; the sweep writes ``sweep.json``,
``sweep.md`` (one row per job) and ``sweep.png`` (every job's loss curve).
"""

import lazy_loader as lazy

__getattr__, __dir__, __all__ = lazy.attach(
    __name__,
    submod_attrs={
        "config": [
            "FUSED_TRAINER_SETTINGS",
            "SHARED_AXES",
            "SHARED_PER_JOB",
            "SweepConfig",
            "add_arguments",
            "axis_types",
            "check_fusable",
            "config_from_args",
            "expand_grid",
            "fusable_methods",
            "grid_axes",
            "job_args",
            "job_name",
            "job_setting",
            "max_steps_of",
            "per_job",
        ],
        "run": ["main", "run_sweep"],
    },
)
