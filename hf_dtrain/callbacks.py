"""hf_dtrain's Trainer callbacks, in one place: thin adapters from Trainer events to engines that are testable
without a Trainer. Each lives with its engine; importing this module loads them all."""

from hf_dtrain.comm.trainer import CommHookCallback
from hf_dtrain.fault import InMemoryFaultToleranceCallback
from hf_dtrain.health.callback import NonFiniteLossCallback
from hf_dtrain.memory import DeltaCallback
from hf_dtrain.tuners.smt import SMTSelectionCallback

__all__ = [
    "CommHookCallback",
    "DeltaCallback",
    "InMemoryFaultToleranceCallback",
    "NonFiniteLossCallback",
    "SMTSelectionCallback",
]
