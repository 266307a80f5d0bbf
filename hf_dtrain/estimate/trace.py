"""One training step traced through the real modules, on fake tensors or real ones, with the per-category peak of
live tensor storage: parameters, buffers, gradients, optimizer state, activations (forward, and recomputation under
activation checkpointing) and temporaries (backward's own tensors).

Built on torch's own pieces: :class:`torch._subclasses.fake_tensor.FakeTensorMode` (tensors with shapes, dtypes and
devices and no storage: an 8B model traces in host memory that holds none of its weights) and
``torch.distributed._tools.mem_tracker.MemTracker`` (a dispatch mode that follows every tensor storage created while
it is on, with a weak reference that tells it when the storage goes, split by what the tensor is). The same tracker
on real tensors measures a real step's peak of live storage: :func:`trace_step` runs either, and the estimate is
checked against that measurement at the sizes that run here (tests/estimate).

``MemTracker`` hooks every parameter's gradient, which a frozen parameter cannot take (a peft model's base):
:class:`StepTracker` hooks only those that train, and keeps the step's peak without the module-wise peaks."""

from __future__ import annotations

import contextlib
import functools
import gc
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed._tools import mod_tracker
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType
from torch.utils.flop_counter import FlopCounterMode

from hf_dtrain.fast import observer

# the categories MemTracker splits storage into, under the names this package reports
CATEGORIES = {
    _MemRefType.PARAM: "parameters",
    _MemRefType.BUFFER: "buffers",
    _MemRefType.GRAD: "gradients",
    _MemRefType.OPT: "optimizer state",
    _MemRefType.ACT: "activations",
    _MemRefType.TEMP: "temporaries",
    _MemRefType.OTH: "other",
}


class _StepModTracker(mod_tracker.ModTracker):
    """torch's ``ModTracker``, leaving a module at the end of the backward pass (as it already does for a module whose
    inputs take no gradient) instead of through a hook on its inputs' gradients. That hook holds the inputs' autograd
    nodes in a reference cycle through their own pre-hooks, so a branch that never runs backward (peft DoRA's
    ``lora_B(lora_A(eye))`` before its ``detach()``) kept its saved tensors until the next cyclic collection: the
    identity matrix of every DoRA layer stayed alive in the trace, which the step itself frees at once (DoRA on SmolLM2
    traced 12.6% above the job's measured peak). The tracker needs no module's backward boundary: it keeps the step's
    peak alone (:meth:`StepTracker._update_peak_stats`)."""

    def _fw_pre_hook(self, mod, input):
        hook = mod_tracker.register_multi_grad_hook
        mod_tracker.register_multi_grad_hook = lambda tensors, fn, **kw: self._post_bw_callbacks_to_enqueue.append(fn)
        try:
            super()._fw_pre_hook(mod, input)
        finally:
            mod_tracker.register_multi_grad_hook = hook


class StepTracker(MemTracker):
    """torch's ``MemTracker``, with gradient hooks only on the parameters that train (a frozen parameter cannot
    take one), its module tracker's hooks marked as watching only: the lean paths, which skip their layers' own
    calls, stay lean in the trace as in the run (unmarked, a peft LoRA step without checkpointing traced 12-24% above
    the job's measured peak)."""

    def __init__(self) -> None:
        super().__init__()
        self._mod_tracker = _StepModTracker()
        observer(self._mod_tracker)

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True):
        sizes = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
        if install_grad_hooks:
            for param in module.parameters():
                if param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                    self._param_to_grad_hook_handles[param] = (
                        param.register_hook(self._track_gradient),
                        param.register_post_accumulate_grad_hook(lambda p: self._track_gradient(p.grad)),
                    )
        return sizes

    def _pre_fw_hook(self, module: nn.Module, inputs) -> None:
        """A root module called again in the same step (a pipeline stage, once per micro-batch) starts its module
        stats afresh, where ``MemTracker`` refuses it (its module-wise stats are per call; the step's peak is not)."""
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            name = self._mod_tracker.get_known_fqn(module)
            if set(self._mod_tracker.parents) - {name} == {"Global"}:
                del self.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)

    def track_as_parameters(self, tensors) -> None:
        """Tensors created before the step that belong to the weights but are no parameter or buffer (a 4-bit
        layer's scales): counted as parameters (``track_external`` would count them as "other")."""
        for tensor in tensors:
            self._update_and_maybe_create_winfos(tensor, _MemRefType.PARAM)

    def _track_gradient(self, grad: torch.Tensor) -> None:
        self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

    def _update_peak_stats(self, peak_state) -> None:
        """The whole step's peak only. ``MemTracker`` also updates every module's own peak after every op (a pass
        over all the modules per op: on Llama 3 8B with LoRA, 8.5 minutes for two traced steps that run in 9 s
        untracked); :func:`trace_step` reads the step's peak alone."""
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot[_TOTAL_KEY]:
                self._peak_mem[device] = snapshot[_TOTAL_KEY]
                self._peak_mem_snap[device] = dict(snapshot)


