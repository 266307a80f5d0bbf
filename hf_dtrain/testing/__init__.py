"""Helpers that the tests and the benchmarks import (the package itself never does):

* :mod:`hf_dtrain.testing.models`: the tiny LLaMA, random batches, saved-tensor byte counting, short training loops;
* :mod:`hf_dtrain.testing.launch`: free ports, fresh Python processes, ``accelerate launch`` from a checkout, gloo
  groups, multi-process runs, an elastic launcher of one process per rank and its relaunch after failures;
* :mod:`hf_dtrain.testing.fault`: the fault injector and the fault-injection worker's launcher;
* :mod:`hf_dtrain.testing.netns`: emulated hosts in network namespaces with shaped links.
"""

from .fault import stop_snapshot_processes
from .launch import (
    accelerate_launch,
    elastic_launch,
    forked_run,
    free_port,
    gloo_group,
    mean_over_ranks,
    relaunch_output,
    relaunched,
    run_distributed,
    run_python,
)
from .models import (
    SavedTensorCounter,
    chat_llama_checkpoint,
    random_batch,
    tiny_default_base,
    tiny_llama,
    train_on_loader,
    train_steps,
)

__all__ = [
    "SavedTensorCounter",
    "accelerate_launch",
    "chat_llama_checkpoint",
    "elastic_launch",
    "forked_run",
    "free_port",
    "gloo_group",
    "mean_over_ranks",
    "random_batch",
    "relaunch_output",
    "relaunched",
    "run_distributed",
    "run_python",
    "stop_snapshot_processes",
    "tiny_default_base",
    "tiny_llama",
    "train_on_loader",
    "train_steps",
]
