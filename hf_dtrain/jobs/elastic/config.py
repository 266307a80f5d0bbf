"""The elastic job's settings and how a host joins (``hf-dtrain elastic`` flags, the torchrun command). Light to
import: ``--help`` reads it."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import sys
from dataclasses import dataclass

from hf_dtrain.errors import EndpointError, SettingsError
from hf_dtrain.run.config import JobConfig
from hf_dtrain.settings import check_fields, setting

LOG = "elastic.jsonl"


@dataclass
class ElasticConfig:
    """One elastic run. Every field is a flag of ``hf-dtrain elastic`` (``--steps``, ``--min-nodes`` ...); every
    host passes the same values, except ``slowdown`` (this host's own)."""

    output_dir: str = setting(
        "runs/elastic",
        "Where the log, the snapshots' persisted copies and the final model go: storage every host reads.",
    )
    steps: int = setting(60, "Optimizer steps of the whole run.", min=1)
    global_batch_size: int = setting(16, "Sequences per step over all workers, dealt by measured speed.", min=1)
    seq_len: int = setting(32, "Tokens per sequence.", min=2)
    samples: int = setting(2048, "Size of the synthetic training set.", min=1)
    preset: str = setting("test", "LlamaConfig preset of the model (hf_dtrain.models).")
    lr: float = setting(3e-3, "AdamW's learning rate.", gt=0)
    seed: int = setting(0, "Seed of the model and the data.", min=0)
    min_nodes: int = setting(1, "Fewest hosts the run trains with.", min=1)
    max_nodes: int = setting(4, "Most hosts that may join.", min=1)
    persist_every: int = setting(
        1,
        "Steps between persisted (resharding) snapshot copies: a membership change resumes from "
        "the newest one, so at most this many steps are recomputed.",
        min=1,
    )
    probe_steps: int = setting(
        2, "Timed forward/backward steps per worker at the start of each generation (its speed).", min=1
    )
    collective_timeout: float = setting(
        30.0, "Seconds a collective waits for a rank before the generation fails.", gt=0
    )
    slowdown: float = setting(
        1.0, "This host only: emulate a slower host (each step's compute takes this many times longer).", min=1
    )

    def __post_init__(self):
        from hf_dtrain.models import PRESETS  # (at construction, not for --help: it loads torch)

        check_fields(self)
        if self.min_nodes > self.max_nodes:
            raise SettingsError(
                f"ElasticConfig.min_nodes={self.min_nodes} is more than max_nodes={self.max_nodes}; "
                "set --min-nodes <= --max-nodes."
            )
        if self.preset not in PRESETS:
            raise SettingsError(
                f"ElasticConfig.preset={self.preset!r} is not a preset; choose one of {sorted(PRESETS)}."
            )
        if self.global_batch_size < self.max_nodes:
            raise SettingsError(
                f"ElasticConfig.global_batch_size={self.global_batch_size} cannot give each of up to "
                f"max_nodes={self.max_nodes} workers a sequence; raise --global-batch-size or lower "
                "--max-nodes."
            )


def torchrun_command(
    config: ElasticConfig,
    endpoint: str,
    run_id: str,
    nproc_per_node: int = 1,
    local_addr: str | None = None,
    store_host: bool | None = None,
) -> tuple[list, dict]:
    """The torchrun command line (and environment additions) that runs this host's share of ``config``;
    ``local_addr``: this host's address as the others reach it (default: what its hostname resolves to);
    ``store_host``: whether this host serves the rendezvous store at ``endpoint``; None lets torchrun decide (by
    comparing the endpoint with the hostname's addresses: it misses an address the hostname does not resolve to, and
    on one machine the first agent to bind the port wins). The run lives as long as the store's host: say which."""
    args = (
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            f"{config.min_nodes}:{config.max_nodes}",
            "--nproc-per-node",
            str(nproc_per_node),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            run_id,
            "--max-restarts",
            "100",
            "--monitor-interval",
            "0.5",
            # a lost host is dropped after 3 missed 1 s heartbeats; a generation forms 2 s after its last arrival
            "--rdzv-conf",
            "join_timeout=120,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3,"
            "close_timeout=5" + ("" if store_host is None else f",is_host={str(store_host).lower()}"),
        ]
        + (["--local-addr", local_addr] if local_addr else [])
        + ["-m", "hf_dtrain.cli", "elastic", "--worker", "true"]
        + to_argv(config)
    )
    return args, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def to_argv(config: ElasticConfig) -> list[str]:
    """The flags of ``config``'s run settings (the ones every host and worker shares)."""
    out = []
    for f in dataclasses.fields(ElasticConfig):
        out += [f"--{f.name.replace('_', '-')}", str(getattr(config, f.name))]
    return out


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port`` (``[v6-address]:port``) of ``--endpoint``, checked: an :class:`~hf_dtrain.errors.EndpointError`
    naming it when the port is missing or out of range or the host does not resolve."""
    text = endpoint.strip()
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
    else:
        host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise EndpointError(
            f"--endpoint {endpoint!r} is not host:port (e.g. 10.0.0.1:29400, [fd00::1]:29400): give the first host's "
            "address and the rendezvous port."
        )
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise EndpointError(f"--endpoint {endpoint!r}: the port {port!r} is not a number from 1 to 65535.")
    try:
        socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except OSError as e:
        raise EndpointError(
            f"--endpoint {endpoint!r}: the host {host!r} does not resolve ({e.strerror or e})."
        ) from None
    return host, int(port)


def is_local(host: str) -> bool:
    """``host`` is an address of this machine (a socket binds to it)."""
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _, address in infos:
        with contextlib.suppress(OSError), socket.socket(family, kind, proto) as probe:
            probe.bind((address[0], 0))
            return True
    return False


@dataclass
class ElasticJob(ElasticConfig, JobConfig):
    """``hf-dtrain elastic``: this host's share of an elastic run (:class:`ElasticConfig`, the same on every host) and
    how it joins (``--endpoint``, ``--store-host``...), every field a flag."""

    job = "elastic"

    endpoint: str = setting(
        "127.0.0.1:29400", "host:port of the rendezvous (the first host's address; every host passes the same)."
    )
    run_id: str = setting("hf-dtrain-elastic", "The rendezvous id (the same on every host).")
    nproc_per_node: int = setting(1, "Workers on this host.", min=1)
    store_host: bool | None = setting(
        None,
        "true: this host serves the rendezvous store at --endpoint; false: it connects to it. Default: "
        "torchrun decides by the hostname's addresses. The run lives as long as the store's host does: set true "
        "on the host that stays, false on the others.",
    )
    local_addr: str | None = setting(
        None, "This host's address as the other hosts reach it (default: what its hostname resolves to)."
    )
    connect_timeout: float = setting(
        60.0,
        "Seconds a host that does not serve the rendezvous waits for --endpoint to answer before it stops "
        "with an error naming it.",
    )
    worker: bool = setting(False, "Run as one of torchrun's workers.", hidden=True)

    def __post_init__(self):
        super().__post_init__()
        if not (isinstance(self.connect_timeout, (int, float)) and self.connect_timeout > 0):
            raise EndpointError(f"--connect-timeout must be a positive number of seconds, got {self.connect_timeout}.")
