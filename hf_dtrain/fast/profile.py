"""Where one training step goes: every aten op of the forward, the backward and the optimizer step, by op family,
with its time, and the bytes autograd saves for backward.

The families (``FAMILIES``) say what a method changes in a step:

* ``base GEMM``: the products with the frozen (or full-trained) weights of the decoder's linear layers;
* ``base other``: what else the base layers run (a 4-bit base's dequantization, by op name);
* ``adapter GEMM`` and ``adapter other``: the tuner layers' own products (told from the base's inside a tuner
  layer by a dimension at most the adapters' width: ``r``, SMT's block) and their scaling and adds;
* ``attention``: inside the attention modules but for their projections (rotary, SDPA or eager attention);
* ``loss head``: the LM head's product and the loss (logits' casts included);
* ``casts``: dtype conversions outside the loss head (autocast's copies, an adapter's up-cast);
* ``dropout``; ``elementwise``: everything else (norms, SwiGLU, residual adds, the embedding, gradient
  accumulation);
* ``optimizer``: all of ``optimizer.step`` and ``zero_grad``.

Attribution: forward ops take the scope of the innermost module running (hooks on the model's modules); an
autograd node created there carries that scope in its metadata (``torch.autograd.graph.node_creation_hook``), and
the backward ops it runs (``torch._C._current_autograd_node``) are charged to it. View ops are counted apart: they
launch no kernel. Times: on CPU each op's wall time (the CPU runs ops synchronously; the dispatch adds a constant
per op, the same for every method); on CUDA a pair of events around each op, read after the step.

Saved bytes: every tensor autograd saves for backward, counted once per storage (a saved view pins its whole storage),
parameters and buffers excluded (they exist anyway), split by the scope that saved them
(:class:`hf_dtrain.distributed.counters.SavedTensorCounter` with a tag).

    prof = StepProfile(model)
    with prof.phase("forward"):
        loss = model(**batch).loss
    with prof.phase("backward"):
        loss.backward()
    with prof.phase("optimizer"):
        optimizer.step(); optimizer.zero_grad()
    prof.summary()   # {"families": {...}, "phases": {...}, "ops": n, "views": n, "saved_bytes": n, ...}
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_dtrain.distributed.counters import SavedTensorCounter
from hf_dtrain.models import is_tuner_layer

from . import observer
from .paths import ATTENTION_PROJECTIONS, _projection
from .paths import _attention_lean_forward as _attention_block
from .paths import _mlp_lean_forward as _mlp_block

FAMILIES = (
    "base GEMM",
    "base other",
    "adapter GEMM",
    "adapter other",
    "attention",
    "loss head",
    "casts",
    "dropout",
    "elementwise",
    "optimizer",
)
_GEMM = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "_int_mm", "_weight_int4pack_mm", "_weight_int4pack_mm_for_cpu"}
_BASE_GEMM = ("gemm_4bit", "int4pack_mm", "matmul_4bit")  # a 4-bit base's own product, by op name
_ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention", "_cudnn_attention")
_LOSS = ("log_softmax", "nll_loss", "cross_entropy")
_DROPOUT = ("dropout", "bernoulli")
_CASTS = {"_to_copy", "_to_dtype", "to"}
_KEY = "hf_dtrain_scope"
_ALIASING = {torch.ops.aten._unsafe_view.default}  # a view in all but its schema


def _scopes(model: torch.nn.Module) -> dict[torch.nn.Module, str]:
    """The scope each module opens: the LM (its own code is the loss), the decoder, attention, the tuner layers and
    their bases, the other linear layers, the LM head."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    scopes = {lm: "loss head"}
    for module in lm.modules():
        if module is lm:
            continue
        if module.__dict__.get("forward") is not None and getattr(module.forward, "__func__", None) is _mlp_block:
            scopes[module] = "block"  # a lean MLP block (its projections run inside it when it applies)
        elif is_tuner_layer(module):
            # one scope for the whole tuner layer (no hook on its base: a hook sends a lean layer down its plain
            # path); its products are told apart by shape (``family``)
            scopes[module] = "adapter"
            for sub in module.modules():
                scopes.setdefault(sub, None)
        elif module is head:
            scopes[module] = "loss head"
        elif type(module).__name__.endswith("Attention"):
            scopes[module] = "attention"
        elif module not in scopes:
            scopes[module] = "base" if isinstance(module, torch.nn.Linear) else "other"
    return {m: s for m, s in scopes.items() if s is not None}


