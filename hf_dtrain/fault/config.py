"""``SnapshotConfig``: how often and where in-memory snapshots are taken, and how they are protected. Every field is
a ``--fault-tolerance.<field>`` flag of ``hf-dtrain finetune`` / ``pretrain`` and a key of the ``fault_tolerance:``
YAML section (``fault_tolerance: true`` turns it on with these defaults); ``SnapshotEngine(..., config=...)`` and
``InMemoryFaultToleranceCallback(config)`` take it unchanged."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from hf_dtrain.settings import check_fields, setting


@dataclass
class SnapshotConfig:
    """In-memory fault tolerance settings (validated on construction)."""

    section_key: ClassVar[str] = "fault_tolerance"  # flags --fault-tolerance.<field>, YAML fault_tolerance:

    every_n_steps: int = setting(1, "Snapshot every N optimizer steps.", min=1)
    parity: int = setting(
        1, "Lost nodes to survive: erasure coding across nodes (XOR for 1, Reed-Solomon above; 0: off).", min=0
    )
    group_size: int | None = setting(
        None, "Nodes per erasure-coding group (more than parity); default all nodes in one group.", min=1
    )
    persist_every: int = setting(
        0, "Also write every N-th snapshot to disk as safetensors, in the background (0: never).", min=0
    )
    persist_dir: str | None = setting(
        None, "Where the disk snapshots go (the jobs default to <output_dir>/snapshots when persist_every > 0)."
    )
    directory: str | None = setting(
        None,
        "Private directory of the snapshot processes (sockets, key, logs); default a per-user, per-job "
        "directory under the system's temporary directory.",
    )
    timeout: float = setting(
        60.0, "Seconds to wait for the snapshot process and for the other ranks before failing with a message.", gt=0
    )
    idle_exit: float = setting(
        300.0,
        "Grace period: a snapshot process exits once no trainer and no launcher of its job (torchrun's or "
        "accelerate's elastic agent, which may restart them) has been alive for this many seconds, so a "
        "crashed job does not hold memory; relaunch by hand within it to resume from memory.",
        gt=0,
    )
    fresh_start: bool = setting(
        False,
        "Train from step 0 although this job has snapshots: they are discarded (disk snapshots are moved "
        "aside to <persist_dir>.discarded-<time>). Without it, a job whose snapshots are lost or belong to "
        "another job stops with a message instead of starting over.",
    )
    preempt_deadline: float = setting(
        30.0,
        "SIGTERM or SIGUSR1 (a preemption notice) to the ranks: seconds they have to finish the step, agree on it and "
        "write its snapshot to persist_dir before exiting with status 128 + the signal (a relaunch resumes after that "
        "step); 0: the signal ends a rank as a crash would.",
        min=0,
    )
    trainable_only: bool | None = setting(
        None, "Store only trainable parameters; default: yes when some parameters are frozen (PEFT)."
    )

    def __post_init__(self):
        check_fields(self)

    @classmethod
    def from_any(cls, config: SnapshotConfig | None = None, **settings) -> SnapshotConfig:
        """``config`` with ``settings`` on top, or a config from ``settings`` alone (the keyword form the engine and
        the callback also accept)."""
        if config is None:
            return cls(**settings)
        return dataclasses.replace(config, **settings) if settings else config
