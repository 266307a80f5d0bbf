"""What hf_dtrain raises when the input, or the run, is wrong, and how a job's error boundary tells those apart from
bugs.

Every class here is a :class:`UserError`: its message names the input (a flag, a YAML key, a file and, for data, the
row or the column) and says what to do. ``hf-dtrain`` prints such an error as one line and exits with status 1; any
other exception is a bug and keeps its traceback. Each class also derives from the builtin a caller would catch
(``ValueError`` for bad input, ``RuntimeError`` for a run that failed), so ``except ValueError`` keeps working.

Library errors met while hf_dtrain loads a user's file (``datasets``, ``transformers``, ``peft``, ``safetensors``)
are caught where it loads them and re-raised as one of these, naming the file; the original is chained.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import traceback


class UserError(Exception):
    """An error the user can fix: the message names the input and the fix. The CLI prints it without a traceback."""


class SettingsError(UserError, ValueError):
    """Settings that cannot run: a flag or key out of range, a combination the sections refuse, settings that do not
    fit the model or the launched world. Found before any training step; names the flag and the fix."""


class UnsupportedTarget(UserError, TypeError):
    """A module a method cannot adapt (``--target-modules`` names a layer of a kind it does not take)."""


class DataError(UserError, ValueError):
    """A dataset that cannot be trained on as given: empty, undecodable, malformed rows, missing or null values, or
    fewer examples than one batch. Names the file and the row or the column."""


class ModelLoadError(UserError, ValueError):
    """A model directory that does not load: no weights, a config that does not build, damaged files."""


class AdapterMismatch(UserError, ValueError):
    """An adapter saved on another base model (architecture, layer count or target shapes differ)."""


class EndpointError(UserError, ValueError):
    """A rendezvous endpoint that is malformed, or where nothing answers within the timeout."""


class RunFailure(UserError, RuntimeError):
    """The run started but cannot be trusted: a background write that failed, a loss that is not finite."""


class WriteFailure(RunFailure):
    """A file the run had to write (a persisted snapshot, a checkpoint, results) could not be written."""


class NonFiniteLoss(RunFailure):
    """The training or held-out loss became NaN or infinite."""


NONFINITE_OPT_OUT = "--stop-on-nonfinite-loss false (YAML stop_on_nonfinite_loss: false)"
NON_FINITE_CAUSES = (
    "usual causes: a learning rate too high (lower --learning-rate or add --warmup-steps), fp16 overflow (use bf16 "
    "or fp32), or rows with no supervised token"
)


def non_finite_loss(what: str, value: float, step: int | None, opt_out: str) -> NonFiniteLoss:
    """The error for a ``what`` loss (``"training"``, ``"held-out"``) of ``value`` at ``step``."""
    at = f" at step {step}" if step is not None else ""
    return NonFiniteLoss(
        f"the {what} loss is {value}{at}: the run stopped ({NON_FINITE_CAUSES}). To train on anyway, set {opt_out}."
    )


def check_writable(path: str, key: str, mode: int = 0o755) -> None:
    """Create the directory ``path`` and write a file into it, before any step: a :class:`WriteFailure` naming
    ``key`` (the flag or YAML key that sets it) otherwise, instead of a run that fails or loses its output later."""
    # not *.tmp: the snapshot engine's cleaner removes those, and another rank may be cleaning this directory
    probe = os.path.join(path, f".hf_dtrain-probe-{socket.gethostname()}-{os.getpid()}-{threading.get_ident()}")
    try:
        os.makedirs(path, mode=mode, exist_ok=True)
        with open(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb"):
            pass
        with contextlib.suppress(FileNotFoundError):
            os.unlink(probe)
    except OSError as e:
        raise WriteFailure(
            f"{key} {path} cannot be written ({e.strerror or e}); set {key} to a writable directory of your own."
        ) from None


def debug_requested() -> bool:
    """``HF_DTRAIN_DEBUG=1``: errors keep their tracebacks (``--debug`` does the same for one command)."""
    return os.environ.get("HF_DTRAIN_DEBUG", "").lower() in ("1", "true", "yes")


def one_line(job: str, e: BaseException) -> str:
    """``hf-dtrain <job>[ rank r]: <message>``: the rank is named when the launcher started several."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    rank = f" [rank {os.environ['RANK']}]" if world > 1 and "RANK" in os.environ else ""
    text = " ".join(str(e).split()) or type(e).__name__
    return f"hf-dtrain {job}{rank}: {text}"


def report_and_exit(job: str, e: BaseException, debug: bool = False) -> None:
    """Exit with ``e`` as one line: ``SystemExit(line)``, which the interpreter prints on stderr with status 1;
    with ``debug`` (or :func:`debug_requested`), the traceback is printed first. An error whose class sets
    ``exit_at_once`` (a dead peer's :class:`~hf_dtrain.distributed.RankFailure`) prints the line and ends the process
    at once, status 1, skipping the interpreter's clean-up."""
    if debug or debug_requested():
        traceback.print_exception(e, file=sys.stderr)
    if getattr(e, "exit_at_once", False):
        # a peer is gone (RankFailure): the interpreter's clean-up (the process group's, the store's) would wait on
        # it for seconds, and a launcher restarts the job only once this rank has exited
        with contextlib.suppress(Exception):
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.write(one_line(job, e) + "\n")
            sys.stderr.flush()
        os._exit(1)
    raise SystemExit(one_line(job, e)) from None
