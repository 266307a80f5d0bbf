"""Test and benchmark helpers: the tiny LLaMA, random batches, saved-tensor byte counting, short training loops."""

from __future__ import annotations

import shutil
import time

import torch
from transformers import AutoTokenizer

from hf_dtrain.distributed.counters import SavedTensorCounter  # noqa: F401  (re-exported for the tests)
from hf_dtrain.models import build_default_model, build_llama

from .batches import random_batch


def tiny_llama(seed: int = 0, **overrides):
    """The "test" preset LLaMA (2 layers, hidden 64, vocab 128): a few milliseconds per step on CPU."""
    return build_llama("test", seed=seed, **overrides)


def tiny_default_base(cache_dir, steps: int = 200, seed: int = 0) -> str:
    """The embedded default base model built at test size: "test" preset, a 300 kB slice of the stdlib, ``steps``
    pretraining steps (seconds on CPU), cached under ``cache_dir``."""
    return build_default_model(
        "test",
        cache_dir=cache_dir,
        steps=steps,
        seed=seed,
        progress=False,
        data_bytes=300_000,
        batch_size=8,
        seq_len=64,
    )


def train_steps(model, steps: int, lr: float = 1e-2, batch_seed=lambda step: 0, optimizer=None) -> list[float]:
    """``steps`` AdamW steps of ``model`` on ``random_batch(seed=batch_seed(step))``; returns the losses. The fixed
    default batch makes "the loss falls" a reliable check in a few steps."""
    opt = optimizer or torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for step in range(steps):
        loss = model(**random_batch(seed=batch_seed(step))).loss
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return losses


def train_on_loader(model, optimizer, loader, times: list | None = None) -> list[float]:
    """One pass of ``model`` over ``loader`` (batches of model kwargs with labels); returns the losses. ``times``,
    if given, receives the seconds since the start after every step."""
    losses = []
    t0 = time.perf_counter()
    for batch in loader:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if times is not None:
            times.append(time.perf_counter() - t0)
    return losses


# A chat template in the common shape (role headers, the assistant's turn ending in eos), with TRL's generation
# markers around what the assistant says so assistant-only loss can be asked for.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ '<|assistant|>\n' }}"
    "{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def chat_llama_checkpoint(path, cache_dir, steps: int = 20) -> str:
    """A locally saved LLaMA-architecture checkpoint whose tokenizer has a chat template (the test-size default base
    with :data:`CHAT_TEMPLATE`): what a user's ``--model ./my-llama`` looks like, at test size."""
    base = tiny_default_base(cache_dir, steps=steps)
    shutil.copytree(base, path, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return str(path)


def shard_like_the_jobs(model, fsdp, comm_hook=None):
    """What ``hf-dtrain pretrain --fsdp.* --comm-hook ...`` does to ``model`` on the launched ranks: the sections'
    preparation (FSDP2, within HSDP's replica groups when a comm hook carries the exchange across them), run by the
    job's own run machinery. Returns the exchange's state (bytes per step in ``.stats``), or None."""
    import torch.distributed as dist

    from hf_dtrain.jobs.pretrain.config import pretrain_config_class
    from hf_dtrain.run.job import JobRun

    cfg = pretrain_config_class()(fsdp=fsdp, comm_hook=comm_hook)
    run = JobRun(cfg, world_size=dist.get_world_size(), start=False)
    run.prepare(model)
    return run.stateful().get("comm_hook")


def tiny_gguf(path, source: str | None = None, layers: int = 2, hidden: int = 64, seed: int = 0) -> str:
    """A LLaMA-architecture GGUF file at test size (``layers`` decoder layers of ``hidden``, 4 query over 2 key/value
    heads, tied embeddings, float32 tensors drawn from ``seed``) carrying the tokenizer and chat template of the GGUF
    file ``source`` (default: the packaged SmolLM2's), written with the ``gguf`` package's own writer: what a user's
    ``--model x.gguf`` looks like, read in seconds."""
    import gguf
    import numpy as np

    from hf_dtrain.checkpoints import packaged_gguf

    reader = gguf.GGUFReader(source or packaged_gguf("smollm2-135m-instruct"))
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    heads, kv, ffn = 4, 2, 2 * hidden
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("hf_dtrain tiny test LLaMA")
    for add, value in (
        (w.add_block_count, layers),
        (w.add_context_length, 256),
        (w.add_embedding_length, hidden),
        (w.add_feed_forward_length, ffn),
        (w.add_head_count, heads),
        (w.add_head_count_kv, kv),
        (w.add_rope_freq_base, 10000.0),
        (w.add_layer_norm_rms_eps, 1e-5),
        (w.add_vocab_size, vocab),
        (w.add_rope_dimension_count, hidden // heads),
        (w.add_file_type, 0),  # all float32
    ):
        add(value)
    for name, f in reader.fields.items():  # the tokenizer: tokens, merges, special ids, chat template
        if name.startswith("tokenizer."):
            array = f.types[0] == gguf.GGUFValueType.ARRAY
            w.add_key_value(name, f.contents(), f.types[0], sub_type=f.types[-1] if array else None)
    rng = np.random.default_rng(seed)

    def weight(*shape):
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    kv_dim = kv * hidden // heads
    w.add_tensor("token_embd.weight", weight(vocab, hidden))  # no output.weight: tied to the embedding
    for i in range(layers):
        for name, shape in (
            ("attn_q", (hidden, hidden)),
            ("attn_k", (kv_dim, hidden)),
            ("attn_v", (kv_dim, hidden)),
            ("attn_output", (hidden, hidden)),
            ("ffn_gate", (ffn, hidden)),
            ("ffn_up", (ffn, hidden)),
            ("ffn_down", (hidden, ffn)),
        ):
            w.add_tensor(f"blk.{i}.{name}.weight", weight(*shape))
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)
