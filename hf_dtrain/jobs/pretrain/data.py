"""The pretraining job's data: a byte-level BPE tokenizer trained on the standard library's source (cached), text
packed into blocks of ``seq_len`` tokens (the standard library's source by default; a local text or jsonl file or a
hub dataset, ``streaming`` for large ones), split into training and held-out blocks, the loader a section deals or a
shuffled one, epochs that a resumed run skips into in the same order, and the learning-rate schedule."""

from __future__ import annotations

import math
import os

import torch
from datasets import Dataset
from torch.utils.data import DataLoader, IterableDataset
from transformers import AutoTokenizer

from hf_dtrain.datafile import check_enough, check_text_columns, load_file, load_hub
from hf_dtrain.errors import DataError
from hf_dtrain.models import PRESETS, cache_root, stdlib_text, train_tokenizer


def default_tokenizer(preset: str, data_bytes: int = 1_000_000):
    """A byte-level BPE tokenizer for ``preset``'s vocabulary trained on the stdlib's source, cached on disk."""
    path = cache_root() / "tokenizers" / f"{preset}-{PRESETS[preset]['vocab_size']}-{data_bytes}"
    if (path / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(path))
    tok = train_tokenizer(stdlib_text(data_bytes), vocab_size=PRESETS[preset]["vocab_size"])
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tok.save_pretrained(str(tmp))
    try:
        os.replace(tmp, path)
    except OSError:  # another process won the race
        pass
    return AutoTokenizer.from_pretrained(str(path))


def _pack(tokenizer, texts, seq_len: int) -> torch.Tensor:
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(list(texts), add_special_tokens=True):
        ids.extend(enc.ids)
        ids.append(eos)
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def load_blocks(cfg, tokenizer, rank: int, world: int, replicas: int | None = None):
    """(train, held-out): tensors of token blocks, or for ``streaming`` an iterable of this rank's blocks and None.
    Fewer training blocks than one global batch (``replicas`` data-parallel replicas, default ``world``, each
    ``per_device_train_batch_size``) is a ``DataError``."""
    replicas = replicas or world
    if cfg.dataset is None:
        blocks = _pack(tokenizer, stdlib_text(cfg.data_bytes), cfg.seq_len)
        g = torch.Generator().manual_seed(1234)
        blocks = blocks[torch.randperm(len(blocks), generator=g)]
        return _split_blocks(
            cfg,
            blocks,
            replicas,
            f"(the default corpus, {cfg.data_bytes} bytes)",
            "raise --data-bytes",
            flag="--data-bytes",
        )

    path = cfg.dataset
    local = os.path.exists(path)
    if local:
        ds = load_file(path, split="train", streaming=cfg.streaming)
    else:
        ds = load_hub(path, cfg.dataset_config, split="train", streaming=cfg.streaming)
    if cfg.streaming:
        from datasets.distributed import split_dataset_by_node

        ds = split_dataset_by_node(ds, rank=rank, world_size=world)

        def stream():
            buf: list[str] = []
            for i, row in enumerate(ds):
                text = row.get(cfg.text_column)
                if not isinstance(text, str):
                    check_text_columns(Dataset.from_list([row]), [cfg.text_column], f"{path} (streamed row {i})")
                buf.append(text)
                if len(buf) == 256:
                    yield from _pack(tokenizer, buf, cfg.seq_len)
                    buf = []
            if buf:
                yield from _pack(tokenizer, buf, cfg.seq_len)

        return stream, None
    if cfg.text_column not in ds.column_names:
        raise DataError(
            f"--dataset {path} has no column {cfg.text_column!r} (columns: {ds.column_names}); set --text-column."
        )
    check_text_columns(ds, [cfg.text_column], path, path if local else None)
    return _split_blocks(cfg, _pack(tokenizer, ds[cfg.text_column], cfg.seq_len), replicas, path, "give more text")


def _split_blocks(cfg, blocks, replicas: int, source: str, more: str, flag: str = "--dataset"):
    """(train, held-out) blocks: up to ``eval_blocks`` (a tenth at most) held out; fewer training blocks than one
    global batch (``replicas`` x ``per_device_train_batch_size``) is a ``DataError``."""
    held = min(cfg.eval_blocks, len(blocks) // 10)
    check_enough(
        len(blocks) - held,
        cfg.per_device_train_batch_size * replicas,
        f"training blocks of {cfg.seq_len} tokens ({held} more held out)",
        source,
        f"lower --per-device-train-batch-size or --seq-len, or {more}",
        flag=flag,
    )
    return blocks[held:], blocks[:held]


def schedule(cfg):
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        t = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    return factor


def batches(loader, start: int, streaming: bool):
    """Blocks from the step ``start``: whole epochs skipped by count, then the rest of the epoch skipped; epoch e's
    order depends on (seed, e) only, so a resumed run skips into the same order."""
    if not streaming and len(loader) == 0:
        raise DataError(
            "the training data gives no full batch on this rank: lower --per-device-train-batch-size or give more data."
        )
    done = start - 1
    epoch, skip = (0, done) if streaming else divmod(done, len(loader))
    while True:
        for owner in (loader, getattr(loader, "sampler", None)):
            if hasattr(owner, "set_epoch"):
                owner.set_epoch(epoch)
        batches = 0
        for i, b in enumerate(loader):
            batches += 1
            if i >= skip:
                yield b
        if batches == 0:  # a stream that gives no full batch would spin here for ever
            raise DataError(
                "the training data gives no full batch on this rank: lower --per-device-train-batch-size or "
                "--seq-len, or give more data."
            )
        skip = 0
        epoch += 1


def loader(cfg, run, train):
    """The training loader: the one a section deals (the mesh's data-parallel replicas, the heterogeneity-aware
    sampler), this rank's stream, or a shuffled loader Accelerate shards over the processes."""
    dealt = run.loader(train, cfg.per_device_train_batch_size)
    if dealt is not None:
        return dealt
    from hf_dtrain.run.section import Loader

    batch = cfg.per_device_train_batch_size
    if callable(train):  # streaming: this rank's blocks in order

        class _Stream(IterableDataset):
            def __iter__(self):
                return iter(train())

        return Loader(DataLoader(_Stream(), batch_size=batch), batch)
    generator = torch.Generator().manual_seed(cfg.seed)
    return Loader(
        DataLoader(train, batch_size=batch, shuffle=True, drop_last=True, generator=generator), batch, prepare=True
    )
