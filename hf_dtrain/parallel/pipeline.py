"""Pipeline parallelism for Hugging Face LLaMA-family causal LMs on ``torch.distributed.pipelining``.

``apply_pipeline(model, mesh, PipelineConfig(...), batch_size=B, seq_len=S)`` cuts the decoder layers into
contiguous stages, keeps on this rank only the stages it runs (the embedding with the first, the final norm and
``lm_head`` with the last) and builds torch's schedule over them. The cut is Merak's: the forward + backward time
of a proxy of the model (the embedding, one decoder layer, the head with its loss; LLaMA's layers are all alike) is
measured on this machine at the micro-batch's shape, and the layers are split so the slowest stage is as fast as it
can be (:func:`balance_layers`). Global rank 0's profile is broadcast, so every rank cuts alike.

The stage modules keep Hugging Face's parameter names (``model.layers.5.mlp.up_proj.weight``, ``lm_head.weight``),
so ``torch.distributed.checkpoint`` state dicts of a pipelined run line up with the unpipelined model's. Each stage
computes the rotary embeddings and the causal mask for itself, from the sequence it receives.

Schedules (torch's): ``GPipe``, ``1F1B`` (one stage per rank), ``Interleaved1F1B`` and ``InterleavedZeroBubble``
(``stages_per_rank`` >= 2, stage ``s`` on rank ``s % pp``). The loss is Hugging Face's causal-LM loss per
micro-batch, and gradients are scaled by 1 / micro-batches (torch's ``scale_grads``): the full batch's mean when
every micro-batch holds as many label tokens (fixed-length, unpadded pretraining batches; padded batches are
refused, since the stages do not carry an attention mask).

The Trainer cannot drive a pipeline (its loop calls ``model(**batch)`` once per step on every rank); use
``hf-dtrain pretrain --pp N`` or your own Accelerate loop with :meth:`Pipeline.step`.
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class
from torch.distributed.tensor import DTensor

from hf_dtrain.distributed.groups import CommFailure, is_comm_error
from hf_dtrain.errors import SettingsError
from hf_dtrain.models import LlamaPipelineStage, causal_mask

from .config import SINGLE_STAGE, PipelineConfig
from .tensor import local_loss, tensor_parallel_loss


class PipelineStageError(CommFailure):
    """A pipeline step failed in a transfer between stages (a peer that died, one that runs something else, or one
    silent past the group's timeout): names this rank's stages, their layers and their neighbours."""


def check_pipeline(model_config, pp: int, stages_per_rank: int = 1) -> None:
    """Refuse a pipeline degree the model cannot take, naming the flag (before any process group exists)."""
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise SettingsError(f"pp={pp!r}: the pipeline degree must be a whole number >= 1 (--pp).")
    stages = pp * stages_per_rank
    layers = model_config.num_hidden_layers
    if stages > layers:
        raise SettingsError(
            f"--pp {pp} x pipeline.stages_per_rank {stages_per_rank} = {stages} stages, but the model has "
            f"{layers} decoder layers: every stage needs at least one; lower --pp or "
            "pipeline.stages_per_rank."
        )
    if pp > 1 and getattr(model_config, "tie_word_embeddings", False):
        raise SettingsError(
            "pipeline parallelism: the model ties lm_head to the embedding (tie_word_embeddings), "
            "which would sit on the first and the last stage; untie them (tie_word_embeddings=False) "
            "or train without --pp."
        )


def balance_layers(
    layer_costs: list[float], stages: int, first_extra: float = 0.0, last_extra: float = 0.0
) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` layer ranges, one per stage, minimizing the slowest stage's cost (the
    pipeline's step time is set by it); the first stage also pays ``first_extra`` (the embedding), the last
    ``last_extra`` (norm, head and loss). Every stage gets at least one layer. Exact dynamic programming:
    O(stages x layers^2)."""
    n = len(layer_costs)
    if not 1 <= stages <= n:
        raise SettingsError(f"{stages} stages for {n} layers: every stage needs at least one layer.")
    prefix = [0.0]
    for c in layer_costs:
        prefix.append(prefix[-1] + c)

    def cost(i, j, s):  # layers [i, j) as stage s
        return prefix[j] - prefix[i] + (first_extra if s == 0 else 0.0) + (last_extra if s == stages - 1 else 0.0)

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]  # best[s][j]: first j layers in s stages
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for j in range(s, n - (stages - s) + 1):
            for i in range(s - 1, j):
                value = max(best[s - 1][i], cost(i, j, s - 1))
                if value < best[s][j] - 1e-12:
                    best[s][j], cut[s][j] = value, i
    bounds, j = [], n
    for s in range(stages, 0, -1):
        i = cut[s][j]
        bounds.append((i, j))
        j = i
    return bounds[::-1]


