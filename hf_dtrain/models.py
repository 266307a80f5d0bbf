"""LLaMA-architecture model presets and the embedded default base model.

Nothing is downloaded at run time: the default base model is built from a ``LlamaConfig`` preset and briefly
pretrained on text every machine has (see :func:`build_default_model`). Real users pass ``--model PATH_OR_HUB_ID``
and the ordinary ``from_pretrained`` path is used.
"""

from __future__ import annotations

import glob
import hashlib
import inspect
import json
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import torch
from safetensors import safe_open
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm.auto import tqdm
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)
from transformers.masking_utils import create_causal_mask

from hf_dtrain.errors import ModelLoadError, SettingsError

# transformers 5.24 renamed create_causal_mask's ``past_key_values`` to ``cache``: the signature says which
_MASK_CACHE_KEYWORD = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"


def causal_mask(config, inputs_embeds: torch.Tensor):
    """transformers' causal mask for a whole sequence with no KV cache (what a decoder layer run by hand takes), on
    every transformers release hf_dtrain supports: None where SDPA's own causal flag does it. No positions are
    passed: a whole sequence's are 0..n-1, and given them transformers looks for packed sequences in their values,
    which it cannot read on fake tensors, so a memory trace built a mask (a float copy per layer call: 2 MiB at
    the tiny preset's pipeline stage) that the run does not."""
    return create_causal_mask(
        config=config,
        inputs_embeds=inputs_embeds,
        attention_mask=None,
        position_ids=None,
        **{_MASK_CACHE_KEYWORD: None},
    )


_SHAPE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "max_position_embeddings",
)


def _shape(*values, **extra) -> dict:
    """One row of :data:`PRESETS` as ``LlamaConfig`` keywords (the values in :data:`_SHAPE_KEYS`' order)."""
    return dict(zip(_SHAPE_KEYS, values, strict=True), **extra)


# Shapes. "test" is for unit tests (milliseconds per step); "tiny" is the embedded default base model; "small" is a
# larger CPU-trainable shape; "llama2-7b"/"llama2-70b"/"llama3-8b" are the real shapes for GPU users (never built in
# tests; benchmarks/scaling.py reads their parameter shapes from a meta-device model).
# fmt: off
PRESETS: dict[str, dict] = {
    #              hidden    ffn layers heads kv  vocab  positions
    "test":        _shape(   64,    128,   2,   4,   4,    128,   128),
    "tiny":        _shape(  256,    512,   4,   4,   4,   1024,   256),
    "small":       _shape(  512,   1536,   8,   8,   8,   4096,   512),
    # about 100M parameters (97.4M): the largest shape benchmarks/throughput.py trains on a 2-core CPU host
    "100m":        _shape(  768,   2048,  12,  12,  12,   8192,  1024),
    # Llama 3.2 1B's shape (1.24B parameters, its input and output embeddings tied as in the release)
    "llama3.2-1b": _shape( 2048,   8192,  16,  32,   8, 128256,  8192, rope_theta=500000.0, tie_word_embeddings=True),
    "llama2-7b":   _shape( 4096,  11008,  32,  32,  32,  32000,  4096),
    "llama2-70b":  _shape( 8192,  28672,  80,  64,   8,  32000,  4096),
    "llama3-8b":   _shape( 4096,  14336,  32,  32,   8, 128256,  8192, rope_theta=500000.0),
}
# fmt: on


