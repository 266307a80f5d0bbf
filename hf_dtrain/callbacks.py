"""hf_dtrain's Trainer callbacks: thin adapters from Trainer events to engines that are testable without a Trainer."""

from hf_dtrain.comm.trainer import CommHookCallback
from hf_dtrain.fault import InMemoryFaultToleranceCallback
from hf_dtrain.memory import DeltaCallback
from hf_dtrain.tuners.smt.selection import SMTSelectionCallback

__all__ = ["CommHookCallback", "DeltaCallback", "InMemoryFaultToleranceCallback", "SMTSelectionCallback"]
