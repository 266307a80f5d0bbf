"""Helpers that the tests and the benchmarks import (the package itself never does):

* :mod:`hf_dtrain.testing.models`: the tiny LLaMA, random batches, saved-tensor byte counting, short training loops;
* :mod:`hf_dtrain.testing.launch`: free ports, fresh Python processes, ``accelerate launch`` from a checkout, gloo
  groups, multi-process runs, an elastic launcher of one process per rank and its relaunch after failures;
* :mod:`hf_dtrain.testing.fault`: the fault injector and the fault-injection worker's launcher;
* :mod:`hf_dtrain.testing.netns`: emulated hosts in network namespaces with shaped links.
"""

import lazy_loader as lazy

# loaded on first use: a process that needs only the launch or fault helpers (a fault-injection rank, a launcher's
# child) does not import transformers through the models module
__getattr__, __dir__, __all__ = lazy.attach(
    __name__,
    submod_attrs={
        "fault": ["stop_snapshot_processes"],
        "launch": [
            "accelerate_launch",
            "elastic_launch",
            "forked_run",
            "free_port",
            "gloo_group",
            "mean_over_ranks",
            "relaunch_output",
            "relaunched",
            "run_distributed",
            "run_python",
        ],
        "models": [
            "SavedTensorCounter",
            "chat_llama_checkpoint",
            "tiny_gguf",
            "random_batch",
            "tiny_default_base",
            "tiny_llama",
            "train_on_loader",
            "train_steps",
        ],
    },
)
