"""``hf-dtrain finetune --fsdp --fault-tolerance``: the Trainer on FSDP2 shards (2 gloo ranks), each rank
snapshotting its own shards and restoring them in place.

* LoRA-FA with its own optimizer, each rank its own emulated node, killed 10 times at seeded random moments
  (start-up, mid-step, mid-snapshot, after a snapshot, a node lost with its snapshot process, after the last step):
  every step's logged loss equals the uninterrupted run's (``float.hex``), none missing, and no process is left;
* each rank its own emulated node, one lost with its snapshot process: rebuilt from the other's parity; then every
  node's memory lost: the disk copy;
* every other method (SMT, QA-HiRA on dense and INT4 bases, Q-BaRA on NF4, LoRA-FA under AdamW) on FSDP2 and LoRA-FA
  and SMT on DDP, through a trainer killed mid-step (memory), a node lost (parity) and every node's memory lost (the
  disk copy), one per generation;
* under ``accelerate launch --max_restarts`` with the FSDP2 launch config (``recipes/accelerate/fsdp2_cpu_2proc.yaml``:
  on CPU hf_dtrain shards with its settings), LoRA with AdamW killed mid-step: the same, against the same config
  uninterrupted, and the last generation restored a snapshot.

Every test also compares the saved adapter with the uninterrupted run's, bit for bit. All but the last relaunch the
same command after each failed generation the way ``torchrun --max-restarts`` does
(:func:`hf_dtrain.testing.relaunched`), every generation's ranks forked from the tests' preloaded forkserver instead of
fresh interpreters: what they test is each method's restore, not the launcher, and it saves 6-10 s of imports a rank
and generation. The launchers' own restarts of this job are the last test's (accelerate launch) and
tests/fault/test_preemption.py's (torchrun and accelerate launch, LoRA-FA on FSDP2 and LoRA on DDP).
"""

import json
import os
import random
import re
import sys

import pytest

from hf_dtrain import processes
from hf_dtrain.testing import free_port, relaunch_output, relaunched, stop_snapshot_processes
from hf_dtrain.testing.fault import KILL_PHASES, saved_tensors_differ

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS, KILLS, WORLD = 20, 10, 2
RESUMED = re.compile(r"resuming from step (\d+) restored from (\w+)")  # each rank, each restore


def job(base, out, ft_dir=None, fsdp=True, method="lora"):
    cli = [
        "hf_dtrain.cli",
        "finetune",
        "--model",
        base,
        "--method",
        method,
        "--max-steps",
        str(STEPS),
        "--per-device-train-batch-size",
        "4",
        "--train-size",
        "200",
        "--eval-size",
        "8",
        "--logging-steps",
        "1",
        "--learning-rate",
        "1e-2",
        "--warmup-steps",
        "2",
        "--progress",
        "false",
        "--report",
        "false",
        "--output-dir",
        str(out),
    ]
    if fsdp:
        cli.append("--fsdp")
    if ft_dir is not None:
        cli += ["--fault-tolerance.directory", str(ft_dir)]
    return cli


def run(cmd, out):
    import subprocess

    env = dict(
        os.environ,
        ACCELERATE_USE_CPU="true",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
    )
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "launch.out"), "w") as log:
        proc = processes.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, open(os.path.join(out, "launch.out")).read()[-4000:]


def losses(out):
    """step -> loss (``float.hex``) of the Trainer's log history, which the restored runs carry on."""
    return {int(k): float(v).hex() for k, v in json.load(open(os.path.join(out, "results.json")))["losses"].items()}


def kill_schedule(seed: int) -> str:
    """One kill per generation on a random rank: 1 or 2 snapshots into the generation (so every kill happens before
    the run can finish), at a random phase, one of them (a seeded generation) a node lost with its snapshot process;
    the last one after the last step's snapshot."""
    rng = random.Random(seed)
    entries = [f"{g}:{rng.randrange(WORLD)}:{rng.randint(1, 2)}:{rng.choice(KILL_PHASES)}" for g in range(KILLS - 1)]
    # the node lost at its generation's 2nd snapshot: a generation that started afresh (after a kill at start-up)
    # has no earlier step, and a node lost before its first step's parity is complete leaves none to rebuild
    lost = rng.randrange(1, KILLS - 1)
    entries[lost] = f"{lost}:{rng.randrange(WORLD)}:2:node_lost"
    return ",".join(entries + [f"{KILLS - 1}:{rng.randrange(WORLD)}:@{STEPS}:after_snapshot"])


@pytest.fixture(scope="module")
def base(tiny_base):
    return tiny_base(50)


def _killed(tmp_path, base, launcher, kills, fsdp=True, method="lora", extra=()):
    out, ft_dir, log = tmp_path / "run", tmp_path / "ft", tmp_path / "kills"
    try:
        run(
            [
                sys.executable,
                *launcher,
                "hf_dtrain.testing.fault",
                "--kills",
                kills,
                "--kill-log",
                str(log),
                *job(base, out, ft_dir, fsdp, method),
                *extra,
            ],
            out,
        )
        happened = open(log).read().split()
        assert len(happened) == len(kills.split(",")), happened  # each planned kill happened
        return out, ft_dir, happened
    finally:
        stop_snapshot_processes(ft_dir)