def _causal_lm(model: nn.Module) -> nn.Module:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = getattr(base, "model", None)
    if (
        getattr(decoder, "layers", None) is None
        or not hasattr(base, "lm_head")
        or not hasattr(decoder, "embed_tokens")
        or not hasattr(decoder, "rotary_emb")
    ):
        raise SettingsError(
            f"apply_pipeline: {type(base).__name__} is not a LLaMA-family causal LM "
            "(model.embed_tokens, model.layers, model.rotary_emb, model.norm, lm_head)."
        )
    return base


def median_seconds(fn, repeats: int = 5, barrier: bool = False) -> float:
    """The median wall time of ``fn()`` after one warm-up call (CUDA synchronized around it; ``barrier``: all ranks
    start each call together, so the cores or links are shared as in training). The planner's profile uses it too."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    times = []
    for _ in range(repeats):
        if barrier and dist.is_initialized():
            dist.barrier()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _static_shapes(module: nn.Module, example: torch.Tensor) -> dict:
    """A stage's input and output as ``PipelineStage`` takes them to skip its shape inference (which exchanges the
    shapes between the stages' ranks, and a fake process group moves nothing): token ids into the first stage,
    hidden states (``sequence_shards`` of the sequence under sequence parallelism) in the residual stream's dtype
    between stages (the parameters' own, or FSDP2's ``param_dtype``: autocast leaves the residual sum in the
    parameters' dtype), logits out of the last."""
    from torch.distributed.fsdp import FSDPModule

    config = module.config
    batch, length = example.shape
    dtype = next(p.dtype for p in module.parameters() if p.is_floating_point())
    if isinstance(module, FSDPModule):
        dtype = module._get_fsdp_state()._mp_policy.param_dtype or dtype
    hidden = (batch, length // getattr(module, "sequence_shards", 1), config.hidden_size)

    def meta(shape, dtype):  # hidden states and logits carry gradients back
        return torch.empty(shape, dtype=dtype, device="meta", requires_grad=dtype.is_floating_point)

    inputs = meta(example.shape, example.dtype) if module.first else meta(hidden, dtype)
    outputs = meta((batch, length, config.vocab_size), dtype) if module.last else meta(hidden, dtype)
    return {"input_args": inputs, "output_args": outputs}


def profile_costs(model: nn.Module, example: torch.Tensor, flops: bool = False) -> dict[str, float]:
    """Forward + backward seconds of the model's pieces at ``example``'s (micro-batch) shape, measured here: the
    embedding, one decoder layer (Merak's proxy: every LLaMA layer is alike) and the norm + head + loss. ``flops``:
    their floating-point operations instead (a trace on fake tensors, whose time says nothing), the embedding
    counted as one layer's hundredth (a lookup)."""
    base = _causal_lm(model)
    decoder = base.model
    layer = decoder.layers[0]
    with torch.no_grad():
        hidden = decoder.embed_tokens(example).detach()
    positions = torch.arange(example.shape[1], device=example.device).unsqueeze(0)
    mask = causal_mask(base.config, hidden)
    rope = decoder.rotary_emb(hidden, position_ids=positions)
    labels = example

    def embed():
        decoder.embed_tokens(example).float().sum().backward()

    def one_layer():
        x = hidden.clone().requires_grad_(True)
        layer(x, attention_mask=mask, position_embeddings=rope, position_ids=positions).float().sum().backward()

    def head():
        x = hidden.clone().requires_grad_(True)
        logits = base.lm_head(decoder.norm(x))
        base.loss_function(logits=logits, labels=labels, vocab_size=base.config.vocab_size).backward()

    if flops:
        from torch.utils.flop_counter import FlopCounterMode

        def count(fn):
            with FlopCounterMode(display=False) as counter:
                fn()
            return float(counter.get_total_flops())

        costs = {"layer": count(one_layer), "head": count(head)}
        costs["embed"] = costs["layer"] / 100
    else:
        costs = {"embed": median_seconds(embed), "layer": median_seconds(one_layer), "head": median_seconds(head)}
    base.zero_grad(set_to_none=True)
    return costs


class Pipeline:
    """This rank's stages and torch's schedule over them. ``step(input_ids, labels)`` runs one training step's
    forward and backward over the micro-batches (gradients land in :meth:`parameters`; call the optimizer after)
    and returns the batch's mean loss on every rank of the pipeline."""

    def __init__(
        self,
        modules,
        stages,
        schedule,
        group,
        last_rank: int,
        n_microbatches: int,
        bounds: list[tuple[int, int]],
        costs: dict | None = None,
    ):
        self.modules, self.stages, self.schedule = modules, stages, schedule
        self.group, self.last_rank, self.n_microbatches = group, last_rank, n_microbatches
        self.bounds, self.costs = bounds, costs
        self.has_first = any(m.first for m in modules)
        self.has_last = any(m.last for m in modules)

    def parameters(self):
        for m in self.modules:
            yield from m.parameters()

    def named_parameters(self):
        seen = set()
        for m in self.modules:
            for n, p in m.named_parameters():
                if n not in seen:
                    seen.add(n)
                    yield n, p

    def train(self, mode: bool = True):
        for m in self.modules:
            m.train(mode)
        return self

    def _broadcast_loss(self, losses: list, device) -> torch.Tensor:
        if self.has_last:
            loss = torch.stack([local_loss(v).detach().float() for v in losses]).mean().to(device)
        else:
            loss = torch.zeros((), device=device)
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.broadcast(loss, src=self.last_rank, group=self.group)
        return loss

    def where(self) -> str:
        """This rank's stages, their layers and the ranks of the stages next to them, in words."""
        n_stages = len(self.bounds)
        pp = dist.get_world_size(self.group) if self.group is not None else 1

        def rank_of(stage):
            return dist.get_global_rank(self.group, stage % pp) if self.group is not None else 0

        parts = []
        for st in self.stages:
            s = st.stage_index
            start, end = self.bounds[s]
            near = [f"stage {n} on rank {rank_of(n)}" for n in (s - 1, s + 1) if 0 <= n < n_stages]
            parts.append(f"stage {s} of {n_stages} (layers {start}-{end - 1}; next to {' and '.join(near)})")
        return "; ".join(parts)

    def _run(self, run, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``run`` (the schedule's ``step`` or ``eval``) over the micro-batches; the batch's mean loss on every rank."""
        if input_ids.shape[0] % self.n_microbatches:
            raise SettingsError(
                f"a batch of {input_ids.shape[0]} sequences does not split into "
                f"{self.n_microbatches} micro-batches (pipeline.microbatches)."
            )
        losses: list = []
        args = (input_ids,) if self.has_first else ()
        kwargs = {"target": labels, "losses": losses} if self.has_last else {}
        try:
            with tensor_parallel_loss(self.modules[-1]):
                run(*args, **kwargs)
            return self._broadcast_loss(losses, input_ids.device)
        except Exception as e:
            if not is_comm_error(e):
                raise
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise PipelineStageError(
                f"pipeline {self.where()} on rank {dist.get_rank()}: a transfer failed ({first}). A neighbour died, "
                "runs another configuration, or was silent for the process group's timeout; every rank must run "
                "the same command."
            ) from e

    @torch.no_grad()
    def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The batch's mean loss through the pipeline, forward only (torch's ``schedule.eval``), on every rank."""
        return self._run(self.schedule.eval, input_ids, labels)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's stages' whole (gathered over tp / data shards) parameters and buffers, on the CPU, under
        Hugging Face's names. Every rank of the stage's tp and data groups must call it (it gathers)."""
        out: dict[str, torch.Tensor] = {}
        for m in self.modules:
            if any(isinstance(p, DTensor) for p in m.parameters()):
                # not cpu_offload: with it only global rank 0 keeps the values, and a later stage's writer is not it
                state = get_model_state_dict(m, options=StateDictOptions(full_state_dict=True))
            else:
                state = m.state_dict()
            state = {k: v.detach().cpu() for k, v in state.items()}
            out.update({k: v for k, v in state.items() if "rotary_emb" not in k})
        return out

    def save_pretrained(self, save_directory: str, config, writer: bool) -> None:
        """A Hugging Face sharded checkpoint, one safetensors file per pipeline rank (its stages' weights) and the
        index, loadable with ``from_pretrained``: every rank calls it; ``writer``: this rank writes its pipeline
        rank's file (one rank per pipeline rank: the first of its tp and data groups)."""
        state = self.state_dict()
        pp, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        name = f"model-{rank + 1:05d}-of-{pp:05d}.safetensors"
        if writer:
            os.makedirs(save_directory, exist_ok=True)
            save_file(
                {k: v.contiguous() for k, v in state.items()},
                os.path.join(save_directory, name),
                metadata={"format": "pt"},
            )
        keys: list = [None] * pp
        dist.all_gather_object(
            keys, (name, sorted(state), sum(v.numel() * v.element_size() for v in state.values())), group=self.group
        )
        if writer and rank == 0:
            index = {
                "metadata": {"total_size": sum(size for _, _, size in keys)},
                "weight_map": {k: file for file, names, _ in keys for k in names},
            }
            with open(os.path.join(save_directory, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=1)
            config.save_pretrained(save_directory)
        dist.barrier()

    def step(
        self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        if attention_mask is not None and not bool(attention_mask.all()):
            raise SettingsError(
                "pipeline parallelism takes unpadded batches (the stages carry no attention mask): "
                "pack the sequences to a fixed length, as hf-dtrain pretrain does."
            )
        return self._run(self.schedule.step, input_ids, labels)


def _check_agreement(group, pp_rank: int, plan: dict) -> None:
    """Every rank of the pipeline builds the same pipeline, or every rank raises naming what differs where (one
    small all-gather over ``group``, bounded by its timeout): ranks that disagree would otherwise wait on each other's
    transfers until the timeout."""
    plans: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(plans, plan, group=group)
    differ = [(r, k) for r, theirs in enumerate(plans) for k in plan if theirs[k] != plans[0][k]]
    if differ:
        said = "; ".join(
            f"pipeline rank {r} has {k} {plans[r][k]!r}, pipeline rank 0 has {plans[0][k]!r}" for r, k in differ[:6]
        )
        raise SettingsError(
            f"the pipeline's ranks build different pipelines: {said}. Every rank must run the same "
            "command (pipeline.*, the batch size and the sequence length) on the same model."
        )


def apply_pipeline(
    model: nn.Module,
    mesh,
    config: PipelineConfig | None = None,
    *,
    batch_size: int,
    seq_len: int,
    device: torch.device | None = None,
    after_split=None,
    layer_cut: list[tuple[int, int]] | None = None,
) -> Pipeline:
    """Cut ``model`` (a LLaMA-family causal LM, or a peft model around one) into ``pp x stages_per_rank`` stages
    over the 1D ``mesh`` (the ``pp`` dimension), keep this rank's and build the schedule. ``batch_size``: sequences
    per step on this pipeline (split into ``config.microbatches``), ``seq_len`` their length (the profile runs at
    the micro-batch's shape). ``layer_cut``: the stages' ``[start, end)`` layers instead of the balanced cut.
    ``after_split(stage_module)``: applied to each stage module before the schedule is
    built (tensor parallelism, FSDP2: ``apply_tensor_parallel``, ``apply_fsdp``). Build the optimizer from
    :meth:`Pipeline.parameters` afterwards."""
    config = config or PipelineConfig()
    if mesh.ndim != 1:
        raise SettingsError(f"apply_pipeline takes the 1D pp mesh (mesh['pp']), got a {mesh.ndim}D mesh.")
    base = _causal_lm(model)
    pp, rank = mesh.size(), mesh.get_local_rank()
    check_pipeline(base.config, pp, config.stages_per_rank)
    n_stages = pp * config.stages_per_rank
    n_layers = len(base.model.layers)
    n_micro = config.n_microbatches(pp, batch_size)
    device = device or next(base.parameters()).device
    example = torch.randint(
        0, base.config.vocab_size, (batch_size // n_micro, seq_len), generator=torch.Generator().manual_seed(0)
    ).to(device)
    costs = None
    fake = dist.get_backend(mesh.get_group()) == "fake"  # a memory trace over torch's fake process group
    if layer_cut is not None:  # given (the planner traces its plan with the cut its cost model predicts)
        bounds = [tuple(b) for b in layer_cut]
        if len(bounds) != n_stages or bounds[0][0] != 0 or bounds[-1][1] != n_layers:
            raise SettingsError(f"layer_cut {layer_cut}: {n_stages} contiguous stages over {n_layers} layers.")
    elif config.balance == "profile":
        costs = profile_costs(model, example, flops=fake)
        # every rank of the job cuts alike: global rank 0's profile, broadcast to all (the tp / data-parallel peers
        # of a stage sit in other pp groups, and a cut of their own from their own timings would deadlock them)
        shared = [costs]
        dist.broadcast_object_list(shared, src=0)
        costs = shared[0]
        bounds = balance_layers([costs["layer"]] * n_layers, n_stages, costs["embed"], costs["head"])
    else:
        bounds = balance_layers([1.0] * n_layers, n_stages)
    mine = [s for s in range(n_stages) if s % pp == rank]
    modules, stages = [], []
    for s in mine:
        module = LlamaPipelineStage(base, *bounds[s], first=s == 0, last=s == n_stages - 1)
        if after_split is not None:
            module = after_split(module) or module
        modules.append(module)
        shapes = _static_shapes(module, example) if fake else {}
        stages.append(PipelineStage(module, s, n_stages, device, group=mesh.get_group(), **shapes))
    # what this rank does not run is dropped: only its stages' modules keep references
    for i in range(n_layers):
        if not any(str(i) in m.model.layers for m in modules):
            base.model.layers[i] = nn.Identity()
    if not any(m.first for m in modules):
        base.model.embed_tokens = None
    if not any(m.last for m in modules):
        base.model.norm, base.lm_head = None, None

    def loss_fn(logits, labels):  # a replicated DTensor under loss parallelism
        return base.loss_function(logits=logits, labels=labels, vocab_size=base.config.vocab_size)

    _check_agreement(
        mesh.get_group(),
        rank,
        {
            "stages": n_stages,
            "schedule": config.schedule,
            "microbatches": n_micro,
            "batch_size": batch_size,
            "seq_len": seq_len,
            "layer cut": bounds,
        },
    )
    cls = get_schedule_class(config.schedule)
    schedule = cls(stages[0] if config.schedule in SINGLE_STAGE else stages, n_microbatches=n_micro, loss_fn=loss_fn)
    last_rank = dist.get_global_rank(mesh.get_group(), (n_stages - 1) % pp)
    return Pipeline(modules, stages, schedule, mesh.get_group(), last_rank, n_micro, bounds, costs)
