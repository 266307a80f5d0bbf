"""Turning K jobs into one fused model, and back.

* :func:`fuse_adapters`: a ``PeftModel`` that holds one adapter per job (``peft_model.add_adapter(name, config)``,
  each job's own rank, alpha, seed) becomes one model whose tuner layers are fused modules
  (:mod:`hf_dtrain.fused.layers`): the frozen base runs once for all jobs. :meth:`FusedAdapters.unfuse` copies every
  job's trained values back into its peft adapter and puts peft's layers back, so ``save_pretrained`` writes standard
  peft adapter directories.
* :func:`fuse_models`: K copies of a LLaMA-family model (one per job, each its own init) stacked with
  ``torch.func.stack_module_state`` into one model of fused linears, embeddings and norms; :meth:`FusedModels.unfuse`
  gives back K ordinary models.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import stack_module_state

from hf_dtrain.errors import SettingsError
from hf_dtrain.models import is_tuner_layer
from hf_dtrain.tuners.finetune_method import BlockSparseForm, fused_form_of

from .layers import FusedBlockSparse, FusedEmbedding, FusedLinear, FusedLowRank, FusedRMSNorm


def _set_child(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, attr, module)


def _pad_to(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    if t.shape[dim] == size:
        return t
    shape = list(t.shape)
    shape[dim] = size - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def _fuse_layer(layer, names: list[str], form) -> nn.Module:
    """The fused module of ``layer``'s adapters ``names``, by the form their method registered."""
    if form.check is not None:
        form.check(layer, names)
    base = layer.get_base_layer()
    if isinstance(form, BlockSparseForm):
        parts = [form.blocks(layer, n) for n in names]
        bs = parts[0][2]
        indices = [p[0] for p in parts]
        m = max(1, max(len(i) for i in indices))
        w = base.weight
        dtype = w.dtype if w.dtype.is_floating_point else torch.float32
        blocks = torch.zeros(len(names), m, bs, bs, dtype=dtype, device=w.device)
        for k, (idx, weight, _) in enumerate(parts):
            if weight is not None:
                blocks[k, : len(idx)] = weight.detach()
        return FusedBlockSparse(base, blocks, indices, layer.in_features, layer.out_features, delta=form.delta())
    factors = [form.factors(layer, n) for n in names]
    a = [f[0].detach() for f in factors]
    b = [f[1].detach() for f in factors]
    drop = [form.dropout(layer, n) for n in names]
    pool = form.pool(layer, names[0])
    r = max(t.shape[0] for t in a)
    a = torch.stack([_pad_to(t, 0, r) for t in a]).clone()
    b = torch.stack([_pad_to(t, 1, r) for t in b]).clone()
    scaling = [float(layer.scaling[n]) for n in names]
    return FusedLowRank(base, a, b, scaling, drop, pool=pool, a_trainable=form.a_trainable)


class FusedAdapters:
    """K adapters of one ``PeftModel`` trained as one model. ``model`` is the transformers model to call with the
    K jobs' stacked batch; :meth:`parameters` are the fused trainable tensors (leading dim K)."""

    def __init__(self, peft_model, names: list[str]) -> None:
        self.peft_model, self.names = peft_model, list(names)
        self.model = peft_model.get_base_model()
        self.layers: dict[str, tuple[nn.Module, nn.Module]] = {}  # module name -> (peft layer, fused layer)
        self.unfused = False
        types = {
            str(getattr(peft_model.peft_config[n].peft_type, "value", peft_model.peft_config[n].peft_type))
            for n in self.names
        }
        if len(types) > 1:
            raise SettingsError(f"fuse_adapters: the adapters {self.names} are of different types {sorted(types)}.")
        self.form = fused_form_of(types.pop())  # how their method trains them fused (or why it cannot)

        targets = [(n, m) for n, m in self.model.named_modules() if is_tuner_layer(m)]
        if not targets:
            raise SettingsError("fuse_adapters found no peft tuner layer; build the model with get_peft_model first.")
        for name, layer in targets:
            have = [n for n in self.names if n in _adapters_of(layer)]
            if len(have) != len(self.names):
                raise SettingsError(
                    f"layer {name!r} holds adapters {sorted(_adapters_of(layer))}, not all of "
                    f"{self.names}: fused jobs need the same target modules."
                )
            fused = _fuse_layer(layer, self.names, self.form)
            self.layers[name] = (layer, fused)
            _set_child(self.model, name, fused)
        # anything else trainable (modules_to_save) is not fused
        for n, p in self.model.named_parameters():
            if p.requires_grad and not any(n.startswith(t + ".") for t in self.layers):
                raise SettingsError(
                    f"parameter {n!r} is trainable but is not a fused adapter (modules_to_save is not "
                    "supported fused); freeze it or leave modules_to_save unset."
                )

    @property
    def num_jobs(self) -> int:
        return len(self.names)

    def parameters(self) -> list[torch.Tensor]:
        return [p for _, f in self.layers.values() for p in f.parameters() if p.requires_grad]

    def named_parameters(self):
        return [
            (f"{n}.{pn}", p) for n, (_, f) in self.layers.items() for pn, p in f.named_parameters() if p.requires_grad
        ]

    @torch.no_grad()
    def write_back(self, jobs=None) -> None:
        """Copy the fused values of ``jobs`` (indices; default all) into their peft adapters."""
        jobs = range(self.num_jobs) if jobs is None else jobs
        for layer, fused in self.layers.values():
            for k in jobs:
                n = self.names[k]
                if isinstance(self.form, BlockSparseForm):
                    self.form.write_back(layer, n, fused.smt_weight[k, : fused.counts[k]])
                    continue
                a, b = self.form.factors(layer, n)
                r = a.shape[0]
                a.copy_(fused.lora_A[k, :r])
                b.copy_(fused.lora_B[k, :, :r])

    def unfuse(self):
        """Write every job back and restore peft's layers; returns the ``PeftModel`` (a second call does nothing)."""
        if self.unfused:
            return self.peft_model
        self.unfused = True
        self.write_back()
        for name, (layer, _) in self.layers.items():
            _set_child(self.model, name, layer)
        return self.peft_model