def _forked(tmp_path, base, name, method="lora", fsdp=True, extra=(), restarts=0, kills=None):
    """The job on WORLD ranks forked from the preloaded forkserver, each rank its own emulated node, relaunched after
    each generation that lost a rank, up to ``restarts`` times; ``kills``: the fault injector's schedule. Returns the
    output folder, the fault-tolerance folder and every rank's output, generation by generation."""
    out, ft_dir = tmp_path / name, tmp_path / f"{name}_ft"
    cli = [*job(base, out, ft_dir if kills is not None else None, fsdp, method), *extra]  # the reference: no snapshots
    if kills is not None:
        cli = [
            "hf_dtrain.testing.fault",
            "--emulate-nodes",
            "--kills",
            kills,
            "--kill-log",
            str(tmp_path / "kills"),
            *cli,
        ]
    try:
        codes = relaunched(
            [sys.executable, "-m", *cli],
            WORLD,
            str(out),
            restarts=restarts,
            env={"ACCELERATE_USE_CPU": "true"},
            timeout=900,
        )
        said = relaunch_output(str(out), range(WORLD))
        assert codes[-1] == [0] * WORLD, (codes, said[-4000:])
        if kills is not None:
            happened = open(tmp_path / "kills").read().split()
            assert len(happened) == len(kills.split(",")) == len(codes) - 1, (happened, codes)  # each planned kill
        return out, ft_dir, said
    finally:
        stop_snapshot_processes(ft_dir)


def _smp_left(ft_dir):
    from tests.fault.test_relaunch import _alive, _smp_pids

    return [p for p in _smp_pids(str(ft_dir)) if _alive(p)]


@pytest.mark.resume_cell("LoRA-FA, its own optimizer", "the Trainer, FSDP2", "memory", "parity")
def test_finetune_fsdp_resumes_exactly_after_10_kills(tmp_path, base):
    """LoRA-FA (the default method) with its own optimizer, which keys its state by module name: each restored
    shard of that state is made a DTensor again on its parameter's layout (it was restored whole and failed at the
    first step: "Attempting to broadcast a dimension of length 64"). Relaunched as torchrun does; the same job under
    ``torchrun --max-restarts`` itself is tests/fault/test_preemption.py's LoRA-FA FSDP2 case (three restores)."""
    ref, _, _ = _forked(tmp_path, base, "ref", method="lorafa")
    want = losses(ref)
    assert sorted(want) == list(range(1, STEPS + 1))
    kills = kill_schedule(seed=5)
    out, ft_dir, _ = _forked(tmp_path, base, "run", method="lorafa", restarts=KILLS, kills=kills)
    assert losses(out) == want  # every step, bit for bit, none missing
    assert not saved_tensors_differ(ref, out)  # and the saved adapter
    results = json.load(open(out / "results.json"))
    assert results["engine"] == "fsdp2"
    assert results["fault_tolerance"]["restored"] == {"step": STEPS, "source": "memory"}  # killed after the last
    assert not _smp_left(ft_dir)  # the finished run stopped its snapshot processes


# the resume matrix's Trainer cells beyond the tests above: (id, method, its extra flags, FSDP2 or DDP)
METHODS = [
    ("smt-fsdp2", "smt", [], True),
    ("qahira-int4-fsdp2", "qahira", ["--quantize", "int4"], True),  # its packed 4-bit weights sharded
    ("qahira-fsdp2", "qahira", [], True),  # on a dense base
    ("qbara-nf4-fsdp2", "qbara", ["--quantize", "nf4"], True),  # bitsandbytes' CPU 4-bit path
    ("lorafa-adamw-fsdp2", "lorafa", ["--lorafa.optimizer", "false"], True),  # LoRA-FA under the Trainer's AdamW
    ("lorafa-ddp", "lorafa", [], False),  # with its own optimizer
    ("smt-ddp", "smt", [], False),
]


