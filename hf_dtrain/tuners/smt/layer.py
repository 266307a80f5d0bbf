from __future__ import annotations

import math
import warnings

import torch
from peft.tuners._buffer_dict import BufferDict
from peft.tuners.tuners_utils import BaseTunerLayer, _get_in_out_features
from torch import nn

from hf_dtrain.errors import SettingsError, UnsupportedTarget

from ...fast import paths as fast_paths
from ...fast.lowrank import frozen_linear
from .._base import MergeableLinearMixin, random_start
from .._registry import register_folder


def _compute_dtype(x: torch.Tensor, blocks: torch.Tensor) -> torch.dtype:
    """The dtype the products run in: autocast's where it is on (as a ``Linear`` would), else the blocks'."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else blocks.dtype


def _block_products(x2: torch.Tensor, blocks: torch.Tensor, ucols: torch.Tensor, pos: torch.Tensor):
    """``(xs, y_blocks)`` for the 2-D input ``x2`` (already in the compute dtype): ``xs`` the input column blocks the
    selection reads, ``(n, u, b)``, one contiguous copy (what backward keeps), and ``y_blocks[:, k] = x[:, cols_k] @
    blocks[k].T``, ``(n, k, b)``."""
    n, bs = x2.shape[0], blocks.shape[-1]
    xs = x2.view(n, -1, bs).index_select(1, ucols)
    return xs, torch.einsum("nkb,kob->nko", xs[:, pos], blocks.to(x2.dtype))


def _block_gradients(
    g: torch.Tensor,
    xs: torch.Tensor,
    blocks: torch.Tensor,
    rows: torch.Tensor,
    pos: torch.Tensor,
    need_blocks: bool,
    need_input: bool,
):
    """``(grad_blocks, gx_u)`` for the 2-D output gradient ``g`` (in the compute dtype): the blocks' gradients in
    their own dtype, and the input gradient of the column blocks ``xs`` holds, ``(n, u, b)``, in ``g``'s dtype."""
    n, bs = g.shape[0], blocks.shape[-1]
    g_k = g.view(n, -1, bs).index_select(1, rows)  # (n, k, b)
    grad_blocks = gx_u = None
    if need_blocks:
        grad_blocks = torch.einsum("nko,nkb->kob", g_k, xs[:, pos]).to(blocks.dtype)
    if need_input:
        gx_k = torch.einsum("nko,kob->nkb", g_k, blocks.to(g.dtype))
        gx_u = g.new_zeros(n, xs.shape[1], bs).index_add_(1, pos, gx_k)
    return grad_blocks, gx_u