def _adapters_of(layer) -> set[str]:
    out = set()
    for attr in layer.adapter_layer_names + tuple(getattr(layer, "other_param_names", ())):
        d = getattr(layer, attr, None)
        if hasattr(d, "keys"):  # the per-adapter dicts (ModuleDict, ParameterDict, BufferDict, dict)
            out |= set(d.keys())
    return out


def fuse_adapters(peft_model, names: list[str]) -> FusedAdapters:
    """Fuse the adapters ``names`` of ``peft_model`` (one per job) in place; see :class:`FusedAdapters`."""
    return FusedAdapters(peft_model, names)


# ---------------------------------------------------------------------------------------------------------------------
# fused full models
# ---------------------------------------------------------------------------------------------------------------------


def _is_rmsnorm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")


class FusedModels:
    """K copies of one model architecture trained as one: ``model`` is the first copy with every linear, embedding
    and RMSNorm replaced by its fused form holding all K copies' weights (stacked by
    ``torch.func.stack_module_state``)."""

    def __init__(self, models: list[nn.Module]) -> None:
        if len(models) < 1:
            raise SettingsError("fuse_models needs at least one model.")
        configs = {
            m.config.to_json_string(use_diff=False) if hasattr(m, "config") else type(m).__name__ for m in models
        }
        if len(configs) > 1:
            raise SettingsError(
                "fuse_models: the models differ in architecture (their configs differ); only copies of "
                "one architecture fuse. Split the sweep by model."
            )
        self.num_jobs = len(models)
        self.config = getattr(models[0], "config", None)
        params, _ = stack_module_state(models)  # name -> (K, ...) stacked, detached leaves
        self.model = models[0]
        self.tied = bool(getattr(self.config, "tie_word_embeddings", False))
        fused_names = []
        for name, mod in list(self.model.named_modules()):
            if isinstance(mod, nn.Linear):
                if self.tied and name.endswith("lm_head"):
                    continue
                bias = params.get(f"{name}.bias")
                fused = FusedLinear(
                    params[f"{name}.weight"].detach().clone(), None if bias is None else bias.detach().clone()
                )
            elif isinstance(mod, nn.Embedding):
                fused = FusedEmbedding(params[f"{name}.weight"].detach().clone(), mod.padding_idx)
            elif _is_rmsnorm(mod):
                fused = FusedRMSNorm(params[f"{name}.weight"].detach().clone(), mod.variance_epsilon)
            else:
                own = [n for n, _ in mod.named_parameters(recurse=False)]
                if own:
                    raise SettingsError(
                        f"fuse_models: module {name!r} ({type(mod).__name__}) has parameters {own} and no "
                        "fused form (linear, embedding and RMSNorm fuse)."
                    )
                continue
            _set_child(self.model, name, fused)
            fused_names.append(name)
        if self.tied:  # the head reads the (fused) input embedding
            emb = self.model.get_input_embeddings()
            head = FusedLinear(emb.weight.detach(), None)
            head.weight = emb.weight
            _set_child(self.model, "lm_head", head)
        self.fused_names = fused_names

    def parameters(self) -> list[torch.Tensor]:
        seen, out = set(), []
        for p in self.model.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out

    def named_parameters(self):
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def state_dict_of(self, k: int) -> dict[str, torch.Tensor]:
        """Job ``k``'s weights under the original model's parameter names."""
        out = {}
        for name in self.fused_names:
            fused = self.model.get_submodule(name)
            for pn, p in fused.named_parameters(recurse=False):
                out[f"{name}.{pn}"] = p.detach()[k].clone()
        if self.tied:
            out["lm_head.weight"] = out[f"{self._emb_name()}.weight"]
        return out

    def _emb_name(self) -> str:
        emb = self.model.get_input_embeddings()
        return next(n for n, m in self.model.named_modules() if m is emb)

    def export(self, k: int, model: nn.Module) -> nn.Module:
        """Load job ``k``'s weights into ``model`` (an unfused copy of the architecture) and return it."""
        missing, unexpected = model.load_state_dict(self.state_dict_of(k), strict=False)
        missing = [n for n in missing if not n.endswith(("inv_freq", "lm_head.weight"))]
        if missing or unexpected:
            raise RuntimeError(f"export of job {k}: missing {missing}, unexpected {unexpected}")
        return model


def fuse_models(models: list[nn.Module]) -> FusedModels:
    """Fuse K copies of one architecture (each job's own init); see :class:`FusedModels`. ``models[0]`` is changed in
    place and becomes the fused model."""
    return FusedModels(models)
