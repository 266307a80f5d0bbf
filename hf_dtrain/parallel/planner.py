"""A Merak-style planner: every legal (pp, dp_replicate, dp_shard, tp, micro-batches, activation policy) plan of a
LLaMA-family model on ``world`` devices, its step time and per-rank memory predicted by a cost model, ranked.

The cost model (``predict``) is analytic, with its constants from a :class:`MachineProfile` measured on the machine
(:func:`measure_profile`: one decoder layer's forward + backward at two sizes, collectives at two sizes and group
sizes, an AdamW step, the bytes autograd saves per token) or given for a device (``MachineProfile.preset``):

* compute: each stage's layers' FLOPs / tp x seconds-per-FLOP + a fixed cost per layer call (small layers are
  latency bound), the head (vocabulary projection + loss) on the last stage; recomputation adds a forward;
* tensor parallelism: per layer and micro-batch, 4 all-gathers + 4 reduce-scatters of ``tokens x hidden`` (sequence
  parallel) or 4 all-reduces (not), alpha-beta timed on the link the tp group spans;
* pipeline: ``(m x v + pp - 1)`` slots of the slowest virtual stage (1F1B / GPipe / interleaved bubbles), plus the
  activations sent between stages;
* FSDP2: each stage's parameters gathered twice per micro-batch (forward, backward) and their gradients
  reduce-scattered once per step over dp_shard; HSDP adds an all-reduce across dp_replicate; an ``overlap`` fraction
  of it hides behind compute (0 on CPU gloo: collectives and compute share the cores);
* memory: fp32 parameters, gradients and AdamW state sharded over tp x pp x dp_shard, one gathered layer, the
  activations of the micro-batches in flight (all of them for GPipe, up to pp for 1F1B) divided by tp under
  sequence parallelism, and the logits on the last stage. A plan that does not fit is kept in the table, marked,
  with the buffer that overflows named.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from hf_dtrain.distributed.collectives import all_gather_single, reduce_scatter_single
from hf_dtrain.distributed.counters import SavedTensorCounter
from hf_dtrain.errors import SettingsError
from hf_dtrain.models import causal_mask, llama_config

from .config import ACTIVATION_POLICIES, FSDPConfig, PipelineConfig
from .pipeline import balance_layers, check_pipeline, median_seconds
from .tensor import check_tensor_parallel

GiB = 1024**3


@dataclass
class MachineProfile:
    """The cost model's constants for one kind of device and link. ``measure_profile`` fills them on this machine;
    ``preset('h100')`` gives a GPU node's (public peak figures at a stated efficiency, not measured here)."""

    name: str = "unnamed"
    sec_per_flop: float = 1e-10  # dense matmul time per FLOP (per rank, under the launch's concurrency)
    layer_overhead: float = 1e-4  # seconds per decoder-layer call (forward), independent of size
    coll_latency: float = 1e-4  # seconds per collective
    intra_sec_per_byte: float = 1e-9  # per byte moved per rank, inside a node
    inter_sec_per_byte: float = 1e-8  # per byte moved per rank, across nodes
    optim_sec_per_param: float = 1e-8  # AdamW step per local parameter
    activation_bytes_per_token: dict = field(default_factory=lambda: {"hidden": 34.0, "intermediate": 12.0})
    overlap: float = 0.0  # fraction of FSDP / pipeline communication hidden behind compute
    device_memory: float = 16 * GiB
    ranks_per_node: int = 8
    # compute units a node's ranks share (CPU cores when ranks outnumber them); None: one device per rank (GPUs).
    # sec_per_flop and layer_overhead are then per rank with all of the node's ranks computing at once
    compute_slots: float | None = None
    # seconds a tensor-parallel decoder layer adds per micro-batch beyond its FLOPs / tp and its modeled
    # collectives: DTensor's dispatch and the small reductions (norm weights, loss parallel) it issues
    tp_layer_overhead: float = 0.0

    @classmethod
    def preset(cls, name: str) -> MachineProfile:
        if name == "h100":  # 989 TFLOP/s bf16 dense peak at 45% efficiency; NVLink 4 ~450 GB/s per direction at
            # 70%; 400 Gb/s InfiniBand per GPU at 80%; 80 GB HBM
            return cls(
                name="h100 (datasheet figures, not measured)",
                sec_per_flop=1 / (0.45 * 989e12),
                layer_overhead=3e-5,
                coll_latency=2e-5,
                intra_sec_per_byte=1 / (0.7 * 450e9),
                inter_sec_per_byte=1 / (0.8 * 50e9),
                optim_sec_per_param=8 * 2 / (0.6 * 3.35e12),
                overlap=0.7,
                device_memory=80 * GiB,
                ranks_per_node=8,
                activation_bytes_per_token={"hidden": 17.0, "intermediate": 6.0},
            )
        raise SettingsError(
            f"unknown machine profile {name!r}: use 'h100', or --profile FILE.json from "
            "hf-dtrain plan --calibrate --save-profile FILE.json."
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> MachineProfile:
        data = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SettingsError(f"machine profile: unknown keys {unknown}; the keys are {sorted(known)}.")
        return cls(**data)


@dataclass
class Plan:
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    microbatches: int
    activation: str = "none"
    schedule: str = "1F1B"
    stages_per_rank: int = 1
    step_time: float = 0.0
    memory: dict = field(default_factory=dict)
    fits: bool = True
    overflow: str | None = None
    breakdown: dict = field(default_factory=dict)
    traced: bool = False  # memory from a traced step (traced_memory), not the per-token arithmetic
    layer_cut: list = field(default_factory=list)  # the stages' [start, end) layers the cost model balanced

    @property
    def key(self) -> str:
        s = f"pp{self.pp}-dpr{self.dp_replicate}-dps{self.dp_shard}-tp{self.tp}-m{self.microbatches}"
        if self.stages_per_rank > 1:
            s += f"-v{self.stages_per_rank}"
        return s + ("-ckpt" if self.activation == "checkpoint" else "")

    def flags(self) -> str:
        """The ``hf-dtrain pretrain`` flags of this plan."""
        out = [
            f"--tp {self.tp}",
            f"--pp {self.pp}",
            f"--dp-replicate {self.dp_replicate}",
            f"--dp-shard {self.dp_shard}",
        ]
        if self.pp > 1:
            out += [f"--pipeline.schedule {self.schedule}", f"--pipeline.microbatches {self.microbatches}"]
            if self.stages_per_rank > 1:
                out.append(f"--pipeline.stages-per-rank {self.stages_per_rank}")
        if self.activation == "checkpoint":
            out.append("--fsdp.activation-checkpointing true")
        return " ".join(out)

    def accelerate_config(self, world: int, mixed_precision: str = "bf16") -> str:
        """The ``accelerate launch`` config file that runs ``hf-dtrain pretrain`` with these flags (the mesh itself
        is laid out by hf-dtrain from the flags: Accelerate's ParallelismConfig has no pipeline dimension)."""
        nodes = max(1, world // 8) if world > 8 else 1
        return "\n".join(
            [
                "compute_environment: LOCAL_MACHINE",
                "distributed_type: MULTI_GPU",
                f"num_machines: {nodes}",
                f"num_processes: {world}",
                f"mixed_precision: {mixed_precision}",
                "rdzv_backend: c10d",
                "same_network: true",
                "use_cpu: false",
                f"# accelerate launch --config_file this.yaml -m hf_dtrain.cli pretrain ... {self.flags()}",
            ]
        )


def _dims(config) -> dict:
    h, f = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    hd = h // heads
    layer_params = 2 * h * h + 2 * h * kv * hd + 3 * h * f + 2 * h
    return dict(
        h=h,
        f=f,
        heads=heads,
        kv=kv,
        V=config.vocab_size,
        L=config.num_hidden_layers,
        layer_params=layer_params,
        embed_params=config.vocab_size * h,
        head_params=config.vocab_size * h + h,
    )


def layer_flops(dims: dict, tokens: int, seq_len: int) -> float:
    """Forward FLOPs of one decoder layer on ``tokens`` tokens (sequences of ``seq_len``): the projections' matmuls
    and the causal attention scores and mixing."""
    return 2.0 * dims["layer_params"] * tokens + 2.0 * tokens * seq_len * dims["h"]


def _coll(profile: MachineProfile, n: int, nbytes: float, kind: str, intra: bool) -> float:
    """alpha-beta time of one collective over ``n`` ranks on ``nbytes`` (the full tensor)."""
    if n <= 1:
        return 0.0
    moved = {"all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_reduce": 2 * (n - 1) / n, "p2p": 1.0}[
        kind
    ] * nbytes
    per = profile.intra_sec_per_byte if intra else profile.inter_sec_per_byte
    return profile.coll_latency + moved * per


def predict(
    plan: Plan, config, profile: MachineProfile, global_batch: int, seq_len: int, sequence_parallel: bool = True
) -> Plan:
    """Fill ``plan``'s predicted step time (seconds), per-rank memory (bytes, by buffer) and whether it fits."""
    d = _dims(config)
    pp, tp, dpr, dps, m, v = plan.pp, plan.tp, plan.dp_replicate, plan.dp_shard, plan.microbatches, plan.stages_per_rank
    dp = dpr * dps
    per_replica = global_batch // dp
    tokens_mb = per_replica // m * seq_len
    ckpt = plan.activation == "checkpoint"
    # groups: tp innermost, then dp_shard, dp_replicate, pp (the mesh order); a group is intra-node if it fits
    rpn = profile.ranks_per_node
    tp_intra = tp <= rpn
    dps_intra = tp * dps <= rpn
    dpr_intra = tp * dps * dpr <= rpn
    pp_intra = tp * dp * pp <= rpn
    # compute per micro-batch: fwd + bwd (2x fwd) + recompute (1x fwd)
    passes = 4.0 if ckpt else 3.0
    t_layer = passes * (layer_flops(d, tokens_mb, seq_len) / tp * profile.sec_per_flop + profile.layer_overhead)
    t_head = 3.0 * (2.0 * d["h"] * d["V"] * tokens_mb / tp * profile.sec_per_flop + profile.layer_overhead)
    t_embed = 3.0 * profile.layer_overhead
    # tensor parallelism per layer and micro-batch (forward and backward)
    act_bytes = tokens_mb * d["h"] * 4
    t_tp = _tp_time(profile, tp, act_bytes, tp_intra, sequence_parallel, ckpt)
    n_stages = pp * v
    bounds = balance_layers([t_layer + t_tp] * d["L"], n_stages, t_embed, t_head + (t_tp if tp > 1 else 0.0))
    stage_layers = max(b - a for a, b in bounds)
    plan.layer_cut = [list(b) for b in bounds] if pp > 1 else []
    stage_time = []
    for s, (a, b) in enumerate(bounds):
        t = (b - a) * (t_layer + t_tp) + (t_embed if s == 0 else 0.0) + (t_head if s == n_stages - 1 else 0.0)
        if pp > 1:  # the activations sent to the next stage and their gradients back
            t += 2 * _coll(profile, 2, act_bytes / (tp if sequence_parallel else 1), "p2p", pp_intra)
        stage_time.append(t)
    slowest = max(stage_time)
    compute = (m * v + pp - 1) * slowest if pp > 1 else m * slowest
    slots = profile.compute_slots
    if slots is not None and slots < rpn:
        # the node's ranks share its cores: the profile's speed is with all of them computing. A rank that computes
        # while others wait (pipeline bubbles) runs up to rpn / slots times faster, and the node does at most
        # `slots` ranks' worth of work at a time: the step is the larger of the critical path at full speed and
        # the node's total work over its cores
        world = pp * tp * dp
        alone = slots / rpn
        work = m * sum(stage_time) * tp * dp  # rank-seconds per step at the profile's speed, all ranks
        on_node = min(rpn, world)
        compute = max(compute * alone, work * alone * on_node / world / slots)

    # FSDP2 / HSDP per step, for the largest stage's parameters (this rank holds 1/tp of them)
    stage_params = stage_layers * d["layer_params"] * v + max(d["embed_params"], d["head_params"]) * (
        1 if pp == 1 else 0.5
    )
    if pp == 1:
        stage_params = d["L"] * d["layer_params"] + d["embed_params"] + d["head_params"]
    local = stage_params / tp
    t_fsdp = 0.0
    if dps > 1:
        gathers = 2 * m * v if pp > 1 else 2
        t_fsdp = gathers * _coll(profile, dps, local * 4, "all_gather", dps_intra) + _coll(
            profile, dps, local * 4, "reduce_scatter", dps_intra
        )
    if dpr > 1:
        t_fsdp += _coll(profile, dpr, local * 4 / dps, "all_reduce", dpr_intra)
    exposed = t_fsdp * (1 - profile.overlap)
    t_optim = local / dps * profile.optim_sec_per_param
    plan.step_time = compute + exposed + t_optim
    plan.breakdown = {
        "compute_and_tp": compute,
        "fsdp_exposed": exposed,
        "optimizer": t_optim,
        "bubble_fraction": (pp - 1) / (m * v + pp - 1) if pp > 1 else 0.0,
    }
    _fill_memory(plan, d, profile, tokens_mb, stage_layers, local, sequence_parallel)
    return plan


def _tp_time(profile: MachineProfile, tp: int, act_bytes: float, intra: bool, sequence_parallel: bool, ckpt: bool):
    """Tensor parallelism's communication per layer and micro-batch (forward and backward)."""
    if tp == 1:
        return 0.0
    if sequence_parallel:
        t_tp = 4 * (
            _coll(profile, tp, act_bytes, "all_gather", intra) + _coll(profile, tp, act_bytes, "reduce_scatter", intra)
        )
    else:
        t_tp = 4 * _coll(profile, tp, act_bytes, "all_reduce", intra)
    t_tp += profile.tp_layer_overhead
    return t_tp * 1.5 if ckpt else t_tp


def _fill_memory(
    plan: Plan, d: dict, profile: MachineProfile, tokens_mb: int, stage_layers: int, local: float, sequence_parallel
) -> None:
    """``plan``'s memory per rank by buffer, whether it fits the device, and what overflows when not (``local``: the
    largest stage's parameters this rank holds before ZeRO sharding)."""
    pp, tp, dps, m, v = plan.pp, plan.tp, plan.dp_shard, plan.microbatches, plan.stages_per_rank
    ckpt = plan.activation == "checkpoint"
    a = profile.activation_bytes_per_token
    per_token_layer = a["hidden"] * d["h"] + a["intermediate"] * d["f"]
    if tp > 1:
        per_token_layer = (
            per_token_layer / tp if sequence_parallel else (per_token_layer - 4 * 4 * d["h"]) / tp + 4 * 4 * d["h"]
        )
    in_flight = m if (plan.schedule == "GPipe" or pp == 1) else min(m * v, pp * v)
    if ckpt:
        acts = (
            in_flight * tokens_mb * stage_layers * d["h"] * 4 / (tp if sequence_parallel else 1)
            + tokens_mb * per_token_layer
        )
    else:
        acts = in_flight * tokens_mb * stage_layers * per_token_layer
    if pp == 1 and m > 1:  # gradient accumulation keeps one micro-batch's activations at a time
        acts = acts / m
    logits = 2 * tokens_mb * d["V"] * 4 / tp
    memory = {
        "parameters": local / dps * 4,
        "gradients": local / dps * 4,
        "optimizer_state": local / dps * 8,
        "gathered_layer": (d["layer_params"] / tp * 4 * 2) if dps > 1 else 0.0,
        "activations": acts,
        "logits": logits,
    }
    _set_memory(plan, memory, profile, traced=False)


def legal_plans(
    config,
    world: int,
    global_batch: int,
    max_microbatches: int = 16,
    activations=ACTIVATION_POLICIES,
    interleave: bool = True,
) -> list[Plan]:
    """Every (pp, dp_replicate, dp_shard, tp, micro-batches, activation policy) the runtime accepts for ``config``
    on ``world`` ranks with ``global_batch`` sequences per step: degrees whose product is ``world``, tp dividing the
    heads, KV heads, MLP and vocabulary, at most one stage per layer, micro-batch counts that divide the replica's
    batch (1 without a pipeline)."""
    plans = []
    divisors = [k for k in range(1, world + 1) if world % k == 0]
    for tp in divisors:
        try:
            check_tensor_parallel(config, tp)
        except ValueError:
            continue
        for pp in divisors:
            if world % (tp * pp):
                continue
            rest = world // (tp * pp)
            for dpr in [k for k in range(1, rest + 1) if rest % k == 0]:
                dps = rest // dpr
                dp = dpr * dps
                if global_batch % dp:
                    continue
                per_replica = global_batch // dp
                for v in [1, 2] if (interleave and pp > 1) else [1]:
                    try:
                        check_pipeline(config, pp, v)
                    except ValueError:
                        continue
                    schedule = "1F1B" if v == 1 else "Interleaved1F1B"
                    ms = (
                        [1]
                        if pp == 1
                        else [
                            k
                            for k in (pp, 2 * pp, 4 * pp, 8 * pp)
                            if k <= min(per_replica, max_microbatches) and per_replica % k == 0
                        ]
                    )
                    for m in ms:
                        if pp > 1:
                            try:
                                PipelineConfig(schedule=schedule, stages_per_rank=v, microbatches=m).n_microbatches(
                                    pp, per_replica
                                )
                            except ValueError:
                                continue
                        for act in activations:
                            plans.append(
                                Plan(
                                    pp=pp,
                                    dp_replicate=dpr,
                                    dp_shard=dps,
                                    tp=tp,
                                    microbatches=m,
                                    activation=act,
                                    schedule=schedule,
                                    stages_per_rank=v,
                                )
                            )
    return plans


def rank_plans(
    config,
    world: int,
    profile: MachineProfile,
    global_batch: int,
    seq_len: int,
    activations=ACTIVATION_POLICIES,
    interleave: bool = True,
    trace: int = 0,
    autocast: torch.dtype | None = None,
    trace_seconds: float | None = None,
) -> list[Plan]:
    """The legal plans, predicted and sorted: those that fit first, by predicted step time.

    ``trace``: the memory of the first ``trace`` rows comes from tracing each plan's step (:func:`traced_memory`)
    instead of the per-token arithmetic, and whether they fit with it; a row that no longer fits goes down and the
    next is traced, until the first ``trace`` rows are traced (or every plan is). ``trace_seconds``: no new trace is
    started once the traces so far and one more (at their mean time) would pass it; the first is always traced, and
    the rows left keep the arithmetic (``Plan.traced`` says which). ``autocast``: the run's mixed precision
    (Accelerate's ``bf16``) for the trace."""
    plans = [
        predict(p, config, profile, global_batch, seq_len)
        for p in legal_plans(config, world, global_batch, activations=activations, interleave=interleave)
    ]
    if not plans:
        raise SettingsError(
            f"no legal plan for {world} ranks and a global batch of {global_batch}: the batch must "
            "split over the data-parallel replicas (try a multiple of the world size)."
        )

    def order(p):
        return (not p.fits, p.step_time)

    plans.sort(key=order)
    spent, count = 0.0, 0
    while trace:
        untraced = [p for p in plans[:trace] if not p.traced]
        if not untraced:
            break
        for p in untraced:
            if trace_seconds and count and spent * (1 + 1 / count) > trace_seconds:
                return plans  # the budget is spent: the rows left keep the arithmetic
            start = time.monotonic()
            _set_memory(p, traced_memory(p, config, world, global_batch, seq_len, autocast), profile, traced=True)
            spent, count = spent + time.monotonic() - start, count + 1
        plans.sort(key=order)
    return plans


def traced_memory(
    plan: Plan, config, world: int, global_batch: int, seq_len: int, autocast: torch.dtype | None = None
) -> dict:
    """``plan``'s per-rank memory by category (bytes), traced: the LLaMA of ``config`` built on fake tensors, laid
    out as ``hf-dtrain pretrain`` with the plan's flags lays it out (:func:`~hf_dtrain.parallel.mesh.apply_parallelism`
    over a fake process group of the plan's ranks with at most two replicas (a rank's shapes do not change with more
    replicas; ``world`` is the run's); a pipeline cut where the cost model cut it, ``plan.layer_cut``, as
    ``predict`` fills it: the run times the pieces on the machine), two AdamW steps of its own forward and backward
    (:func:`~hf_dtrain.parallel.mesh.laid_out_step`) traced on rank 0, and with a pipeline on the last stage's first
    rank too; the larger is returned. No weight is allocated."""
    from transformers import LlamaForCausalLM

    from .mesh import trace_layout

    def build(device):
        with torch.device(device):
            return LlamaForCausalLM(config)

    # a rank's shapes do not depend on how many replicas there are (two keep HSDP's exchange across them): traced on
    # that many, a plan for 100,000 devices is a trace of a few ranks, not a fake world of 100,000
    degrees = {"pp": plan.pp, "dp_replicate": min(plan.dp_replicate, 2), "dp_shard": plan.dp_shard, "tp": plan.tp}
    pipeline = None
    if plan.pp > 1:
        pipeline = PipelineConfig(
            schedule=plan.schedule, microbatches=plan.microbatches, stages_per_rank=plan.stages_per_rank
        )
    memory = trace_layout(
        build,
        degrees,
        batch_size=global_batch // (plan.dp_replicate * plan.dp_shard),
        seq_len=seq_len,
        pipeline=pipeline,
        fsdp=FSDPConfig(activation_checkpointing=True) if plan.activation == "checkpoint" else None,
        autocast=autocast,
        layer_cut=plan.layer_cut or None,
    )
    return dict(memory.split)


def _set_memory(plan: Plan, memory: dict, profile: MachineProfile, traced: bool) -> None:
    """``plan``'s memory per rank by buffer, whether it fits the device, and the largest buffer when not."""
    plan.memory, plan.traced = memory, traced
    total = sum(memory.values())
    plan.fits = total <= profile.device_memory
    plan.overflow = None
    if not plan.fits:
        worst = max(memory, key=memory.get)
        plan.overflow = (
            f"{total / GiB:.1f} GiB > {profile.device_memory / GiB:.1f} GiB: {worst} "
            f"{memory[worst] / GiB:.1f} GiB is the largest buffer"
        )


def format_table(plans: list[Plan], top: int | None = None) -> str:
    rows = ["| # | plan | step (s) | bubble | memory/rank (GiB) | fits |", "|---|---|---|---|---|---|"]
    for i, p in enumerate(plans[:top] if top else plans, 1):
        mem = sum(p.memory.values()) / GiB
        how = "traced" if p.traced else "arithmetic"
        rows.append(
            f"| {i} | {p.key} | {p.step_time:.4g} | {p.breakdown.get('bubble_fraction', 0):.0%} | "
            f"{mem:.2f} ({how}) | {'yes' if p.fits else 'no: ' + (p.overflow or '')} |"
        )
    return "\n".join(rows)


def _lstsq(rows: list[list[float]], ys: list[float]) -> list[float]:
    a, b = torch.tensor(rows, dtype=torch.float64), torch.tensor(ys, dtype=torch.float64).unsqueeze(1)
    return [max(float(x), 0.0) for x in torch.linalg.lstsq(a, b).solution.squeeze(1)]


def _measure_layers(shapes, device) -> tuple[float, float, float, float]:
    """A decoder layer's forward + backward for each preset at two token counts: (seconds per FLOP, the fixed cost
    of the three passes, saved bytes per token per hidden unit, per intermediate unit)."""
    rows, ys, act_rows, act_ys = [], [], [], []
    for preset in shapes:
        config = llama_config(preset)
        config._attn_implementation = "sdpa"  # what the models built from the presets run
        d = _dims(config)
        layer = LlamaDecoderLayer(config, 0).to(device)
        rope = LlamaRotaryEmbedding(config).to(device)
        for batch, seq in ((1, 64), (4, 128)):
            x = torch.randn(batch, seq, d["h"], device=device)
            pos = torch.arange(seq, device=device).unsqueeze(0)
            mask = causal_mask(config, x)
            pe = rope(x, pos)

            def step():
                h = x.clone().requires_grad_(True)
                layer(h, attention_mask=mask, position_embeddings=pe, position_ids=pos).sum().backward()

            rows.append([3 * layer_flops(d, batch * seq, seq), 3.0])
            ys.append(median_seconds(step, barrier=True))
            with SavedTensorCounter(exclude=list(layer.parameters()))() as counter:
                out = layer(
                    x.clone().requires_grad_(True), attention_mask=mask, position_embeddings=pe, position_ids=pos
                )
            act_rows.append([batch * seq * d["h"], batch * seq * d["f"]])
            act_ys.append(counter.nbytes)
            del out
    return (*_lstsq(rows, ys), *_lstsq(act_rows, act_ys))


def _measure_collectives(world: int, device) -> tuple[float, float]:
    """All-gather / reduce-scatter / all-reduce at two sizes over the whole group and over pairs: (latency, seconds
    per byte moved per rank); zeros on one rank."""
    # collectives: moved bytes per rank, over the whole group and over pairs
    c_rows, c_ys = [], []
    if world > 1:
        groups = [(world, None)]
        if world >= 4:
            pairs = [dist.new_group([r, r + 1]) for r in range(0, world - 1, 2)]
            groups.append((2, pairs[dist.get_rank() // 2] if dist.get_rank() < 2 * len(pairs) else None))
        for n, group in groups:
            for numel in (1 << 16, 1 << 20):
                full = torch.randn(numel, device=device)
                part = torch.empty(numel // n, device=device)
                if group is None and n != world:
                    continue
                for _kind, fn, factor in (
                    ("all_gather", lambda: all_gather_single(full, part, group=group), (n - 1) / n),
                    ("reduce_scatter", lambda: reduce_scatter_single(part, full, group=group), (n - 1) / n),
                    ("all_reduce", lambda: dist.all_reduce(full, group=group), 2 * (n - 1) / n),
                ):
                    c_rows.append([1.0, factor * numel * 4])
                    c_ys.append(median_seconds(fn, barrier=True))
    return tuple(_lstsq(c_rows, c_ys)) if c_rows else (0.0, 0.0)


def _measure_tp_overhead(shape: str, world: int, device, latency: float, sec_per_byte: float) -> float:
    """What tensor parallelism over all ranks costs per layer beyond FLOPs / tp and the modeled collectives (0 where
    the shape does not split over the world)."""
    tp_overhead = 0.0
    config = llama_config(shape)
    if world > 1 and config.num_attention_heads % world == 0 and config.intermediate_size % world == 0:
        # a tensor-parallel model of 2 layers over all ranks against the same model whole, at the same tokens:
        # what TP costs beyond FLOPs / tp and the modeled collectives, per layer
        from torch.distributed.device_mesh import init_device_mesh

        from hf_dtrain.models import build_llama

        from .tensor import apply_tensor_parallel, tensor_parallel_loss

        d = _dims(config)
        batch, seq = 2, 64 * world
        ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)
        timings = []
        for tp in (1, world):
            model = build_llama(shape, num_hidden_layers=2).to(device)
            if tp > 1:
                apply_tensor_parallel(model, init_device_mesh(device.type, (world,), mesh_dim_names=("tp",)))

            def tp_step():
                with tensor_parallel_loss(model):
                    model(input_ids=ids, labels=ids).loss.backward()

            timings.append(median_seconds(tp_step, repeats=3, barrier=True))
        tokens = batch * seq
        act = tokens * d["h"] * 4
        colls = 4 * ((latency + (world - 1) / world * act * sec_per_byte) * 2)
        tp_overhead = max(0.0, (timings[1] - timings[0] / world) / 2 - colls)
    return tp_overhead


def measure_profile(
    shapes=("tiny", "small"),
    name: str = "measured",
    device_memory: float | None = None,
    ranks_per_node: int | None = None,
) -> MachineProfile:
    """Measure this machine's :class:`MachineProfile`, on every rank of the default process group at once (so
    the cores are shared as in training): a decoder layer's forward + backward for each preset in ``shapes`` at two
    token counts (fit: seconds per FLOP and a fixed cost per call), all-gather / reduce-scatter / all-reduce at two
    sizes over the whole group and over pairs (fit: latency and seconds per byte moved), an AdamW step per
    parameter and the bytes autograd saves per token of a layer. Timings are the slowest rank's medians."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    sec_per_flop, overhead_3, per_h, per_f = _measure_layers(shapes, device)
    latency, sec_per_byte = _measure_collectives(world, device)
    tp_overhead = _measure_tp_overhead(shapes[0], world, device, latency, sec_per_byte)
    params = [torch.nn.Parameter(torch.randn(1 << 20, device=device))]
    params[0].grad = torch.randn(1 << 20, device=device)
    opt = torch.optim.AdamW(params, lr=1e-3)
    t_opt = median_seconds(opt.step, barrier=True) / (1 << 20)
    values = torch.tensor(
        [sec_per_flop, overhead_3, latency, sec_per_byte, t_opt, tp_overhead], dtype=torch.float64, device=device
    )
    if dist.is_initialized():  # the slowest rank's figures: the step waits for it
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    sec_per_flop, overhead_3, latency, sec_per_byte, t_opt, tp_overhead = values.tolist()
    if device_memory is None and device.type == "cuda":
        device_memory = float(torch.cuda.get_device_properties(device).total_memory)
    if device_memory is None:  # host memory shared by this node's ranks
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        device_memory = total / max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    return MachineProfile(
        name=name,
        sec_per_flop=sec_per_flop,
        layer_overhead=overhead_3 / 3.0,
        coll_latency=latency,
        intra_sec_per_byte=sec_per_byte,
        inter_sec_per_byte=sec_per_byte,
        optim_sec_per_param=t_opt,
        activation_bytes_per_token={"hidden": per_h / 1.0, "intermediate": per_f / 1.0},
        overlap=0.0,
        device_memory=device_memory,
        tp_layer_overhead=tp_overhead,
        ranks_per_node=ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world)),
        compute_slots=None if device.type == "cuda" else float(len(os.sched_getaffinity(0))),
    )
