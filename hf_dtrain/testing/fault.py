"""Fault-tolerance test and benchmark helpers: the fault injector (an explicit testing hook on
:class:`~hf_dtrain.fault.SnapshotEngine`), the runner that installs it in a job launched as a module, the
fault-injection worker's launcher and log reader, and snapshot-process clean-up."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import runpy
import signal
import sys
import time

from hf_dtrain.fault import SnapshotEngine

from .launch import elastic_launch


def stop_snapshot_processes(directory) -> None:
    """SIGKILL every snapshot process under ``directory`` (``node*/smp.json``): test clean-up."""
    for info in glob.glob(os.path.join(str(directory), "node*", "smp.json")):
        with contextlib.suppress(ProcessLookupError, ValueError, OSError):
            os.kill(json.load(open(info))["pid"], signal.SIGKILL)


class FaultInjector:
    """A snapshot hook that SIGKILLs rank ``rank`` once its snapshot of ``step`` is committed, after ``delay`` more
    seconds (time for the parity exchange), as torchft's injector. ``spec``: ``"rank:step[:seconds]"``."""

    def __init__(self, spec: str):
        parts = spec.split(":")
        if len(parts) not in (2, 3):
            raise ValueError(f"fault spec {spec!r}: expected rank:step[:seconds]")
        self.rank, self.step = int(parts[0]), int(parts[1])
        self.delay = float(parts[2]) if len(parts) == 3 else 0.0

    def __call__(self, engine, step: int) -> None:
        if engine.rank == self.rank and step == self.step:
            engine.wait()
            time.sleep(self.delay)
            os.kill(os.getpid(), signal.SIGKILL)


KILL_PHASES = ("startup", "mid_step", "mid_snapshot", "after_snapshot")  # what a node keeps: the seeded schedules
# and the node lost with its snapshot process (emulated nodes only), every node's memory lost (a disk copy needed)
ALL_PHASES = (*KILL_PHASES, "node_lost", "all_lost")


class KillSchedule:
    """Seeded kills of a job under a restarting launcher, one entry per generation: ``gen:rank:when:phase`` entries,
    comma-separated. ``gen``: the launch (torchrun's ``TORCHELASTIC_RESTART_COUNT``, else
    ``HF_DTRAIN_FAULT_GENERATION``, else 0); ``when``: ``n`` (this process's n-th snapshot) or ``@S`` (the snapshot
    of step S); ``phase``:

    * ``startup``: as the process starts, before the job runs (``when`` is ignored);
    * ``mid_snapshot``: as soon as the snapshot is started, its copy in flight (not committed);
    * ``after_snapshot``: once the snapshot is committed (``@<last step>``: after the last step);
    * ``mid_step``: in the next step, after its forward and backward, before its optimizer step (the engine's
      ``wait``);
    * ``node_lost``: once the snapshot is committed, the rank and its node's snapshot process at once (wherever its
      parity exchange is): the restart rebuilds the node's snapshot from its peers' parity;
    * ``all_lost``: once the snapshot is committed and this rank's disk copy of it written (``persist_every``), every
      node's snapshot process and the rank: no memory copy is left anywhere, the restart reads the disk copy.

    Each kill is recorded as a ``gen:rank:step:phase`` line in ``log`` before the process SIGKILLs itself."""

    def __init__(self, spec: str, log: str, generation: int | None = None, rank: int | None = None):
        self.generation = (
            generation
            if generation is not None
            else int(os.environ.get("TORCHELASTIC_RESTART_COUNT", os.environ.get("HF_DTRAIN_FAULT_GENERATION", "0")))
        )
        self.rank = rank if rank is not None else int(os.environ.get("RANK", "0"))
        self.log, self.count, self.entry = log, 0, None
        for item in filter(None, spec.split(",")):
            parts = item.split(":")
            if len(parts) != 4 or parts[3] not in ALL_PHASES:
                raise ValueError(
                    f"kill schedule entry {item!r}: expected gen:rank:when:phase with phase one of "
                    f"{', '.join(ALL_PHASES)}"
                )
            gen, rank, when, phase = parts
            if int(gen) == self.generation and int(rank) == self.rank:
                self.entry = (when, phase)

    def die(self, step, phase: str) -> None:
        with open(self.log, "a") as f:
            f.write(f"{self.generation}:{self.rank}:{step}:{phase}\n")
        os.kill(os.getpid(), signal.SIGKILL)

    def at_start(self) -> None:
        if self.entry is not None and self.entry[1] == "startup":
            self.die(0, "startup")

    def __call__(self, engine, step: int) -> None:
        self.count += 1
        if self.entry is None:
            return
        when, phase = self.entry
        if phase == "startup" or not (self.count == int(when) if when[0] != "@" else step == int(when[1:])):
            return
        if phase == "mid_snapshot":
            self.die(step, phase)
        engine.wait()
        if phase == "node_lost":
            with contextlib.suppress(ProcessLookupError, OSError, ValueError):
                os.kill(json.load(open(os.path.join(engine.dir, "smp.json")))["pid"], signal.SIGKILL)
        if phase == "all_lost":
            engine.persister.join()
            stop_snapshot_processes(os.path.dirname(engine.dir))
        if phase in ("after_snapshot", "node_lost", "all_lost"):
            self.die(step, phase)
        engine.wait = lambda: self.die(step + 1, phase)  # the next step's wait, before its optimizer step