class BlockSparseDelta(torch.autograd.Function):
    """``y = x @ D.T`` for a block-sparse ``D`` whose nonzero blocks are ``blocks[k]`` at block position
    ``(rows[k], cols[k])``; ``y`` has ``out_features`` columns.

    For backward it saves only the input column slices the selected blocks read, as one contiguous copy
    (``index_select``), never a view of ``x``: a view would pin the whole input, which is what the official SMT code
    does. Block gradients are ``sum_tokens grad_y[:, rows_k]^T x[:, cols_k]``: exactly the matching blocks of the
    dense weight gradient.

    Under ``torch.autocast`` the products run in the autocast dtype (bf16 / fp16), as a ``Linear`` would, and the
    output has that dtype; the block gradients are returned in the parameters' own dtype (fp32 master blocks).
    """

    @staticmethod
    def forward(ctx, x, blocks, rows, cols, out_features, col_map=None):
        """``col_map``: optional precomputed ``torch.unique(cols, return_inverse=True)`` (layers cache it, since
        ``unique`` synchronises a CUDA device)."""
        bs = blocks.shape[-1]
        compute = _compute_dtype(x, blocks)
        x2 = x.reshape(-1, x.shape[-1]).to(compute)
        ucols, pos = col_map if col_map is not None else torch.unique(cols, return_inverse=True)
        with torch.autocast(x.device.type, enabled=False):  # the dtypes are chosen here, once
            xs, y_blocks = _block_products(x2, blocks, ucols, pos)
        out = y_blocks.new_zeros(x2.shape[0], out_features // bs, bs).index_add_(1, rows, y_blocks)
        ctx.save_for_backward(xs, blocks, rows, pos, ucols)
        ctx.in_features = x.shape[-1]
        ctx.x_dtype, ctx.compute = x.dtype, compute
        return out.view(*x.shape[:-1], out_features)

    @staticmethod
    def backward(ctx, grad_out):
        xs, blocks, rows, pos, ucols = ctx.saved_tensors
        bs = blocks.shape[-1]
        g = grad_out.reshape(-1, grad_out.shape[-1]).to(ctx.compute)
        grad_blocks, gx_u = _block_gradients(g, xs, blocks, rows, pos, ctx.needs_input_grad[1], ctx.needs_input_grad[0])
        grad_x = None
        if gx_u is not None:
            grad_x = g.new_zeros(g.shape[0], ctx.in_features // bs, bs).index_add_(1, ucols, gx_u)
            grad_x = grad_x.view(*grad_out.shape[:-1], ctx.in_features).to(ctx.x_dtype)
        return grad_x, grad_blocks, None, None, None, None


class BlockSparseLinear(torch.autograd.Function):
    """``y = x @ W.T + bias + x @ D.T`` for a frozen ``W`` (a plain ``nn.Linear``'s) and the block-sparse ``D`` of
    :class:`BlockSparseDelta`, in one function: the delta's blocks are added into the base product's output, and in
    backward the blocks' input gradient is added into the base's, in place. The separate path allocates a full-size
    zero output and a full-size zero input gradient per layer and adds each to the base's: four passes over whole
    activations that cost memory bandwidth and kernel launches.

    The results equal the separate path's bit for bit: the output rows get the same per-row sums of block products
    added to the base output in the compute dtype, and the input gradient gets the blocks' part in the input's dtype,
    as autograd's accumulation of the two paths would. ``row_map`` / ``col_map``: ``torch.unique(rows | cols,
    return_inverse=True)``, precomputed by the layer (``unique`` synchronises a CUDA device).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, blocks, rows, row_map, col_map, out_features):
        bs = blocks.shape[-1]
        compute = _compute_dtype(x, blocks)
        (urows, rpos), (ucols, cpos) = row_map, col_map
        # the casts autocast would make for the base layer's product, made once and shared with the blocks
        xc, w = x.to(compute), weight.to(compute)
        with torch.autocast(x.device.type, enabled=False):
            y = torch.nn.functional.linear(xc, w, None if bias is None else bias.to(compute))
            xs, y_blocks = _block_products(xc.reshape(-1, x.shape[-1]), blocks, ucols, cpos)
            n = xs.shape[0]
            y_rows = y_blocks.new_zeros(n, urows.numel(), bs).index_add_(1, rpos, y_blocks)
            y.view(n, -1, bs).index_add_(1, urows, y_rows.to(y.dtype))
        # the weight itself (a parameter: no memory of its own), cast again in backward, never the cast copy
        ctx.save_for_backward(xs, weight, blocks, rows, cpos, ucols)
        ctx.x_dtype, ctx.compute = x.dtype, compute
        return y.view(*x.shape[:-1], out_features)

    @staticmethod
    def backward(ctx, grad_out):
        xs, weight, blocks, rows, cpos, ucols = ctx.saved_tensors
        bs = blocks.shape[-1]
        g = grad_out.reshape(-1, grad_out.shape[-1]).to(ctx.compute)
        grad_blocks, gx_u = _block_gradients(
            g, xs, blocks, rows, cpos, ctx.needs_input_grad[3], ctx.needs_input_grad[0]
        )
        grad_x = None
        if gx_u is not None:
            grad_x = (g @ weight.to(ctx.compute)).to(ctx.x_dtype)  # the base's input gradient, as a Linear's gives it
            grad_x.view(g.shape[0], -1, bs).index_add_(1, ucols, gx_u.to(ctx.x_dtype))
            grad_x = grad_x.view(*grad_out.shape[:-1], grad_x.shape[-1])
        return grad_x, None, None, grad_blocks, None, None, None, None


class _GradientProbe(torch.autograd.Function):
    """Warm-up scoring: returns zeros shaped like the layer output, and in backward adds the dense weight gradient
    ``grad_y^T x`` into ``accumulator`` (fp32) without touching the weight. ``anchor`` is a scalar that requires grad,
    so the probe's backward runs even when neither ``x`` nor any parameter requires grad (a frozen base model)."""

    @staticmethod
    def forward(ctx, x, anchor, accumulator):
        ctx.save_for_backward(x)
        ctx.accumulator = accumulator
        return x.new_zeros(*x.shape[:-1], accumulator.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        g = grad_out.reshape(-1, grad_out.shape[-1]).float()
        ctx.accumulator.addmm_(g.t(), x.reshape(-1, x.shape[-1]).float())
        return None, torch.zeros((), device=grad_out.device), None


_WARNED = []


def _warn_unselected() -> None:
    """Training an SMT adapter whose blocks were never selected changes nothing: say so, once per process."""
    if not _WARNED:
        _WARNED.append(True)
        warnings.warn(
            "SMT is training with no blocks selected and no warm-up scoring running, so nothing is "
            "trained. Add SMTSelectionCallback() to the Trainer's callbacks (TRL: SFTTrainer(..., "
            "callbacks=[SMTSelectionCallback()])), call smt_warmup before training, or set "
            "SMTConfig.block_indices.",
            UserWarning,
            stacklevel=3,
        )


class SMTLayer(BaseTunerLayer):
    """SMT adapter state per adapter name: ``smt_weight`` (k, b, b) trainable delta blocks stacked in one parameter,
    ``smt_indices`` (k, 2) persistent buffer of (row_block, col_block). A target that got no block holds no
    parameter at all (empty parameters break FSDP2's reduce-scatter and ZeRO-3's gathering)."""

    adapter_layer_names = ("smt_weight",)
    other_param_names = (
        "smt_indices",
        "smt_col_ids",
        "smt_col_pos",
        "smt_row_ids",
        "smt_row_pos",
        "block_size",
        "smt_layer_key",
    )

    def __init__(self, base_layer: nn.Module, **kwargs) -> None:
        self.base_layer = base_layer
        self.block_size: dict[str, int] = {}
        self.smt_layer_key: dict[str, str] = {}
        self._smt_random_start: dict[str, bool] = {}
        self._smt_unselected: dict[str, bool] = {}
        # whether peft wants the adapter trained, for the blocks a later selection installs
        self._smt_wants_grad: dict[str, bool] = {}
        self.smt_weight = nn.ParameterDict({})
        self.smt_indices = BufferDict({}, persistent=True)
        # unique input-column blocks of the selection and each block's position among them (derived, not saved)
        self.smt_col_ids = BufferDict({}, persistent=False)
        self.smt_col_pos = BufferDict({}, persistent=False)
        self.smt_row_ids = BufferDict({}, persistent=False)  # likewise for the output-row blocks
        self.smt_row_pos = BufferDict({}, persistent=False)
        self._smt_grad_sum: dict[str, torch.Tensor] = {}  # warm-up accumulators, never saved
        self._disable_adapters = False
        self.merged_adapters = []
        self.in_features, self.out_features = _get_in_out_features(self.get_base_layer())
        if self.in_features is None:
            raise UnsupportedTarget(f"SMT supports nn.Linear targets only, got {type(self.get_base_layer()).__name__}.")
        self.kwargs = kwargs

    def update_layer(self, adapter_name: str, config, layer_key: str = "", inference_mode: bool = False) -> None:
        bs = config.block_size
        if self.in_features % bs or self.out_features % bs:
            raise SettingsError(
                f"SMTConfig.block_size={bs} does not divide the shape (out={self.out_features}, in={self.in_features}) "
                f"of target {layer_key!r}; choose a block_size that divides both (e.g. "
                f"{_largest_common_block(self.out_features, self.in_features, bs)}) or exclude this module."
            )
        self.block_size[adapter_name] = bs
        self.smt_layer_key[adapter_name] = layer_key
        self._smt_random_start[adapter_name] = config.init_weights is False
        pairs = (config.block_indices or {}).get(layer_key, [])
        self.set_block_indices(adapter_name, torch.tensor(pairs, dtype=torch.long, device="cpu").reshape(-1, 2))
        self._smt_unselected[adapter_name] = config.block_indices is None  # cleared when a selection installs blocks
        self.set_adapter(self.active_adapters, inference_mode=inference_mode)

    def set_block_indices(self, adapter_name: str, indices: torch.Tensor) -> nn.Parameter:
        """Install the (k, 2) block indices for ``adapter_name`` with zero delta blocks; return the new parameter."""
        bs = self.block_size[adapter_name]
        self._smt_unselected[adapter_name] = False
        # checked and sorted on the host (also when the model is built under torch.device("meta"))
        indices = torch.as_tensor(indices, dtype=torch.long, device="cpu").reshape(-1, 2)
        n_rows, n_cols = self.out_features // bs, self.in_features // bs
        if len(indices) and (indices[:, 0].max() >= n_rows or indices[:, 1].max() >= n_cols or indices.min() < 0):
            raise SettingsError(
                f"SMT block indices for {self.smt_layer_key.get(adapter_name)!r} are out of range: the layer has "
                f"{n_rows} x {n_cols} blocks of size {bs}."
            )
        if len(torch.unique(indices, dim=0)) != len(indices):
            raise SettingsError(f"SMT block indices for {self.smt_layer_key.get(adapter_name)!r} contain duplicates.")
        # Sort by (row, col) so the layout is canonical whatever order the selection produced.
        if len(indices):
            order = torch.argsort(indices[:, 0] * n_cols + indices[:, 1])
            indices = indices[order]
        weight = self.get_base_layer().weight
        dtype = weight.dtype if weight.dtype.is_floating_point else torch.float32
        param = None
        if len(indices):
            param = nn.Parameter(
                torch.zeros(len(indices), bs, bs, device=weight.device, dtype=dtype),
                requires_grad=self._smt_wants_grad.get(adapter_name, True),
            )
            self.smt_weight[adapter_name] = param
            if self._smt_random_start.get(adapter_name):  # init_weights=False: blocks installed later start random
                random_start(self, adapter_name)
        elif adapter_name in self.smt_weight:
            del self.smt_weight[adapter_name]
        self.smt_indices[adapter_name] = indices.to(weight.device)
        col_ids, col_pos = torch.unique(indices[:, 1], return_inverse=True)
        self.smt_col_ids[adapter_name] = col_ids.to(weight.device)
        self.smt_col_pos[adapter_name] = col_pos.to(weight.device)
        row_ids, row_pos = torch.unique(indices[:, 0], return_inverse=True)
        self.smt_row_ids[adapter_name] = row_ids.to(weight.device)
        self.smt_row_pos[adapter_name] = row_pos.to(weight.device)
        return param

    def set_adapter(self, adapter_names, inference_mode: bool = False) -> None:
        super().set_adapter(adapter_names, inference_mode=inference_mode)  # peft sets requires_grad on the blocks
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        for name in self.block_size:  # remembered for blocks a later selection installs
            self._smt_wants_grad[name] = name in names and not inference_mode

    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        bs = self.block_size[adapter]
        if adapter not in self.smt_weight:  # no block selected here
            weight = self.get_base_layer().weight
            dtype = weight.dtype if weight.dtype.is_floating_point else torch.float32
            return torch.zeros(self.out_features, self.in_features, dtype=dtype, device=weight.device)
        blocks = self.smt_weight[adapter]
        idx = self.smt_indices[adapter]
        delta = torch.zeros(
            self.out_features // bs, self.in_features // bs, bs, bs, dtype=blocks.dtype, device=blocks.device
        )
        delta[idx[:, 0], idx[:, 1]] = blocks
        return delta.permute(0, 2, 1, 3).reshape(self.out_features, self.in_features)

    # --- warm-up scoring -----------------------------------------------------------------------------------------
    def start_scoring(self, adapter_name: str) -> None:
        weight = self.get_base_layer().weight
        self._smt_grad_sum[adapter_name] = torch.zeros(
            self.out_features, self.in_features, dtype=torch.float32, device=weight.device
        )

    def stop_scoring(self, adapter_name: str) -> torch.Tensor | None:
        return self._smt_grad_sum.pop(adapter_name, None)

    def block_scores(self, adapter_name: str, score: str) -> torch.Tensor:
        """Per-block scores (n_row_blocks, n_col_blocks) from the gradient summed during the warm-up."""
        g = self._smt_grad_sum[adapter_name]
        bs = self.block_size[adapter_name]
        g = g.view(self.out_features // bs, bs, self.in_features // bs, bs)
        if score == "abs_mean":
            return g.abs().mean(dim=(1, 3))
        if score == "mean_abs":
            return g.mean(dim=(1, 3)).abs()
        if score == "l1":
            return g.abs().sum(dim=(1, 3))
        if score == "l2":
            return g.pow(2).sum(dim=(1, 3)).sqrt()
        raise SettingsError(f"Unknown SMT score {score!r}.")


def _largest_common_block(a: int, b: int, upper: int) -> int:
    g = math.gcd(a, b)
    return max(d for d in range(1, min(g, upper) + 1) if g % d == 0)


class Linear(MergeableLinearMixin, nn.Module, SMTLayer):
    """An ``nn.Linear`` with SMT adapters: ``y = W x + b + D x`` with ``D`` block-sparse and trainable."""

    # under torch.compile on a dense base the plain path: inductor fused its ops into a faster layer than the lean
    # function on CPU (per layer, bf16 autocast, 1,024 tokens, 768 -> 2048: 24.9 ms against 30.9); on a 4-bit
    # base the lean path stays (docs/fast.md; hf_dtrain.fast.paths.lean_when_compiled)
    compiled_plain_on_dense_base = True

    def __init__(self, base_layer: nn.Module, adapter_name: str, config, layer_key: str = "", **kwargs) -> None:
        super().__init__()
        SMTLayer.__init__(self, base_layer, **kwargs)
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, config, layer_key=layer_key)

    def _has_adapter(self, adapter: str) -> bool:
        return adapter in self.block_size  # also a target with no block (it holds no parameter)

    def _apply_delta(self, weight: torch.Tensor, name: str, sign: float) -> torch.Tensor:
        """Add (sign=+1) or subtract the delta blocks in place: only the selected blocks of W are written."""
        w = weight
        if name not in self.smt_weight:  # no block selected here
            return w
        bs = self.block_size[name]
        view = w.view(self.out_features // bs, bs, self.in_features // bs, bs)
        blocks = self.smt_weight[name].data.to(w.dtype)
        for (r, c), blk in zip(self.smt_indices[name].tolist(), blocks):
            view[r, :, c, :] += sign * blk
        return w

    def _fusable(self, x: torch.Tensor, args, kwargs) -> tuple[str | None, str]:
        """``(adapter, "lean")`` when the adapter's blocks can run inside the base product
        (:class:`BlockSparseLinear`), else ``(None, reason)`` where the separate path must run: the switch, several
        adapters, warm-up scoring, a base that is not a plain frozen ``nn.Linear`` of plain tensors (a quantized,
        tensor-parallel or hooked layer, e.g. ZeRO-3's parameter gathering), or dtypes the fused product would round
        differently."""
        reason = fast_paths.adapter_reason(self, args, kwargs, list(self.smt_weight.values()))
        if reason is not None:
            return None, reason
        name = self.active_adapters[0]
        if name in self._smt_grad_sum:
            return None, "warm-up scoring"
        if name not in self.smt_weight and self._smt_unselected.get(name, True):
            return None, "no blocks selected yet"
        reason = fast_paths.dense_base_reason(self.base_layer)
        if reason is not None:
            return None, reason
        weight = self.base_layer.weight
        blocks = self.smt_weight.get(name, weight)  # no block here: the base alone
        if not torch.is_autocast_enabled(x.device.type) and not x.dtype == weight.dtype == blocks.dtype:
            return None, "input, base and blocks in different dtypes"
        return name, fast_paths.LEAN

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        name, path = self._fusable(x, args, kwargs)
        fast_paths.record(self, path)
        if name is None:
            return self._plain_forward(x, *args, **kwargs)
        base = self.base_layer
        if name not in self.smt_weight:  # selection left this target without a block: the frozen base alone
            return frozen_linear(x, base.weight, base.bias)
        idx = self.smt_indices[name]
        return BlockSparseLinear.apply(
            x,
            base.weight,
            base.bias,
            self.smt_weight[name],
            idx[:, 0],
            (self.smt_row_ids[name], self.smt_row_pos[name]),
            (self.smt_col_ids[name], self.smt_col_pos[name]),
            self.out_features,
        )

    def _adapter_output(self, x: torch.Tensor, name: str) -> torch.Tensor | None:
        out = None
        if name in self._smt_grad_sum and torch.is_grad_enabled():  # warm-up: sum the dense gradient
            anchor = torch.zeros((), device=x.device, requires_grad=True)
            out = _GradientProbe.apply(x, anchor, self._smt_grad_sum[name])
        if name in self.smt_weight:
            blocks = self.smt_weight[name]
            idx = self.smt_indices[name]
            col_map = (self.smt_col_ids[name], self.smt_col_pos[name])
            delta = BlockSparseDelta.apply(x, blocks, idx[:, 0], idx[:, 1], self.out_features, col_map)
            out = delta if out is None else out + delta
        elif self._smt_unselected.get(name) and name not in self._smt_grad_sum and torch.is_grad_enabled():
            _warn_unselected()
        return out

    def __repr__(self) -> str:
        return "smt." + super().__repr__()


register_folder(__name__)