def _own_width(module) -> int:
    base = {id(t) for t in module.get_base_layer().parameters()}
    dims = [min(t.shape[-2:]) for t in [*module.parameters(), *module.buffers()] if id(t) not in base and t.dim() >= 2]
    return max(dims, default=0)


def adapter_width(model: torch.nn.Module) -> int:
    """The largest of the tuner layers' adapter tensors' smallest dimensions (LoRA's r, SMT's block, QA-HiRA's
    pooled width), or of a lean attention block's stacked q/k/v factors (the sum of their ranks): a product inside a
    tuner layer with a dimension this small is the adapter's, else the base's."""
    width = 0
    for module in model.modules():
        if is_tuner_layer(module):
            width = max(width, _own_width(module))
        elif getattr(module.__dict__.get("forward"), "__func__", None) is _attention_block:
            layers = [getattr(module, n) for n in ATTENTION_PROJECTIONS]
            if all(_projection(layer)[0] is not None for layer in layers):
                width = max(width, sum(_own_width(layer) for layer in layers))
    return width


def family(name: str, scope: str | None, phase: str, dtype_change: bool = False, small: bool = False) -> str:
    """The family of the aten op ``name`` (``mm``, ``_to_copy``...) run in ``scope`` during ``phase``; ``small``: a
    dimension of its operands is at most the adapters' width (a product inside a tuner layer is then the adapter's)."""
    if phase == "optimizer":
        return "optimizer"
    if any(k in name for k in _ATTENTION):
        return "attention"
    if scope == "loss head" or any(k in name for k in _LOSS):
        return "loss head"
    if name in _CASTS or (name == "copy_" and dtype_change):
        return "casts"
    if any(k in name for k in _DROPOUT):
        return "dropout"
    gemm = name.rstrip("_") in _GEMM  # in-place ones too (addmm_: the lean paths add into a product's buffer)
    if scope == "base":
        return "base GEMM" if gemm else "base other"
    if any(k in name for k in _BASE_GEMM):
        return "base GEMM"
    if scope == "block":  # a lean MLP block: its products told apart by shape, the SwiGLU's own ops elementwise
        if gemm:
            return "adapter GEMM" if small else "base GEMM"
        return "elementwise"
    if scope == "adapter":
        if "dequant" in name:
            return "base other"
        if gemm:
            return "adapter GEMM" if small else "base GEMM"
        return "adapter other"
    if scope == "attention":
        return "attention"
    return "elementwise"


class _Dispatch(TorchDispatchMode):
    def __init__(self, profile: StepProfile):
        super().__init__()
        self.profile = profile

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        prof = self.profile
        if func.is_view or func in _ALIASING:
            prof.views += 1
            return func(*args, **kwargs)
        node = torch._C._current_autograd_node()
        scope = (node.metadata.get(_KEY) if node is not None else None) or prof.scope()
        name = func.__name__.split(".")[0]
        change = False
        if name == "copy_" and len(args) >= 2 and isinstance(args[1], torch.Tensor):
            change = args[0].dtype != args[1].dtype
        small = False
        if name.rstrip("_") in _GEMM and scope in ("adapter", "block"):
            small = any(isinstance(t, torch.Tensor) and t.dim() >= 2 and min(t.shape[-2:]) <= prof.width for t in args)
        fam = family(name, scope, prof.current, change, small)
        if prof.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = func(*args, **kwargs)
            end.record()
            prof.events.append((fam, prof.current, name, start, end))
        else:
            t0 = time.perf_counter()
            out = func(*args, **kwargs)
            prof.add(fam, prof.current, name, time.perf_counter() - t0)
        return out