def main(argv=None) -> None:
    """Run ``python -m MODULE ARGS`` with a fault injector on every snapshot engine the run creates:

    * ``python -m hf_dtrain.testing.fault RANK:STEP[:SECONDS] MODULE [ARGS...]``: a :class:`FaultInjector`;
    * ``python -m hf_dtrain.testing.fault --kills SPEC --kill-log FILE MODULE [ARGS...]``: a :class:`KillSchedule`
      (under ``torchrun --max-restarts``, a kill per generation).

    ``--emulate-nodes`` first: every rank is a node of its own (``HF_DTRAIN_NODE_RANK`` its rank,
    ``LOCAL_WORLD_SIZE`` 1), with its own snapshot process, so a lost node is rebuilt from the others' parity."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--emulate-nodes"]:
        os.environ.update(HF_DTRAIN_NODE_RANK=os.environ.get("RANK", "0"), LOCAL_WORLD_SIZE="1")
        argv = argv[1:]
    usage = (
        "usage: python -m hf_dtrain.testing.fault (RANK:STEP[:SECONDS] | --kills SPEC --kill-log FILE) MODULE [ARGS...]"
    )

    if argv[:1] == ["--kills"]:
        if len(argv) < 5 or argv[2] != "--kill-log":
            raise SystemExit(usage)
        hook = KillSchedule(argv[1], argv[3])
        hook.at_start()
        argv = argv[4:]
    elif len(argv) >= 2:
        hook = FaultInjector(argv[0])
        argv = argv[1:]
    else:
        raise SystemExit(usage)
    SnapshotEngine.default_snapshot_hooks.append(hook)
    sys.argv = [argv[0], *argv[1:]]
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


def ft_worker_command() -> list[str]:
    """The command of one rank of the fault-injection worker (:mod:`hf_dtrain.testing.ft_worker`)."""
    return [sys.executable, "-m", "hf_dtrain.testing.ft_worker"]


def launch_ft_workers(world: int, env: dict, timeout: float = 180) -> list[int]:
    """All ranks of the fault-injection worker at once; when one dies the others are killed (torchrun's elastic
    agent); returns the exit codes. ``env``: the worker's ``FT_*`` settings (``FT_OUT`` is also the log directory).
    A rank that outlives its peers' error exits has its stacks written to its log before it is killed."""
    return elastic_launch(
        ft_worker_command(), world, env, timeout, log_dir=env["FT_OUT"], dump_signal=signal.SIGUSR1, preloaded=True
    )


def failed_outputs(out: str, codes: list[int], chars: int = 3000) -> str:
    """The output tails of the ranks whose exit code is not 0 (an assertion message): the rank that failed, not
    rank 0, which the launcher may have killed after it. Deprecation warnings are left out."""
    parts = []
    for rank, code in enumerate(codes):
        if code != 0:
            path = os.path.join(out, f"rank{rank}.out")
            lines = open(path).read().splitlines() if os.path.exists(path) else ["(no output file)"]
            text = "\n".join(l for l in lines if "FutureWarning" not in l and "return func(" not in l)
            parts.append(f"--- rank {rank} exited {code}:\n{text[-chars:]}")
    return "\n".join(parts) or "every rank exited 0"


def worker_losses(out: str, rank: int = 0) -> dict[int, str]:
    """Step -> loss (hex) from a fault-injection worker's log; a step run again after a restore overwrites the one
    before."""
    got = {}
    for line in open(os.path.join(out, f"rank{rank}.log")):
        step, loss = line.split()
        got[int(step)] = loss
    return got


def tensors_differ(want: dict, got: dict) -> list[str]:
    """The keys of two name -> tensor dicts whose tensors differ (dtype, shape or any value, bitwise), and the keys
    on one side only; ``[]`` when they are equal."""
    import torch

    differ = [f"{key} on one side only" for key in sorted(want.keys() ^ got.keys())]
    return differ + [
        key
        for key in sorted(want.keys() & got.keys())
        if want[key].dtype != got[key].dtype or not torch.equal(want[key], got[key])
    ]


