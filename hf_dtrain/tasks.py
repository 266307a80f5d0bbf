"""The default fine-tuning task (integer addition) and loading of user datasets in TRL's formats.

An example is a prompt ``"12+345="`` and a completion ``"357"`` followed by eos; the loss is on the completion only
(prompt labels are -100). Accuracy is exact match computed teacher-forced in one forward pass: the argmax at every
completion position (eos included) equals the target. That is the same as greedy-decoding exact match, without a
generation loop, so it works as a Trainer ``compute_metrics`` with ``preprocess_logits_for_metrics``.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import torch
from datasets import Dataset, DatasetDict
from transformers import DataCollatorForSeq2Seq
from trl import SFTTrainer
from trl.chat_template_utils import get_training_chat_template, has_generation_markers
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from hf_dtrain.datafile import check_text_columns, load_file, load_hub
from hf_dtrain.errors import DataError, SettingsError

IGNORE_INDEX = -100
# Operand range of the default task: both operands have 1 to TASK_DIGITS digits. The tiny base learns a lot of it in
# 2000 LoRA steps (0% -> ~75% exact match) but not all of it.
TASK_DIGITS = 2
# The default base model's pretraining mixes in longer additions (1 to 3 digits) so it knows the format.
PRETRAIN_TASK_DIGITS = 3
# The train/eval split of the operand pairs is fixed (independent of the user's seed), so splits never overlap.
_SPLIT_SEED = 20240917
EVAL_FRACTION = 0.1


def _pair_pool(digits: int, split: str) -> np.ndarray:
    """The operand pairs (as ``a * 10**digits + b``) that belong to ``split``, a fixed permutation of all pairs."""
    if split not in ("train", "eval"):
        raise SettingsError(f"split must be 'train' or 'eval', got {split!r}.")
    space = 10 ** (2 * digits)
    perm = np.random.default_rng(_SPLIT_SEED).permutation(space)
    n_eval = max(1, int(space * EVAL_FRACTION))
    return perm[:n_eval] if split == "eval" else perm[n_eval:]


def addition_examples(n: int, seed: int = 0, split: str = "train", digits: int = TASK_DIGITS) -> list[tuple[str, str]]:
    """``n`` deterministic ``(prompt, completion)`` pairs like ``("12+345=", "357")``; train/eval pairs are disjoint.

    Sampled without replacement while the split's pool lasts, then cycling through it.
    """
    pool = _pair_pool(digits, split)
    rng = np.random.default_rng(seed)
    reps = -(-n // len(pool))
    codes = np.concatenate([rng.permutation(pool) for _ in range(reps)])[:n]
    base = 10**digits
    return [(f"{a}+{b}=", str(a + b)) for a, b in zip((codes // base).tolist(), (codes % base).tolist())]


def pretraining_task_texts(n: int = 20_000, seed: int = 0, digits: int = PRETRAIN_TASK_DIGITS) -> list[str]:
    """Full task lines (``"12+345=357"``) mixed into the default base model's pretraining: from the train split only,
    and without any pair of the eval split of a shorter task (eval pairs of every digit count stay unseen)."""
    held_out = set()
    for d in range(1, digits):
        base = 10**d
        held_out.update((int(c) // base, int(c) % base) for c in _pair_pool(d, "eval"))
    out = []
    for p, c in addition_examples(n, seed=seed + 1_000_003, split="train", digits=digits):
        a, b = p[:-1].split("+")
        if (int(a), int(b)) not in held_out:
            out.append(p + c)
    return out


def tokenize_example(tokenizer, prompt: str, completion: str, max_length: int | None = None) -> dict:
    """input_ids = prompt (with the tokenizer's bos if it adds one) + completion + eos; labels -100 on the prompt."""
    p = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    c = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = p + c
    labels = [IGNORE_INDEX] * len(p) + c
    if max_length is not None:
        ids, labels = ids[:max_length], labels[:max_length]
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}


def _to_dataset(tokenizer, pairs, max_length=None):
    rows = [tokenize_example(tokenizer, p, c, max_length) for p, c in pairs]
    return Dataset.from_dict({k: [r[k] for r in rows] for k in ("input_ids", "attention_mask", "labels")})


def make_task_dataset(tokenizer, n: int, seed: int = 0, split: str = "train", digits: int = TASK_DIGITS):
    """The default task as a tokenized ``datasets.Dataset`` (input_ids, attention_mask, labels)."""
    return _to_dataset(tokenizer, addition_examples(n, seed=seed, split=split, digits=digits))


