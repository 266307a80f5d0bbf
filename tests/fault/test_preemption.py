"""Preemption: SIGTERM or SIGUSR1 sent from outside to every rank at once, at a seeded logged step, as a cloud's
shutdown or SLURM's ``--signal`` does. Ten notices over four jobs (pretrain and the Trainer; DDP and FSDP2; torchrun and
accelerate launch): every rank stops after the same step and says so, exits 128 + the signal, and the relaunch (by the
launcher's restarts, or by hand after the node's snapshot processes are gone, so from the disk copy) resumes right
after that step: every step logged exactly once, every loss equal to the uninterrupted run's (``float.hex``)."""

import json
import os
import random
import re
import signal
import sys

import pytest

from hf_dtrain.testing import free_port, relaunch_output, relaunched, stop_snapshot_processes
from hf_dtrain.testing.fault import saved_tensors_differ
from hf_dtrain.testing.preempt import run_preempted

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORLD = 2
PRETRAIN_STEPS, FINETUNE_STEPS = 24, 16
PRETRAIN = ["--seq-len", "16", "--per-device-train-batch-size", "2", "--data-bytes", "60000", "--eval-blocks", "2"]


def _env() -> dict:
    return dict(
        os.environ,
        ACCELERATE_USE_CPU="true",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
    )


def torchrun(restarts: int = 0) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(WORLD),
        "--monitor-interval",
        "0.2",
        "--max-restarts",
        str(restarts),
        "--master-port",
        str(free_port()),
        "-m",
    ]


def accelerate(config: str, restarts: int = 0) -> list[str]:
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        os.path.join(ROOT, "recipes", "accelerate", config),
        "--monitor_interval",
        "0.2",
        "--max_restarts",
        str(restarts),
        "--main_process_port",
        str(free_port()),
        "-m",
    ]


def pretrain(out, ft_dir=None, fsdp=False) -> list[str]:
    cli = ["hf_dtrain.cli", "pretrain", "--max-steps", str(PRETRAIN_STEPS), *PRETRAIN, "--logging-steps", "1"]
    cli += ["--progress", "false", "--output-dir", str(out)]
    if fsdp:
        cli.append("--fsdp")
    if ft_dir is not None:
        cli += ["--fault-tolerance.directory", str(ft_dir)]
    return cli


def finetune(base, out, ft_dir=None, fsdp=False, method="lora") -> list[str]:
    cli = ["hf_dtrain.cli", "finetune", "--model", base, "--method", method, "--max-steps", str(FINETUNE_STEPS)]
    cli += ["--per-device-train-batch-size", "4", "--train-size", "160", "--eval-size", "8", "--logging-steps", "1"]
    cli += ["--learning-rate", "1e-2", "--warmup-steps", "2", "--progress", "false", "--report", "false"]
    cli += ["--output-dir", str(out)]
    if fsdp:
        cli.append("--fsdp")
    if ft_dir is not None:
        cli += ["--fault-tolerance.directory", str(ft_dir)]
    return cli


def history(out) -> list[tuple[int, str]]:
    """pretrain's per-step lines (appended across relaunches): (step, loss as float.hex)."""
    lines = open(os.path.join(out, "history_rank0.jsonl")).read().split("\n")
    return [(r["step"], float(r["loss"]).hex()) for r in map(json.loads, filter(None, lines))]


def trainer_losses(out) -> dict[int, str]:
    return {int(k): float(v).hex() for k, v in json.load(open(os.path.join(out, "results.json")))["losses"].items()}


def uninterrupted(cli, out) -> None:
    """The reference: the job (``cli``, a module and its arguments) on WORLD ranks forked from the tests' preloaded
    forkserver (the launcher is what the preempted runs test; the reference needs only the same ranks and numbers)."""
    codes = relaunched([sys.executable, "-m", *cli], WORLD, str(out / "launch"), env={"ACCELERATE_USE_CPU": "true"})
    assert codes == [[0] * WORLD], relaunch_output(str(out / "launch"), range(WORLD))[-4000:]