class StepProfile:
    """Op counts, times and saved-for-backward bytes of the steps run inside its ``phase`` blocks (see the module's
    docstring). ``steps`` profiled steps are summed; divide by it for per-step figures (``summary`` does)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.cuda = any(p.is_cuda for p in model.parameters())
        self.current = "forward"
        self.views = 0
        self.steps = 0
        self.ops: dict[str, int] = defaultdict(int)
        self.seconds: dict[str, float] = defaultdict(float)
        self.phase_ops: dict[str, int] = defaultdict(int)
        self.phase_seconds: dict[str, float] = defaultdict(float)
        self.op_names: dict[tuple[str, str], int] = defaultdict(int)
        self.events: list = []
        self.saved_bytes: dict[str, int] = defaultdict(int)  # by scope, summed over the steps
        self._stack: list[str] = []
        self._scopes = _scopes(model)
        self.width = adapter_width(model)
        self._counter = None  # this step's SavedTensorCounter

    # ---- scopes -----------------------------------------------------------------------------------------------------
    def scope(self) -> str | None:
        return self._stack[-1] if self._stack else None

    @contextlib.contextmanager
    def _hooks(self):
        def enter(scope):
            def hook(module, args):
                self._stack.append(scope)  # None: the input stands

            return observer(hook)  # watching only: the lean paths stay lean

        def leave(module, args, output) -> None:  # returning the popped scope would replace the output
            self._stack.pop()

        observer(leave)

        handles = []
        for module, scope in self._scopes.items():
            handles.append(module.register_forward_pre_hook(enter(scope)))
            handles.append(module.register_forward_hook(leave))
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            self._stack.clear()

    def _tag(self, node) -> None:
        scope = self.scope()
        if scope is not None:
            node.metadata[_KEY] = scope

    # ---- recording --------------------------------------------------------------------------------------------------
    def add(self, fam: str, phase: str, name: str, seconds: float) -> None:
        self.ops[fam] += 1
        self.seconds[fam] += seconds
        self.phase_ops[phase] += 1
        self.phase_seconds[phase] += seconds
        self.op_names[(fam, name)] += 1

    @contextlib.contextmanager
    def phase(self, name: str):
        """Profile what runs inside as ``name`` (``forward``, ``backward`` or ``optimizer``); a forward starts a
        step."""
        self.current = name
        if name == "forward":
            self.steps += 1
            self._flush_saved()
        with contextlib.ExitStack() as stack:
            if name == "forward":
                stack.enter_context(self._hooks())
                stack.enter_context(torch.autograd.graph.node_creation_hook(self._tag))
                frozen = [*self.model.parameters(), *self.model.buffers()]
                self._counter = SavedTensorCounter(exclude=frozen, tag=lambda: self.scope() or "other")
                stack.enter_context(self._counter())
            stack.enter_context(_Dispatch(self))
            yield

    def _flush_saved(self) -> None:
        if self._counter is not None:
            for scope, nbytes in self._counter.by_tag.items():
                self.saved_bytes[scope] += nbytes
            self._counter = None

    def _resolve_events(self) -> None:
        if not self.events:
            return
        torch.cuda.synchronize()
        for fam, phase, name, start, end in self.events:
            self.add(fam, phase, name, start.elapsed_time(end) / 1e3)
        self.events.clear()

    def summary(self) -> dict:
        """Per step: ``families`` ``{family: {"ops", "seconds"}}``, ``phases`` likewise, ``ops`` (kernels: the
        non-view ops), ``views``, ``saved_bytes`` (all scopes) and ``saved_bytes_by_scope``, ``top_ops`` (the 40
        most frequent ``family/op`` pairs)."""
        self._resolve_events()
        self._flush_saved()
        n = max(self.steps, 1)
        top = sorted(self.op_names.items(), key=lambda kv: -kv[1])[:40]
        return {
            "steps": self.steps,
            "families": {
                f: {"ops": self.ops[f] / n, "seconds": self.seconds[f] / n} for f in FAMILIES if f in self.ops
            },
            "phases": {p: {"ops": self.phase_ops[p] / n, "seconds": self.phase_seconds[p] / n} for p in self.phase_ops},
            "ops": sum(self.ops.values()) / n,
            "views": self.views / n,
            "seconds": sum(self.seconds.values()) / n,
            "saved_bytes": sum(self.saved_bytes.values()) / n,
            "saved_bytes_by_scope": {k: v / n for k, v in sorted(self.saved_bytes.items())},
            "top_ops": {f"{fam}/{name}": c / n for (fam, name), c in top},
        }