def addition_dataset(n: int, seed: int = 0, split: str = "train", digits: int = TASK_DIGITS):
    """The default task in TRL's prompt-completion format: a ``datasets.Dataset`` with ``prompt`` (``"12+345="``) and
    ``completion`` (``"357"``) columns; ``hf-dtrain finetune`` with no ``--dataset`` trains on it through the same
    path as a user's file (the eos and the completion-only labels are added by TRL's preparation)."""
    pairs = addition_examples(n, seed=seed, split=split, digits=digits)
    return Dataset.from_dict({"prompt": [p for p, _ in pairs], "completion": [c for _, c in pairs]})


INSTRUCTION = "What is {a}+{b}? Answer with the number only."


def as_instructions(dataset):
    """The default task asked of a chat model: each prompt ``"12+345="`` becomes the user message ``"What is 12+345?
    Answer with the number only."`` and each completion the assistant's reply ``"357"`` (TRL's conversational
    prompt-completion format, rendered with the tokenizer's chat template; the loss and the exact match are on the
    reply and its end-of-turn tokens)."""

    def ask(row):
        a, b = row["prompt"][:-1].split("+")
        return {
            "prompt": [{"role": "user", "content": INSTRUCTION.format(a=a, b=b)}],
            "completion": [{"role": "assistant", "content": row["completion"]}],
        }

    return dataset.map(ask, desc="the default task as chat turns")


def dataset_format(dataset, text_field: str = "text", source: str = "the dataset") -> str:
    """Which of TRL's formats ``dataset`` is in: ``conversational`` (a ``messages`` column, or prompt / completion
    holding lists of messages), ``prompt-completion`` or ``language modeling`` (``text_field``); a ``DataError``
    naming ``source``, its columns and the formats otherwise."""
    columns = list(dataset.column_names)
    if "messages" in columns:
        return "conversational"
    if "prompt" in columns and "completion" in columns:
        first = dataset[0]["prompt"] if len(dataset) else ""
        return "conversational" if isinstance(first, list) else "prompt-completion"
    if text_field in columns:
        return "language modeling"
    raise DataError(
        f"{source} has columns {columns}, none of TRL's formats: a 'messages' column (chat, rendered "
        "with the tokenizer's chat template), 'prompt' and 'completion' columns, or a text column (set "
        f"--dataset-text-field, now {text_field!r})."
    )


