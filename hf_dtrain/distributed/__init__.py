"""hf_dtrain's distributed plumbing, one module per concern:

* :mod:`.collectives`: single-tensor all-gather / reduce-scatter, the same-on-every-rank check, the 1-bit and int8
  compressed all-reduces and their codecs;
* :mod:`.groups`: starting and ending the default process group, and :class:`RankMonitor` (the rank that died, named);
* :mod:`.counters`: bytes handed to collectives (:class:`WireStats`) and bytes saved for backward
  (:class:`SavedTensorCounter`);
* :mod:`.engines`: which sharded engine holds a parameter, and the guard for optimizers that need whole replicas;
* :mod:`.quotas`: work split in proportion to speeds.

The names below are re-exported here for users; hf_dtrain's own modules import from the submodule."""

from .collectives import (
    all_gather_single,
    check_same_across_ranks,
    int8_allreduce,
    onebit_allreduce,
    onebit_compress,
    onebit_decompress,
    pack_bits,
    reduce_scatter_single,
    unpack_bits,
    world_size_of,
)
from .counters import SavedTensorCounter, WireStats
from .engines import WholeReplicaGuard, keep_gradients_local, sharded_engine_of, unwrap_optimizer
from .groups import CommFailure, RankFailure, RankMonitor, init_distributed, is_comm_error, release_process_group
from .quotas import speed_quotas

__all__ = [
    "CommFailure",
    "RankFailure",
    "RankMonitor",
    "SavedTensorCounter",
    "WholeReplicaGuard",
    "WireStats",
    "all_gather_single",
    "check_same_across_ranks",
    "init_distributed",
    "int8_allreduce",
    "is_comm_error",
    "keep_gradients_local",
    "onebit_allreduce",
    "onebit_compress",
    "onebit_decompress",
    "pack_bits",
    "reduce_scatter_single",
    "release_process_group",
    "sharded_engine_of",
    "speed_quotas",
    "unpack_bits",
    "unwrap_optimizer",
    "world_size_of",
]