@dataclass
class StepMemory:
    """The peak of live tensor storage over a traced step, in bytes: ``peak`` in all, ``split`` by category at that
    moment (parameters, buffers, gradients, optimizer state, activations, temporaries, other); ``flops``: the step's
    floating-point operations (``torch.utils.flop_counter``; forward and backward)."""

    peak: int
    split: dict[str, int] = field(default_factory=dict)
    flops: int = 0

    def to_dict(self) -> dict:
        return {"peak_bytes": self.peak, "split_bytes": dict(self.split), "flops": self.flops}


def trace_step(model: nn.Module, optimizer, step, steps: int = 2, flops: bool = True) -> StepMemory:
    """Run ``step()`` (one forward, backward and ``optimizer.step()``; ``optimizer.zero_grad()`` after) ``steps``
    times under a :class:`StepTracker` following ``model`` and ``optimizer``, and return the peak: the second step
    holds what the first left (the optimizer's state, gradients set to None or kept). Works on real tensors and,
    inside a :func:`fake_tensors` block, on fake ones. ``flops``: count the FLOPs of one more step, run apart (under
    torch's ``FlopCounterMode`` a checkpointed layer keeps what it recomputes: Llama 3 8B's shape with 16 layers
    traced at 20.1 GiB with the counter on, 15.0 without).

    A step's tensors that only Python's cyclic garbage collector frees would make the peak depend on the collector's
    timing. Within a step the collector is held off, and run between steps: the peak is the one a step reaches when
    no collection falls inside it, the upper bound, and the same on every run. The tracker's own reference cycles
    were such tensors (a checkpointed LoRA step of the tiny preset traced 1.7% above the allocator's peak, DoRA on
    SmolLM2 12.6%): :class:`_StepModTracker` makes none."""
    from hf_dtrain.quantization import quantized_state

    tracker = StepTracker()
    tracker.track_external(model, *([optimizer] if optimizer is not None else []))
    tracker.track_as_parameters(quantized_state(model))  # a 4-bit weight's scales, held outside its parameter
    collecting = gc.isenabled()
    gc.collect()
    gc.freeze()  # what exists now is not the steps' garbage: the collections between steps skip it (~0.3 s each)
    gc.disable()  # within a step, no cyclic collection (see below); between steps, one
    try:
        with tracker, _shape_propagation_untracked():
            for _ in range(steps):
                step()
                tracker.reset_mod_stats()  # the module-wise stats refuse a module called again otherwise
                gc.collect()
    finally:
        gc.unfreeze()
        if collecting:
            gc.enable()
    counted = 0
    if flops:  # one more step, counted apart: under the FLOP counter, checkpointed layers keep what they recompute
        counter = RankFlopCounter(display=False)
        with counter, _shape_propagation_untracked():
            step()
        counted = counter.get_total_flops()
    snapshot = tracker.get_tracker_snapshot("peak")
    split: dict[str, int] = {}
    peak = 0
    for device_split in snapshot.values():
        for key, nbytes in device_split.items():
            if key == _TOTAL_KEY:
                peak += int(nbytes)
            else:
                name = CATEGORIES[key]
                split[name] = split.get(name, 0) + int(nbytes)
    return StepMemory(peak=peak, split=split, flops=int(counted))


