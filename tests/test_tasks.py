import json

import numpy as np
import pytest
import torch
from transformers import EvalPrediction

from hf_dtrain import tasks


@pytest.fixture(scope="module")
def base(tiny_base):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_base(5)
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def test_examples_are_deterministic_and_splits_disjoint():
    a = tasks.addition_examples(500, seed=1)
    assert a == tasks.addition_examples(500, seed=1) and a != tasks.addition_examples(500, seed=2)
    for p, c in a[:50]:
        x, y = p[:-1].split("+")
        assert p.endswith("=") and int(c) == int(x) + int(y)
    train = set(tasks.addition_examples(20_000, seed=0, split="train"))
    ev = set(tasks.addition_examples(500, seed=0, split="eval"))
    assert len(ev) == 500 and not train & ev
    small = tasks.addition_examples(50, seed=0, split="eval", digits=1)  # pool of 10 pairs: cycles
    assert len(small) == 50 and len(set(small)) == 10
    pre = set(tasks.pretraining_task_texts(20_000))
    for d in (1, 2, 3):  # no eval pair of any digit count is in the base model's pretraining mix
        assert not {p + c for p, c in tasks.addition_examples(1000, split="eval", digits=d)} & pre


def test_labels_mask_prompt_and_end_with_eos(base):
    _, tok = base
    ds = tasks.make_task_dataset(tok, 8, seed=0, split="eval")
    pairs = tasks.addition_examples(8, seed=0, split="eval")
    for row, (prompt, completion) in zip(ds, pairs):
        n_prompt = len(tok(prompt)["input_ids"])
        assert row["labels"][:n_prompt] == [-100] * n_prompt
        answer = row["labels"][n_prompt:]
        assert answer[-1] == tok.eos_token_id
        assert tok.decode(answer[:-1]) == completion
        assert row["input_ids"][n_prompt:] == answer and row["input_ids"][0] == tok.bos_token_id
        assert tok.decode(row["input_ids"], skip_special_tokens=True) == prompt + completion


def test_collator_pads_labels_with_ignore_index(base):
    _, tok = base
    ds = tasks.make_task_dataset(tok, 16, seed=0)
    batch = tasks.task_collator(tok)([ds[i] for i in range(16)])
    lengths = [len(ds[i]["input_ids"]) for i in range(16)]
    assert batch["input_ids"].shape == (16, max(lengths))
    short = int(np.argmin(lengths))
    assert (batch["labels"][short, lengths[short] :] == -100).all()
    assert (batch["attention_mask"][short, lengths[short] :] == 0).all()
    assert (batch["input_ids"][short, lengths[short] :] == tok.pad_token_id).all()


def test_exact_match_on_constructed_predictions():
    labels = np.array(
        [
            [-100, -100, -100, 5, 6, 2],
            [-100, -100, 7, 2, -100, -100],  # padded row
            [-100, -100, -100, 5, 6, 2],
            [-100, -100, -100, -100, -100, -100],  # nothing supervised: wrong
        ]
    )
    # pred[:, t] predicts labels[:, t + 1]
    preds = np.array(
        [
            [9, 9, 5, 6, 2, 0],  # all right (garbage on prompt and last position is ignored)
            [9, 7, 2, 4, 4, 4],  # right
            [9, 9, 5, 6, 3, 0],  # eos wrong
            [0, 0, 0, 0, 0, 0],
        ]
    )
    assert tasks.exact_match(preds, labels) == pytest.approx(0.5)
    # the unshifted comparison (a classic bug) must not score the same
    assert tasks.exact_match(np.where(labels == -100, 0, labels), labels) == 0.0

    vocab = 10
    logits = torch.full((4, 6, vocab), -1.0)
    logits.scatter_(2, torch.tensor(preds)[..., None], 1.0)
    ids = tasks.preprocess_logits_for_metrics((logits,), torch.tensor(labels))
    assert ids.tolist() == preds.tolist()
    assert tasks.compute_metrics(EvalPrediction(predictions=ids.numpy(), label_ids=labels)) == {"accuracy": 0.5}


def test_teacher_forced_accuracy_equals_greedy_decoding(base):
    model, tok = base
    pairs = tasks.addition_examples(6, seed=0, split="eval", digits=1)
    # make a few examples correct by construction: the model's own greedy answers
    own = []
    for prompt, _ in pairs[:3]:
        ids = torch.tensor([tok(prompt)["input_ids"]])
        out = model.generate(
            ids, max_new_tokens=4, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
        )
        text = tok.decode(out[0, ids.shape[1] :])
        if text.endswith(tok.eos_token) and tok.eos_token not in text[: -len(tok.eos_token)]:
            own.append((prompt, text[: -len(tok.eos_token)]))
    mixed = own + pairs[3:]
    ds = tasks._to_dataset(tok, mixed)
    batch = tasks.task_collator(tok)([ds[i] for i in range(len(ds))])
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    tf = tasks.exact_match(tasks.preprocess_logits_for_metrics(logits, None).numpy(), batch["labels"].numpy())
    assert tf == pytest.approx(tasks.greedy_exact_match(model, tok, mixed))


def test_load_sft_dataset_from_local_jsonl_and_its_formats(base, tmp_path):
    _, _tok = base
    path = tmp_path / "d.jsonl"
    with open(path, "w") as f:
        for i in range(40):
            f.write(json.dumps({"prompt": f"Q{i}:", "completion": f" A{i}"}) + "\n")
    train, ev = tasks.load_sft_dataset(str(path), eval_size=5, seed=0)
    assert len(train) == 35 and len(ev) == 5 and not set(train["prompt"]) & set(ev["prompt"])
    assert tasks.dataset_format(train) == "prompt-completion"
    train, _ = tasks.load_sft_dataset(str(path), eval_size=5, seed=0, train_size=10)
    assert len(train) == 10
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "x", "completion": "y"}) + "\n" * 3)
    with pytest.raises(ValueError, match=r"columns \['question', 'completion'\].*'messages'.*--dataset-text-field"):
        tasks.load_sft_dataset(str(bad))
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"1 row\(s\): at least 2"):
        tasks.load_sft_dataset(str(one))
    from datasets import Dataset

    assert (
        tasks.dataset_format(Dataset.from_dict({"messages": [[{"role": "user", "content": "hi"}]]})) == "conversational"
    )
    assert tasks.dataset_format(Dataset.from_dict({"body": ["x"]}), text_field="body") == "language modeling"


def test_prepare_sft_dataset_is_what_the_sft_trainer_prepares(base, tmp_path):
    """The fused sweep and the federated loop train on TRL's own preparation: the rows equal the SFTTrainer's."""
    from trl import SFTConfig, SFTTrainer

    model, tok = base
    raw = tasks.addition_dataset(12, seed=3)
    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", max_length=64)
    mine = tasks.prepare_sft_dataset(raw, tok, args)
    trainer = SFTTrainer(model=model, args=args, train_dataset=raw, processing_class=tok)
    theirs = trainer.train_dataset
    assert mine.column_names == ["input_ids", "labels"]
    assert mine[:] == theirs.select_columns(mine.column_names)[:]
    pairs = tasks.addition_examples(12, seed=3)
    for row, (prompt, _completion) in zip(mine, pairs):  # the prompt masked, the completion and eos trained
        n = len(tok(prompt)["input_ids"])
        assert row["labels"][:n] == [-100] * n and row["labels"][n:] == row["input_ids"][n:]
        assert row["input_ids"][-1] == tok.eos_token_id