@pytest.mark.parametrize("method, extra, fsdp", [m[1:] for m in METHODS], ids=[m[0] for m in METHODS])
@pytest.mark.resume_cell(
    "LoRA-FA under AdamW, SMT, QA-HiRA on an INT4 and on a dense base, Q-BaRA on NF4",
    "the Trainer, FSDP2",
    "memory",
    "parity",
    "disk",
)
@pytest.mark.resume_cell("LoRA-FA with its own optimizer, SMT", "the Trainer, DDP", "memory", "parity", "disk")
def test_each_method_resumes_exactly_from_memory_parity_and_disk(tmp_path, base, method, extra, fsdp):
    """Each rank its own emulated node, every snapshot also written to disk; relaunched after three failures at seeded
    steps, one per generation: a rank killed mid-step (the next generation restores from memory), a node lost with
    its snapshot process (rebuilt from the other's parity), then every node's memory lost (the disk copy). Every
    logged loss and the saved adapter equal the uninterrupted run's, bit for bit."""
    ref, _, _ = _forked(tmp_path, base, "ref", method, fsdp, extra)
    rng = random.Random(f"{method} {extra} {fsdp}")
    kills = ",".join(
        [
            f"0:{rng.randrange(WORLD)}:{rng.randint(2, 4)}:mid_step",
            f"1:{rng.randrange(WORLD)}:@{rng.randint(7, 10)}:node_lost",
            f"2:{rng.randrange(WORLD)}:@{rng.randint(13, 16)}:all_lost",
        ]
    )
    disk = ["--fault-tolerance.persist-dir", str(tmp_path / "disk"), "--fault-tolerance.persist-every", "1"]
    out, ft_dir, said = _forked(tmp_path, base, "run", method, fsdp, [*extra, *disk], restarts=3, kills=kills)
    assert losses(out) == losses(ref)
    assert not saved_tensors_differ(ref, out)  # the saved adapter, bit for bit
    # each generation's restore, as every rank logged it: one source for all ranks, the one its failure leaves
    said = RESUMED.findall(said)
    assert [source for _, source in said] == [s for s in ("memory", "parity", "disk") for _ in range(WORLD)], said
    assert json.load(open(out / "results.json"))["engine"] == ("fsdp2" if fsdp else "ddp")
    assert not _smp_left(ft_dir)


@pytest.mark.resume_cell("peft LoRA", "the Trainer, FSDP2", "parity", "disk")
def test_a_lost_node_under_the_trainer_is_rebuilt_from_parity_then_every_node_from_disk(tmp_path, base):
    """Each rank its own emulated node (``--emulate-nodes``), every 2nd snapshot also on disk: rank 1 and its node's
    snapshot process killed at once after a seeded step's snapshot; the restart rebuilds that node's snapshot from the
    other's parity. Then every node's memory is lost after a later step's snapshot: the restart reads the disk copy.
    Every logged loss and the saved adapter equal the uninterrupted run's. (With parity 0 and no disk copy the first
    restart is refused: the node's snapshot is lost.)"""
    ref, _, _ = _forked(tmp_path, base, "ref")
    rng = random.Random("node lost")
    step, later = rng.randint(3, 6), rng.choice((12, 14))
    disk = ["--fault-tolerance.persist-dir", str(tmp_path / "disk"), "--fault-tolerance.persist-every", "2"]
    kills = f"0:1:@{step}:node_lost,1:0:@{later}:all_lost"
    out, ft_dir, said = _forked(tmp_path, base, "run", extra=disk, restarts=2, kills=kills)
    assert losses(out) == losses(ref)
    assert not saved_tensors_differ(ref, out)  # the saved adapter, bit for bit
    said = [(int(s), source) for s, source in RESUMED.findall(said)]
    # the step, or the one before when the lost node's parity exchange of its last step had not finished (a step at
    # most: docs/fault_tolerance.md, Limits); the Trainer trains that step again, with the same losses
    assert [source for _, source in said] == ["parity"] * WORLD + ["disk"] * WORLD, said
    assert all(s in (step - 1, step) for s, _ in said[:WORLD]), said
    # the disk copy of the later step, or of the one before it when the other rank's write was still going
    assert all(s in (later - 2, later) for s, _ in said[WORLD:]), said
    assert not _smp_left(ft_dir)


@pytest.mark.resume_cell("peft LoRA", "the Trainer, FSDP2", "memory")
def test_accelerate_fsdp2_config_killed_mid_step_resumes_exactly(tmp_path, base):
    accelerate = [
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        os.path.join(ROOT, "recipes", "accelerate", "fsdp2_cpu_2proc.yaml"),
        "--monitor_interval",
        "0.2",
    ]
    ref = tmp_path / "ref"
    run([sys.executable, *accelerate, "--main_process_port", str(free_port()), "-m", *job(base, ref, fsdp=False)], ref)
    # rank 1 dies in step 4, after its forward and backward; rank 0 after step 7's snapshot is committed
    out, ft_dir, _ = _killed(
        tmp_path,
        base,
        [*accelerate, "--main_process_port", str(free_port()), "--max_restarts", "2", "-m"],
        "0:1:3:mid_step,1:0:4:after_snapshot",
        fsdp=False,
    )
    # the launch config's FSDP2 settings were used (hf_dtrain's own sharding on CPU), the last generation restored
    # rank 0's last snapshot from memory (a restart from scratch gives the same losses), and the losses are exact
    results = json.load(open(out / "results.json"))
    assert results["engine"] == "fsdp2"
    restored = results["fault_tolerance"]["restored"]
    assert restored is not None and restored["source"] == "memory" and restored["step"] >= 4, restored
    assert losses(out) == losses(ref)
    assert not saved_tensors_differ(ref, out)  # the saved adapter, bit for bit
    assert not _smp_left(ft_dir)