def load_sft_dataset(
    name_or_path: str,
    *,
    config: str | None = None,
    train_size: int | None = None,
    eval_size: int = 200,
    seed: int = 0,
    text_field: str = "text",
):
    """``(train, eval)`` raw datasets in one of TRL's formats from a local json / jsonl / csv / parquet / txt file or
    a hub dataset (``config``: its configuration name). The eval split is the dataset's ``validation`` / ``test``
    split when it has one (its first ``eval_size`` rows), else ``eval_size`` rows (at most a fifth) held out from
    train with ``seed``; ``train_size`` caps the training rows (None: all)."""
    path = name_or_path if os.path.exists(name_or_path) else None
    ds = load_file(path) if path else load_hub(name_or_path, config)
    if not isinstance(ds, DatasetDict):
        ds = DatasetDict({"train": ds})
    if "train" not in ds:
        raise DataError(f"--dataset {name_or_path!r} has no train split (splits: {list(ds)}).")
    train = ds["train"]
    kind = dataset_format(
        train, text_field, f"--dataset {name_or_path}"
    )  # a clear error before any split or tokenization
    columns = {"conversational": ["messages"], "language modeling": [text_field]}.get(kind, ["prompt", "completion"])
    if kind == "conversational" and "messages" not in train.column_names:
        columns = ["prompt", "completion"]
    check_text_columns(train, columns, name_or_path, path)
    held = next((ds[s] for s in ("validation", "test", "eval") if s in ds), None)
    if held is not None:
        check_text_columns(held, columns, f"{name_or_path} (its evaluation split)", None)
    if held is None:
        if len(train) < 2:
            raise DataError(
                f"--dataset {name_or_path!r} has {len(train)} row(s): at least 2 are needed (one to "
                "hold out for evaluation), or give a validation split."
            )
        parts = train.train_test_split(test_size=min(eval_size, max(1, len(train) // 5)), seed=seed)
        train, held = parts["train"], parts["test"]
    elif eval_size:
        held = held.select(range(min(eval_size, len(held))))
    if train_size:
        train = train.shuffle(seed=seed).select(range(min(train_size, len(train))))
    return train, held


def prepare_sft_dataset(dataset, tokenizer, args, packing: bool | None = None):
    """``dataset`` tokenized exactly as TRL's ``SFTTrainer`` prepares it for ``args`` (an ``SFTConfig``): the chat
    template, the eos, the completion-only / assistant-only labels, truncation and packing. For the loops that do
    not run the ``SFTTrainer`` (the fused sweep, the federated simulation): they train on the same tokens as
    ``hf-dtrain finetune``. Uses TRL's own ``SFTTrainer._prepare_dataset`` (trl is pinned to a tested range; a test
    checks the result against the trainer's). ``packing``: None for ``args.packing``."""
    sample = dataset[0]
    completion_only = args.completion_only_loss
    if completion_only is None:
        completion_only = "prompt" in sample and "completion" in sample
    template = None
    if args.assistant_only_loss and not has_generation_markers(tokenizer.chat_template):
        template = get_training_chat_template(tokenizer)
    view = SimpleNamespace(_tokenizer=tokenizer, chat_template=template, completion_only_loss=completion_only)
    packing = args.packing if packing is None else packing
    out = SFTTrainer._prepare_dataset(view, dataset, tokenizer, args, packing, None, "train")
    # what the trainer's collator reads (its other columns are dropped as unused by the Trainer)
    return out.select_columns([c for c in ("input_ids", "labels", "seq_lengths") if c in out.column_names])


def sft_collator(tokenizer, args=None):
    """TRL's collator for prepared datasets, as the ``SFTTrainer`` builds it for ``args`` (an ``SFTConfig``): pads
    input_ids with the pad token and labels with -100 and gives the attention mask, or, padding-free (``padding_free``,
    or best-fit packing), position ids that keep attention within each packed example."""
    padding_free = args is not None and (
        args.padding_free or (args.packing and args.packing_strategy in ("bfd", "bfd_split"))
    )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return DataCollatorForLanguageModeling(pad_token_id=pad, padding_free=padding_free)


def task_collator(tokenizer):
    """Pads input_ids with the pad token, attention_mask with 0 and labels with -100 (right padding)."""
    return DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX, return_tensors="pt")


def preprocess_logits_for_metrics(logits, labels):
    """Keep only the argmax token ids, so the Trainer does not accumulate full logits."""
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    return logits.argmax(dim=-1)


def exact_match(pred_ids, labels) -> float:
    """Fraction of rows whose argmax predictions equal the labels at every supervised position.

    ``pred_ids[:, t]`` predicts token ``t + 1`` (causal LM), so it is compared with ``labels[:, t + 1]``; rows with
    no supervised position count as wrong.
    """
    pred_ids, labels = np.asarray(pred_ids), np.asarray(labels)
    if pred_ids.ndim != 2 or pred_ids.shape != labels.shape:
        raise SettingsError(
            f"expected 2-D predictions and labels of one shape, got {pred_ids.shape} and {labels.shape}"
        )
    target = labels[:, 1:]
    mask = target != IGNORE_INDEX
    ok = (pred_ids[:, :-1] == target) | ~mask
    correct = ok.all(axis=1) & mask.any(axis=1)
    return float(correct.mean()) if len(correct) else 0.0


def compute_metrics(eval_pred) -> dict:
    """Trainer ``compute_metrics``: ``{"accuracy": exact match}`` (use with :func:`preprocess_logits_for_metrics`)."""
    preds, labels = eval_pred.predictions, eval_pred.label_ids
    if isinstance(preds, (tuple, list)):
        preds = preds[0]
    return {"accuracy": exact_match(preds, labels)}


@torch.no_grad()
def greedy_exact_match(model, tokenizer, pairs, max_new_tokens: int = 8) -> float:
    """Reference: exact match by greedy decoding, one example at a time (slow; for tests and spot checks)."""
    model.eval()
    hits = 0
    for prompt, completion in pairs:
        ids = torch.tensor([tokenizer(prompt, add_special_tokens=True)["input_ids"]])
        out = model.generate(
            ids,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=False)
        hits += text == completion + tokenizer.eos_token
    return hits / max(1, len(pairs))