class RankFlopCounter(FlopCounterMode):
    """torch's ``FlopCounterMode``, counting the operations this rank runs. torch's counts an op on DTensors at its
    global shape (a tensor-parallel matmul as the whole matmul, on every rank of the group) and the same step's
    plain-tensor ops (attention on this rank's heads) at theirs: on Llama 3 8B's shapes at TP x 8 that gave the
    whole step's matmuls plus an eighth of its attention. Here an op on DTensors is left to DTensor, which runs it
    on the local shards, and those are counted."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if getattr(self, "mod_tracker", None) is not None:  # the step counted is the one the run takes (lean)
            observer(self.mod_tracker)

    def __enter__(self):
        super().__enter__()
        inner = getattr(self, "mode", None)  # torch's dispatch mode of the counter (torch 2.4 and later)
        if inner is not None:
            inner.__exit__(None, None, None)
            self.mode = _on_local_shards()(self)
            self.mode.__enter__()
        return self


@functools.cache
def _on_local_shards():
    from torch.distributed.tensor import DTensor
    from torch.utils.flop_counter import _FlopCounterMode

    class OnLocalShards(_FlopCounterMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented  # DTensor runs it on the shards, which come back here
            return super().__torch_dispatch__(func, types, args, kwargs)

    return OnLocalShards


@contextlib.contextmanager
def _shape_propagation_untracked():
    """DTensor's sharding propagation, the first time it meets an op and its placements, runs the op once on tensors
    of the global shape to learn the output's shape (``ShardingPropagator._propagate_tensor_meta_non_cached``,
    under the fake mode it finds, or a new one). Inside a trace that fake mode is the trace's own, under the tracker:
    the global-shape tensors were counted as the step's storage (Llama 3 8B's embedding, 1 GB, on a TP x 8 rank
    that holds an eighth of it), and their products as its FLOPs. While this is on the propagation runs outside
    every mode (the tracker's, the FLOP counter's, the trace's fake mode) in a fake mode of its own, as it does in
    a real run."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.utils._python_dispatch import _disable_current_modes

    propagate = ShardingPropagator._propagate_tensor_meta_non_cached

    def untracked(self, op_schema):
        with _disable_current_modes():
            return propagate(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = untracked
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = propagate


@contextlib.contextmanager
def fake_tensors():
    """Tensors made inside are fake (shapes, dtypes and devices only). A model built on the meta device (``with
    torch.device("meta")``, its method applied there too: peft's own ``.to()`` of a fake tensor fails) becomes fake
    with ``model.to_empty(device="cpu")`` inside this block: no storage, values never read by a memory trace."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    # non-fake inputs allowed: a meta-device model's tensors are read once, by to_empty()'s empty_like
    from hf_dtrain.quantization import on_fake_tensors

    with FakeTensorMode(allow_non_fake_inputs=True) as mode, _real_meshes(), on_fake_tensors(), _one_sequence_a_row():
        yield mode


@contextlib.contextmanager
def _one_sequence_a_row():
    """transformers looks for packed sequences in the positions when a step has neither an attention mask nor a
    cache (``masking_utils.find_packed_sequence_indices``: TRL's fused LM head runs the backbone with
    ``use_cache=False``), which it cannot read on fake tensors: it then took every row as packed and built a float
    causal mask per layer call that the run never builds (tiny fine-tuning 4 MiB over, Llama 3 8B's 4096 tokens 80
    MiB a layer). A traced step passes no positions, so they are transformers' own ``arange``, one sequence a row,
    which the run finds unpacked: on fake positions the answer is that (None), on real ones transformers' own."""
    from torch._subclasses.fake_tensor import FakeTensor
    from transformers import masking_utils

    find = masking_utils.find_packed_sequence_indices

    def unpacked(position_ids):
        return None if isinstance(position_ids, FakeTensor) else find(position_ids)

    masking_utils.find_packed_sequence_indices = unpacked
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = find


def make_fake(model: nn.Module, device) -> nn.Module:
    """``model``, built on the meta device, made fake on ``device`` inside :func:`fake_tensors` (``to_empty``), its
    tied input and output embeddings tied again, a 4-bit layer's scales kept with it
    (:func:`hf_dtrain.quantization.to_empty`): ``to_empty`` gives each module new parameters (a meta tensor's
    storage cannot be swapped in place for a fake one), and a tied table would be counted twice."""
    from hf_dtrain.quantization import to_empty

    model = to_empty(model, device)  # a 4-bit layer's scales kept with it
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


@contextlib.contextmanager
def _real_meshes():
    """Device meshes made and read with real tensors while a fake mode is on. A ``DeviceMesh`` keeps its ranks in a
    small index tensor and reads its values (its coordinates, a sub-mesh's ranks: torch 2.13 computes a mesh
    concatenated for FSDP2 over TP lazily, with ``nonzero``); made or read inside a fake mode that tensor is fake and
    reading it fails. The mesh's constructor and its ``mesh`` property run outside the fake mode while this is on
    (restored after); a rank map made inside it (``init_device_mesh``'s ``arange``, the identity) is made again
    real."""
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    init, mesh = DeviceMesh.__init__, DeviceMesh.__dict__["mesh"]

    def real_init(self, *args, **kwargs):
        rank_map = kwargs.get("_rank_map")
        with unset_fake_temporarily():
            if isinstance(rank_map, FakeTensor):  # init_device_mesh's identity map, made inside the fake mode
                kwargs["_rank_map"] = torch.arange(rank_map.numel(), dtype=rank_map.dtype).view(rank_map.shape)
            init(self, *args, **kwargs)

    def real_mesh(self):
        with unset_fake_temporarily():
            return mesh.fget(self)

    DeviceMesh.__init__, DeviceMesh.mesh = real_init, property(real_mesh)
    try:
        yield
    finally:
        DeviceMesh.__init__, DeviceMesh.mesh = init, mesh


@contextlib.contextmanager
def fake_world(world_size: int, device: str = "cpu", rank: int = 0):
    """This process as rank ``rank`` (0 by default) of ``world_size`` ranks joined by torch's fake process group
    (collectives return at once, moving nothing; objects gathered or broadcast are this rank's, every rank of a fake
    world being its twin), with a one-dimensional device mesh over them; yields the mesh. Make the mesh here, outside
    :func:`fake_tensors`: inside, the mesh's own index tensor would be fake and reading it fails. A pipeline stage's
    output is released after its send as on real tensors (:func:`_fake_outputs_released`); DTensor's caches of this
    world's meshes are dropped on the way out (:func:`_forget_meshes`)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    # registers the "fake" backend with torch.distributed (its store is torch's C++ FakeStore)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_world needs a process without a process group (it makes the default one)")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    gather, broadcast = dist.all_gather_object, dist.broadcast_object_list

    def gather_twins(object_list, obj, group=None):
        object_list[:] = [obj] * len(object_list)

    def broadcast_twins(object_list, src=None, group=None, device=None, group_src=None):
        return None

    # objects exchanged (pickled into tensors) cannot pass the fake group: every rank of a fake world runs this
    # process's command, so each receives what this one has
    dist.all_gather_object, dist.broadcast_object_list = gather_twins, broadcast_twins
    try:
        with _fake_outputs_released(), _static_pipeline_warmup():
            yield init_device_mesh(device, (world_size,))
    finally:
        dist.all_gather_object, dist.broadcast_object_list = gather, broadcast
        dist.destroy_process_group()
        _forget_meshes()


@contextlib.contextmanager
def _fake_outputs_released():
    """A pipeline stage drops its output after sending it, but only when the output's type is exactly
    ``torch.Tensor`` (torch 2.15's ``_output_slot_is_releasable``): a fake tensor's type is not, so on fake tensors
    every stage output would stay alive until its backward (6 more hidden-state tensors at the tiny preset's peak
    than the real step on 2 ranks). While a fake world is up, a fake output is judged as the real one would be."""
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
    from torch.distributed.pipelining import stage

    base = getattr(stage, "_PipelineStageBase", None)
    judge = getattr(base, "_output_slot_is_releasable", None)
    if judge is None:
        yield
        return

    def as_real(self, output):
        if type(output) is FakeTensor:  # what the real step would hold: a plain tensor
            with unset_fake_temporarily():
                output = torch.empty(0)
        return judge(self, output)

    base._output_slot_is_releasable = as_real
    try:
        yield
    finally:
        base._output_slot_is_releasable = judge


@contextlib.contextmanager
def _static_pipeline_warmup():
    """Before its first step a pipeline schedule has its stages vote across ranks on how they infer shapes and reads
    the vote with ``.item()``: over a fake process group nothing is exchanged and, on fake tensors, ``.item()`` raises
    (``DataDependentOutputException``). torch 2.14 decides locally on a fake group (static when every stage has its
    shapes, which ``hf_dtrain.parallel`` gives them); torch 2.13 votes. While a fake world is up, 2.13's vote is
    2.14's local decision; where the schedule has no vote, or decides so itself, nothing changes."""
    import inspect

    import torch.distributed as dist
    from torch.distributed.pipelining import schedules, stage

    vote = getattr(schedules._PipelineSchedule, "_warmup_p2p", None)
    mode = getattr(stage, "InferenceMode", None)
    if vote is None or mode is None or '"fake"' in inspect.getsource(vote):
        yield
        return

    def decide_locally(self, stages, has_backward, p2p_done):
        pipeline = [st for st in stages if isinstance(st, stage.PipelineStage)]
        crosses = any(
            (not st.is_first and not st._is_same_rank(st.stage_index - 1))
            or (not st.is_last and not st._is_same_rank(st.stage_index + 1))
            for st in pipeline
        )
        if len(pipeline) != len(stages) or not crosses or all(dist.get_backend(st.group) != "fake" for st in pipeline):
            return vote(self, stages, has_backward, p2p_done)
        for st in pipeline:
            if mode.needs_dynamic(st._user_meta, has_backward):
                raise RuntimeError(
                    f"pipeline stage {st.stage_index} infers its shapes at run time, which a fake process group "
                    "cannot trace: give the stage its input and output shapes."
                )
            st._inference_mode = mode.STATIC
        return None

    schedules._PipelineSchedule._warmup_p2p = decide_locally
    try:
        yield
    finally:
        schedules._PipelineSchedule._warmup_p2p = vote


def _forget_meshes() -> None:
    """Drop what DTensor's dispatch cached about this world's meshes (sharding propagation, redistribution plans):
    a mesh of the next fake world equals one of this world and would be answered with this world's process groups,
    which are gone (a pipeline's last stage traced after its first)."""
    from torch.distributed.tensor import _redistribute, debug

    debug._clear_sharding_prop_cache()
    _redistribute.clear_redistribute_planner_cache()
    if hasattr(_redistribute._gen_transform_infos, "cache_clear"):
        _redistribute._gen_transform_infos.cache_clear()