def saved_tensors_differ(ref: str, out: str, pattern: str = "*.safetensors") -> list[str]:
    """The safetensors files ``pattern`` names in folder ``ref``, compared tensor by tensor with the same files in
    ``out``: what differs (a file or a key on one side only, a dtype, a shape, a value not bitwise equal); ``[]`` when
    every tensor is equal. A ``ref`` without such a file is an error (a comparison of nothing passes nothing)."""
    from safetensors.torch import load_file

    names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(str(ref), pattern)))
    if not names:
        raise AssertionError(f"no {pattern} under {ref} to compare")
    extra = sorted({os.path.basename(p) for p in glob.glob(os.path.join(str(out), pattern))} - set(names))
    differ = [f"{name}: only in {out}" for name in extra]
    for name in names:
        if not os.path.exists(os.path.join(str(out), name)):
            differ.append(f"{name}: not in {out}")
            continue
        want, got = load_file(os.path.join(str(ref), name)), load_file(os.path.join(str(out), name))
        differ += [f"{name}: {what}" for what in tensors_differ(want, got)]
    return differ


def worker_final_state_differs(ref: str, out: str) -> list[str]:
    """What differs between two fault-injection runs' final states (``rank{r}.final.safetensors``: every rank's
    parameters, optimizer parameters and optimizer state after the last step)."""
    return saved_tensors_differ(ref, out, "rank*.final.safetensors")


def kill_snapshot_process(directory: str, node: int) -> None:
    """SIGKILL node ``node``'s snapshot process (a lost node's memory)."""
    info = json.load(open(os.path.join(directory, f"node{node}", "smp.json")))
    os.kill(info["pid"], signal.SIGKILL)
    time.sleep(0.3)


if __name__ == "__main__":
    main()


# One failure of each kind, one generation each, in a 3-node run (parity 1, every 2nd snapshot persisted):
# (kill: rank:step:phase, snapshot processes killed after it, the restore source expected, the restored step expected
# at least). A trainer killed before its optimizer step; one killed mid-snapshot (written, not committed); a lost
# node (trainer and snapshot process); two lost nodes with parity for one (the disk copy).
FAILURE_CHAIN = [
    ("1:3:before_step", (), "memory", 2),
    ("2:5:mid_snapshot", (), "memory", 4),
    ("1:7:after_snapshot", (1,), "parity", 6),
    ("1:9:after_snapshot", (1, 2), "disk", 8),
]
FAILURE_CHAIN_STEPS = 12


def run_failure_chain(world: int, env: dict, ft_dir: str) -> list[list[str]]:
    """Launch the fault-injection worker through :data:`FAILURE_CHAIN`, one generation per failure (each relaunched
    as a user would after it), then once more to the end; returns rank 0's restore records (``[step, source]`` per
    relaunch). ``env``: the worker's settings (``FT_OUT``, ``FT_ENGINE``...); the kill schedule, the disk copy under
    ``ft_dir`` and the step count are added here."""
    out = env["FT_OUT"]
    env = {
        **env,
        "FT_DIR": ft_dir,
        "FT_PERSIST": os.path.join(ft_dir, "disk"),
        "FT_PERSIST_EVERY": "2",
        "FT_STEPS": str(FAILURE_CHAIN_STEPS),
        "FT_SHUTDOWN": "1",
        "FT_KILLS": ",".join(f"{g}:{kill}" for g, (kill, *_) in enumerate(FAILURE_CHAIN)),
    }
    try:
        for gen, (kill, lost, _, _) in enumerate(FAILURE_CHAIN):
            codes = launch_ft_workers(world, {**env, "FT_GEN": str(gen)})
            if not any(c == -signal.SIGKILL for c in codes):
                raise AssertionError(
                    f"generation {gen} ({kill}) did not fail as planned: {codes}; "
                    f"{open(os.path.join(out, 'rank0.out')).read()[-3000:]}"
                )
            for node in lost:
                kill_snapshot_process(ft_dir, node)
        codes = launch_ft_workers(world, {**env, "FT_GEN": str(len(FAILURE_CHAIN))})
        if codes != [0] * world:
            raise AssertionError(f"the last generation failed: {codes}; {failed_outputs(out, codes)}")
    finally:
        stop_snapshot_processes(ft_dir)
    return [line.split()[:2] for line in open(os.path.join(out, "rank0.restore"))]


def check_failure_chain(restores: list[list[str]]) -> None:
    """Each relaunch restored from the source its failure leaves, at the newest step it allows."""
    assert [source for _, source in restores] == [source for _, _, source, _ in FAILURE_CHAIN], restores
    for (step, _), (kill, _, source, least) in zip(restores, FAILURE_CHAIN):
        killed_at = int(kill.split(":")[1])
        assert least <= int(step) <= killed_at, (kill, restores)
        if source != "parity":  # memory and disk: exactly the newest step every rank committed (or persisted)
            assert int(step) == least, (kill, restores)
