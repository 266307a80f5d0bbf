"""In-memory fault tolerance (after REFT, arXiv 2310.12670): snapshots of each rank's training state in host memory
every few steps, held by a snapshot process per node that outlives the trainers, protected against lost nodes by
erasure coding across nodes, restored exactly. DDP replicas, FSDP2 shards and DeepSpeed ZeRO-1/2/3 partitions
(fp32 masters included); persisted snapshots are also DCP checkpoints, so a restart on another world size reshards
them (``reshard.py``; ZeRO partitions in ``zero.py``).

* ``SnapshotEngine`` (function API for Accelerate and custom loops): ``snapshot(step, extra)``, ``wait()``,
  ``restore()``;
* ``InMemoryFaultToleranceCallback`` for the Trainer;
* ``python -m hf_dtrain.fault.smp`` runs a node's snapshot process by hand (the engine starts one otherwise).
"""

import lazy_loader as lazy

__getattr__, __dir__, __all__ = lazy.attach(
    __name__,
    submod_attrs={
        "callback": ["InMemoryFaultToleranceCallback"],
        "config": ["SnapshotConfig"],
        "erasure": ["ErasureCode", "UnrecoverableError"],
        "snapshot": ["Restored", "SnapshotEngine", "SnapshotError"],
    },
)
