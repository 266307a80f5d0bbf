"""Elastic data-parallel training: hosts join and leave a run while it trains.

Built on torchrun's elastic agent (a c10d rendezvous with ``--nnodes MIN:MAX``), the snapshot engine of
``hf_dtrain.fault`` and the heterogeneity-aware partitioner of ``hf_dtrain.data``:

* every host runs ``hf-dtrain elastic`` (which runs torchrun for it). When a host leaves (killed, lost) the others'
  collectives fail, their agents meet again without it and restart their workers; when a host arrives, the running
  agents see it waiting, stop at once, and meet again with it. Each new membership is a new *generation* of workers.
* a generation starts from the newest snapshot. With the same world size the engine restores from memory (the
  snapshot processes outlive the workers); on a new world size it reshards the persisted copy (a DCP checkpoint every
  ``persist_every`` steps, on storage every host reads), which newcomers load like everybody else.
* a generation measures each worker's speed (timed forward/backward steps, no gradient exchange) and deals every
  global batch in proportion to it (``HeterogeneityAwareSampler``), weighting each rank's loss so that the gradient
  is the mean over the global batch, as one process would compute it.
* rank 0 appends every step (loss, world size, batch sizes, speeds, where the generation restored from) to
  ``<output_dir>/elastic.jsonl``; steps past the restored one (a timeline that died with a host) are dropped first.

torch 2.13's c10d rendezvous shares its TCP store with the workers by default, and a host that joins an existing
run then waits forever for keys the store's owner writes only once (the first generation's master address): the
launcher sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` so each generation publishes its own.
"""

import lazy_loader as lazy

__getattr__, __dir__, __all__ = lazy.attach(
    __name__,
    submod_attrs={
        "config": ["ElasticConfig", "ElasticJob", "LOG", "is_local", "parse_endpoint", "to_argv", "torchrun_command"],
        "run": ["read_log", "run_elastic", "run_worker", "synthetic_corpus", "wait_for_endpoint"],
    },
)