def llama_config(preset: str = "tiny", **overrides) -> LlamaConfig:
    """A ``LlamaConfig`` for a named preset; keyword arguments override single fields."""
    if preset not in PRESETS:
        raise SettingsError(f"Unknown preset {preset!r}; choose one of {sorted(PRESETS)}.")
    kwargs = dict(PRESETS[preset])
    kwargs.setdefault("tie_word_embeddings", False)
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def build_llama(
    preset: str = "tiny", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides
) -> LlamaForCausalLM:
    """A randomly initialised ``LlamaForCausalLM`` of a preset shape, deterministic in ``seed``."""
    config = llama_config(preset, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(dtype)


# ----------------------------------------------------------------------------------------------------------------------
# The embedded default base model: a byte-level BPE tokenizer trained on the Python standard library's own source and
# a "tiny" LLaMA briefly pretrained on that text (plus a share of default-task examples), cached on disk.
# ----------------------------------------------------------------------------------------------------------------------


# Bump when the recipe below changes in a way that changes the produced model: old caches are then not reused.
BASE_BUILD_VERSION = 2
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")
# Default pretraining steps per preset (about 2-3 minutes on 2 CPU cores for "tiny").
DEFAULT_BASE_STEPS = {"test": 20, "tiny": 450, "small": 300}
# Number of actual (non-cached) builds in this process; tests use it to check the cache is reused.
build_count = 0


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Root of hf_dtrain's cache: ``cache_dir``, else ``$HF_DTRAIN_CACHE``, else ``~/.cache/hf_dtrain``."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("HF_DTRAIN_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "hf_dtrain"


def stdlib_source_files() -> list[Path]:
    """The standard library's own ``.py`` files, sorted (site-packages and the test suites excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    files = [p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def stdlib_text(max_bytes: int = 4_000_000) -> list[str]:
    """A deterministic capped subset of the stdlib's source, one string per file, about ``max_bytes`` in total."""
    docs, total = [], 0
    for path in stdlib_source_files():
        try:
            text = path.read_text(encoding="utf-8", errors="ignore")
        except OSError:
            continue
        if not text.strip():
            continue
        docs.append(text)
        total += len(text.encode("utf-8"))
        if total >= max_bytes:
            break
    return docs


def trained_vocab_size(preset: str) -> int:
    """The vocabulary a model of ``preset`` gets beside the tokenizer :func:`train_tokenizer` trains for it: the
    preset's, or the byte-level floor (256 bytes and the special tokens) where the preset's is smaller (the test
    preset's 128). What a pretraining job's model holds, known without training the tokenizer (its estimate)."""
    return max(PRESETS[preset]["vocab_size"], 256 + len(SPECIAL_TOKENS))


def train_tokenizer(texts, vocab_size: int):
    """A LLaMA-like byte-level BPE tokenizer (digits split individually) as ``PreTrainedTokenizerFast``.

    Adds ``<s>`` in front of every encoded text (like LLaMA); ``</s>`` is the eos and ``<pad>`` the pad token.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", model_max_length=1024
    )


# What a base build depends on besides the preset, steps and seed (keywords of build_default_model)
_BUILD_DEFAULTS = dict(seq_len=128, batch_size=16, data_bytes=4_000_000, task_share=0.25, lr=2e-3)


def _build_settings(preset: str, steps: int | None, seed: int, **kw) -> dict:
    """Everything a base build depends on (its cache key and the first part of its ``hf_dtrain_base.json``)."""
    if preset not in PRESETS:
        raise SettingsError(f"Unknown preset {preset!r}; choose one of {sorted(PRESETS)}.")
    unknown = set(kw) - set(_BUILD_DEFAULTS)
    if unknown:
        raise TypeError(f"unknown base-build settings {sorted(unknown)}; known: {sorted(_BUILD_DEFAULTS)}")
    return dict(
        build_version=BASE_BUILD_VERSION,
        preset=preset,
        model_config=PRESETS[preset],
        steps=DEFAULT_BASE_STEPS.get(preset, 300) if steps is None else int(steps),
        seed=seed,
        **{**_BUILD_DEFAULTS, **kw},
        python=f"{sys.version_info[0]}.{sys.version_info[1]}",
    )


def _model_dir(settings: dict, cache_dir) -> Path:
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    return cache_root(cache_dir) / "base" / f"{settings['preset']}-{digest}"


def default_model_dir(preset: str = "tiny", cache_dir=None, steps: int | None = None, seed: int = 0, **kw) -> Path:
    """Where :func:`build_default_model` caches (or would cache) the base model for these settings."""
    return _model_dir(_build_settings(preset, steps, seed, **kw), cache_dir)


def _pretrain_blocks(tokenizer, docs, task_texts, seq_len):
    """Token blocks of ``seq_len`` from the stdlib text (docs joined by eos) and, separately, from task examples."""
    eos = tokenizer.eos_token_id

    def pack(texts):
        ids = []
        for enc in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=True):
            ids.extend(enc.ids)
            ids.append(eos)
        n = len(ids) // seq_len
        return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)

    return pack(docs), pack(task_texts)


def is_tuner_layer(module) -> bool:
    """``module`` is a peft tuner layer (``BaseTunerLayer``: peft's LoRA, hf_dtrain's tuners). Without peft imported
    no module can be one, and peft (seconds of imports) is not imported to say so: the plain-model paths (pretrain,
    FSDP2 and TP on a full model) never load it."""
    utils = sys.modules.get("peft.tuners.tuners_utils")
    return utils is not None and isinstance(module, utils.BaseTunerLayer)


def build_default_model(
    preset: str = "tiny",
    cache_dir: str | os.PathLike | None = None,
    steps: int | None = None,
    seed: int = 0,
    progress: bool = True,
    *,
    seq_len: int = 128,
    batch_size: int = 16,
    data_bytes: int = 4_000_000,
    task_share: float = 0.25,
    lr: float = 2e-3,
) -> str:
    """Build (or reuse from cache) the embedded default base model; return its directory.

    The directory loads with ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``. Built once
    per settings: a byte-level BPE tokenizer trained on the stdlib's source, then ``steps`` AdamW steps of causal-LM
    pretraining of the ``preset`` LLaMA on that text, with a ``task_share`` of blocks made of default-task examples
    (see :mod:`hf_dtrain.tasks`). Written to a temporary directory and renamed, so a crash leaves no half cache.
    Cache root: ``cache_dir``, else ``$HF_DTRAIN_CACHE``, else ``~/.cache/hf_dtrain``.
    """
    global build_count

    kw = dict(seq_len=seq_len, batch_size=batch_size, data_bytes=data_bytes, task_share=task_share, lr=lr)
    settings = _build_settings(preset, steps, seed, **kw)
    final = _model_dir(settings, cache_dir)
    if (final / "hf_dtrain_base.json").is_file():
        return str(final)
    t0 = time.time()
    build_count += 1
    model, tokenizer, losses = _pretrain_base(settings, progress)
    info = dict(
        settings,
        vocab_size=model.config.vocab_size,
        final_loss=sum(losses[-20:]) / max(1, len(losses[-20:])),
        build_seconds=round(time.time() - t0, 1),
        n_params=sum(p.numel() for p in model.parameters()),
    )
    _save_base(final, model, tokenizer, info)
    return str(final)


def _pretrain_base(settings: dict, progress: bool):
    """The tokenizer trained and the preset's model pretrained as ``settings`` say: (model, tokenizer, losses)."""
    preset, steps, seed = settings["preset"], settings["steps"], settings["seed"]
    batch_size = settings["batch_size"]
    docs = stdlib_text(settings["data_bytes"])
    from hf_dtrain.tasks import pretraining_task_texts  # datasets, TRL and peft: only to build a base

    task_texts = pretraining_task_texts(n=20_000, seed=seed)
    tokenizer = train_tokenizer(docs + task_texts[:2000], vocab_size=PRESETS[preset]["vocab_size"])
    # Byte-level BPE needs 256 + 3 ids at least: presets with a smaller vocabulary grow to the tokenizer's size.
    model = build_llama(
        preset,
        seed=seed,
        vocab_size=max(trained_vocab_size(preset), len(tokenizer)),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    text_blocks, task_blocks = _pretrain_blocks(tokenizer, docs, task_texts, settings["seq_len"])

    g = torch.Generator().manual_seed(seed)
    n_task = round(batch_size * settings["task_share"]) if len(task_blocks) else 0
    opt = torch.optim.AdamW(model.parameters(), lr=settings["lr"], weight_decay=0.01, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * max(0.1, 1.0 - s / max(1, steps))
    )
    model.train()
    bar = tqdm(range(steps), desc=f"pretraining default base ({preset})", disable=not progress, leave=False)
    losses = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in bar:
            idx = torch.randint(0, len(text_blocks), (batch_size - n_task,), generator=g)
            parts = [text_blocks[idx]]
            if n_task:
                parts.append(task_blocks[torch.randint(0, len(task_blocks), (n_task,), generator=g)])
            batch = torch.cat(parts)
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            bar.set_postfix(loss=f"{loss.item():.3f}")
    bar.close()
    model.eval()
    return model, tokenizer, losses


def _save_base(final: Path, model, tokenizer, info: dict) -> None:
    """The model, the tokenizer and ``info`` written to a temporary sibling of ``final``, then renamed to it."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-{time.time_ns()}"
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        # Written last: its presence marks a complete directory.
        (tmp / "hf_dtrain_base.json").write_text(json.dumps(info, indent=2))
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "hf_dtrain_base.json").is_file():  # a half directory from elsewhere: replace it
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_weight_files(path: str) -> None:
    """Every ``*.safetensors`` file of a local model or adapter directory opens (its header parses and its data is
    all there): a ``ValueError`` naming the damaged file otherwise, instead of a loader error that names none."""
    if not os.path.isdir(path):
        return
    for name in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        try:
            with safe_open(name, framework="pt") as f:
                keys = list(f.keys())
                if keys:
                    f.get_slice(keys[-1])  # the last tensor's bytes lie within the file
        except Exception as e:  # SafetensorError, OSError: truncated, empty, not safetensors
            raise ModelLoadError(
                f"{name} is damaged or truncated ({type(e).__name__}: {e}); replace it (save the "
                "model or adapter again) or point --model elsewhere."
            ) from None


def base_model_path(
    model: str | None = None,
    gguf_file: str | None = None,
    preset: str = "tiny",
    steps: int | None = None,
    progress: bool = True,
) -> str:
    """What ``from_pretrained`` reads for a job's base model: ``model`` (a folder or hub id; a GGUF file, or a folder
    with ``gguf_file``, dequantized once into a cached folder: :mod:`hf_dtrain.checkpoints`), else the default base
    of ``preset``: a packaged real model (``smollm2-135m-instruct``), or a LLaMA preset built and pretrained here
    (:func:`build_default_model`, ``steps``)."""
    import hf_dtrain.checkpoints as checkpoints

    if model is not None:
        return checkpoints.resolve_model(model, gguf_file, progress=progress)
    if gguf_file:
        checkpoints.check_model_arg(model, gguf_file)
    if preset in checkpoints.PACKAGED:
        return checkpoints.gguf_to_folder(checkpoints.packaged_gguf(preset), progress=progress, flag="--base-preset")
    return build_default_model(preset, steps=steps, progress=progress)


def load_model_and_tokenizer(
    model: str | None = None,
    *,
    gguf_file: str | None = None,
    preset: str = "tiny",
    base_steps: int | None = None,
    progress: bool = True,
    load_model: bool = True,
    **from_pretrained_kwargs,
):
    """``(model, tokenizer)``: ``from_pretrained`` of ``model`` (a local path or a hub id; a GGUF file, or a folder and
    ``gguf_file``: read by transformers' GGUF loader, once, into a cached dense folder), else the default base of
    ``preset`` (:func:`base_model_path`); ``load_model=False`` gives ``(None, tokenizer)``. A tokenizer without pad
    token gets its eos as pad."""
    path = base_model_path(model, gguf_file, preset, base_steps, progress)
    check_model_dir(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            path, trust_remote_code=bool(from_pretrained_kwargs.get("trust_remote_code", False))
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(
            f"--model {path}: its tokenizer does not load ({type(e).__name__}: {_first_line(e)}); save the "
            "tokenizer beside the model (tokenizer.save_pretrained)."
        ) from e
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not load_model:
        return None, tokenizer
    try:
        lm = AutoModelForCausalLM.from_pretrained(path, **from_pretrained_kwargs)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(
            f"--model {path} does not load as a causal LM ({type(e).__name__}: {_first_line(e)}); check its "
            "config.json and weights, or save it again with save_pretrained."
        ) from e
    except RuntimeError as e:  # transformers' refusal of weights whose shapes are not its config's (only that)
        if "mismatched_sizes" not in str(e) and "size mismatch" not in str(e):
            raise
        raise ModelLoadError(
            f"--model {path}: its weights do not have the shapes its config.json gives (transformers: "
            f"{_first_line(e)}; its report above names the tensors); fix config.json to the checkpoint's model, or "
            "save the model again with save_pretrained."
        ) from e
    return lm, tokenizer


def _first_line(e: BaseException) -> str:
    return next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)[:300]


WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json", "pytorch_model.bin.index.json")


def check_model_dir(path: str) -> None:
    """A local model directory has a ``config.json`` that parses and builds a config, and weight files that open
    (:func:`check_weight_files`); a ``ModelLoadError`` naming the directory and what is missing otherwise. A hub id
    (no such directory) is left to ``from_pretrained``."""
    if not os.path.isdir(path):
        return
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise ModelLoadError(
            f"--model {path} holds no config.json: it is not a saved model directory (save_pretrained writes "
            "config.json and the weights)."
        )
    try:
        AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(
            f"--model {path}: config.json does not build a config ({type(e).__name__}: {_first_line(e)}); fix or "
            "replace it."
        ) from e
    if not any(glob.glob(os.path.join(path, p)) for p in WEIGHT_PATTERNS):
        raise ModelLoadError(
            f"--model {path} holds no weights (no model.safetensors or pytorch_model.bin): save the model with "
            "save_pretrained, or point --model at the directory that has them."
        )
    check_weight_files(path)


class LlamaPipelineStage(torch.nn.Module):
    """One stage of a LLaMA-family causal LM cut between decoder layers (a pipeline stage; the edge or the cloud part
    of split fine-tuning): its decoder layers (and the embedding on the first stage,
    the final norm and ``lm_head`` on the last), under the same attribute names as the whole model, so parameter
    names match it. Takes token ids (first stage) or hidden states, returns hidden states or logits (last)."""

    def __init__(self, causal_lm: torch.nn.Module, start: int, end: int, first: bool, last: bool):
        super().__init__()
        decoder = causal_lm.model
        self.config = causal_lm.config
        self._no_split_modules = list(getattr(causal_lm, "_no_split_modules", None) or [])  # FSDP2's units
        self.first, self.last = first, last
        self.model = torch.nn.Module()
        self.model.embed_tokens = decoder.embed_tokens if first else None
        self.model.layers = torch.nn.ModuleDict({str(i): decoder.layers[i] for i in range(start, end)})
        self.model.norm = decoder.norm if last else None
        self.model.rotary_emb = decoder.rotary_emb
        self.lm_head = causal_lm.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.model
        h = m.embed_tokens(x) if self.first else x
        # under sequence parallelism a later stage receives this rank's 1/tp of the sequence (apply_tensor_parallel
        # sets sequence_shards); the positions and the mask are the whole sequence's
        length = h.shape[1] if self.first else h.shape[1] * getattr(self, "sequence_shards", 1)
        whole = h[:, :1].expand(h.shape[0], length, h.shape[-1])
        positions = torch.arange(length, device=h.device).unsqueeze(0)
        mask = causal_mask(self.config, whole)
        rope = m.rotary_emb(whole, position_ids=positions)
        for layer in m.layers.values():
            h = layer(h, attention_mask=mask, position_embeddings=rope, position_ids=positions)
        if self.last:
            h = self.lm_head(m.norm(h))
        return h