def notices(seed: int, count: int, last: int) -> list[tuple[int, int]]:
    """``count`` (logged line, signal) pairs at seeded lines: apart enough for a restart to log again, before
    ``last``."""
    rng = random.Random(seed)
    lines, at = [], 0
    for _ in range(count):
        at += rng.randint(3, max(3, last // (count + 1)))
        lines.append(at)
    assert lines[-1] < last
    return [(n, rng.choice((signal.SIGTERM, signal.SIGUSR1))) for n in lines]


def check_stops(done, expected: int, resumed: str, sources=None) -> list[int]:
    """Each notice stopped every rank after one same step, said so, and the next generation resumed right after it
    (``resumed`` a pattern with {step} and {source}: ``sources[i]``, memory by default); returns the steps."""
    stops = done.stops()
    assert len(stops) == expected * WORLD, done.output[-4000:]
    steps = []
    for i in range(expected):
        pair = stops[i * WORLD : (i + 1) * WORLD]
        assert sorted(r for r, _, _ in pair) == list(range(WORLD)) and len({s for _, _, s in pair}) == 1, pair
        steps.append(pair[0][2])
        source = (sources or {}).get(i, "memory")
        assert re.search(resumed.format(step=pair[0][2], source=source), done.output), (pair, done.output[-4000:])
    assert all(n.seconds_to_exit is not None for n in done.notices), done.notices
    return steps


@pytest.fixture(scope="module")
def base(tiny_base):
    return tiny_base(50)


@pytest.mark.resume_cell("full training", "DDP, plain loop", "disk")
def test_pretrain_ddp_preempted_twice_resumes_from_disk_then_memory(tmp_path):
    """torchrun without restarts, relaunched by hand: the first notice's node loses its snapshot processes (the
    relaunch reads the disk copy the notice wrote), the second's keeps them (memory)."""
    ref, out, ft_dir = tmp_path / "ref", tmp_path / "run", tmp_path / "ft"
    uninterrupted(pretrain(ref), ref)
    try:
        rng = random.Random(11)
        for i, (signum, source) in enumerate(((signal.SIGTERM, "disk"), (signal.SIGUSR1, "memory"))):
            at = [(rng.randint(3, 8), signum)]
            done = run_preempted([*torchrun(), *pretrain(out, ft_dir)], _env(), at=at, cwd=ROOT)
            stops = done.stops()
            assert done.returncode != 0 and len(stops) == WORLD, done.output[-4000:]
            assert {s for _, s, _ in stops} == {signum.name} and len({step for _, _, step in stops}) == 1, stops
            # each rank's own status, as torchrun reports it: 128 + the signal (what launchers and requeues read)
            codes = [int(c) for c in re.findall(r"(?m)^\s*exitcode\s*:\s*(-?\d+) \(pid", done.output)]
            assert codes == [128 + signum] * WORLD, (codes, done.output[-3000:])
            if source == "disk":
                stop_snapshot_processes(ft_dir)  # the node is gone with its memory
            if i:
                assert re.search(r"resumed after step \d+ from disk", done.output), done.output[-3000:]
        last = run_preempted([*torchrun(), *pretrain(out, ft_dir)], _env(), at=[], cwd=ROOT)
        assert last.returncode == 0, last.output[-4000:]
        assert re.search(rf"resumed after step {stops[0][2]} from memory", last.output), last.output[-3000:]
        assert history(out) == history(ref)  # every step once, none lost, none repeated, bit for bit
        assert not saved_tensors_differ(ref, out)  # the saved model, bit for bit
    finally:
        stop_snapshot_processes(ft_dir)


@pytest.mark.resume_cell("full training", "FSDP2, plain loop", "memory")
def test_pretrain_fsdp2_under_accelerate_launch_preempted_twice(tmp_path):
    ref, out, ft_dir = tmp_path / "ref", tmp_path / "run", tmp_path / "ft"
    uninterrupted(pretrain(ref, fsdp=True), ref)
    try:
        done = run_preempted(
            [*accelerate("cpu_2proc.yaml", restarts=2), *pretrain(out, ft_dir, fsdp=True)],
            _env(),
            at=notices(21, 2, PRETRAIN_STEPS),
            cwd=ROOT,
        )
        assert done.returncode == 0, done.output[-4000:]
        check_stops(done, 2, r"resumed after step {step} from {source}")
        assert history(out) == history(ref)
        assert not saved_tensors_differ(ref, out)
    finally:
        stop_snapshot_processes(ft_dir)


@pytest.mark.parametrize(
    "launcher, fsdp, method, seed",
    [("torchrun", True, "lorafa", 31), ("accelerate", False, "lora", 41)],
    ids=["lorafa-fsdp2-torchrun", "lora-ddp-accelerate"],
)
@pytest.mark.resume_cell("peft LoRA", "the Trainer, DDP", "memory", "disk")
@pytest.mark.resume_cell("LoRA-FA, its own optimizer", "the Trainer, FSDP2", "memory", "disk")
def test_trainer_preempted_three_times_resumes_exactly(tmp_path, base, launcher, fsdp, method, seed):
    """The Trainer (LoRA-FA with its own optimizer, whose disk copy is the exact per-rank one; LoRA), preempted three
    times under the launcher's restarts, the node lost after the second
    notice (its snapshot processes killed once the ranks exited, before the restart starts Python): each notice's
    step is the step the next generation resumes after (from memory, from the disk copy the notice wrote, from
    memory), and the logged losses equal the uninterrupted run's."""

    def launch(restarts=0):
        return torchrun(restarts) if launcher == "torchrun" else accelerate("cpu_2proc.yaml", restarts)

    ref, out, ft_dir = tmp_path / "ref", tmp_path / "run", tmp_path / "ft"
    uninterrupted(finetune(base, ref, fsdp=fsdp, method=method), ref)
    try:
        done = run_preempted(
            [*launch(restarts=3), *finetune(base, out, ft_dir, fsdp=fsdp, method=method)],
            _env(),
            at=notices(seed, 3, FINETUNE_STEPS),
            cwd=ROOT,
            after_exit=lambda i: i == 1 and stop_snapshot_processes(ft_dir),
        )
        assert done.returncode == 0, done.output[-4000:]
        check_stops(done, 3, r"resuming from step {step} restored from {source}", sources={1: "disk"})
        assert trainer_losses(out) == trainer_losses(ref)
        assert not saved_tensors_differ(ref, out)  # the saved adapter, bit for bit
        assert json.load(open(out / "results.json"))["engine"] == ("fsdp2" if fsdp else "ddp")
    finally:
        stop_snapshot_processes(ft_dir)
