"""The loss guard: a run whose training or held-out loss becomes NaN or infinite stops, naming the step and the usual
causes (:class:`~hf_dtrain.health.callback.NonFiniteLossCallback` for the Trainer; its section checks a plain loop's
losses). ``--stop-on-nonfinite-loss false`` trains on, as the Trainer does."""

import lazy_loader as lazy

__getattr__, __dir__, __all__ = lazy.attach(__name__, submod_attrs={"callback": ["NonFiniteLossCallback"]})
