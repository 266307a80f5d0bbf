"""CRAIG: the weighted subset's gradient is closer to the full gradient than random subsets of the same size, the
weights count the examples each selected one stands for, and the LM proxies are the gradient w.r.t. the logits."""

import pytest
import torch

from hf_dtrain.data import craig_select, craig_subset, lm_gradient_proxies


def test_weighted_subset_gradient_beats_random_subsets():
    """Least squares: per-example gradients x_i (w·x_i - y_i) at a fixed w are the proxies (exact, as for the last
    layer of a net); CRAIG's Σ γ_j g_j vs n/k Σ over random subsets of the same size, against Σ g_i."""
    gen = torch.Generator().manual_seed(0)
    n, d, k = 600, 6, 30
    centers = torch.randn(8, d, generator=gen) * 3
    x = centers[torch.randint(0, 8, (n,), generator=gen)] + 0.5 * torch.randn(n, d, generator=gen)
    y = x @ torch.randn(d, generator=gen) + 0.1 * torch.randn(n, generator=gen)
    w = torch.randn(d, generator=gen)
    grads = x * (x @ w - y).unsqueeze(1)
    full = grads.sum(0)
    indices, weights = craig_select(grads, k)
    assert len(indices) == k and float(weights.sum()) == n  # every example is represented by one selected
    craig_err = float((grads[indices].double().T @ weights - full.double()).norm())
    random_errs = []
    for s in range(50):
        pick = torch.randperm(n, generator=torch.Generator().manual_seed(100 + s))[:k]
        random_errs.append(float((grads[pick].sum(0) * (n / k) - full).norm()))
    mean_random = sum(random_errs) / len(random_errs)
    print(craig_err, mean_random, min(random_errs))
    assert craig_err < 0.5 * mean_random, (craig_err, mean_random)
    # the certificate of the guarantee: the error is below Σ_i min_j ||g_i - g_j||
    bound = float(torch.cdist(grads.double(), grads[indices].double()).min(1).values.sum())
    assert craig_err <= bound + 1e-6


def test_per_class_budgets_and_dataset_subset():
    from datasets import Dataset

    gen = torch.Generator().manual_seed(1)
    labels = [0] * 80 + [1] * 20
    proxies = torch.randn(100, 4, generator=gen)
    indices, weights = craig_select(proxies, 0.1, labels)
    assert sorted(labels[i] for i in indices) == [0] * 8 + [1] * 2  # each class keeps its share
    assert float(weights[:8].sum()) == 80 and float(weights[8:].sum()) == 20
    ds = Dataset.from_dict({"x": list(range(100))})
    sub = craig_subset(ds, proxies, 10, labels)
    assert len(sub) == 10 and sum(sub["weight"]) == 100 and sub["x"] == indices


def test_lm_proxies_are_the_logit_gradient():
    from hf_dtrain.testing import random_batch, tiny_llama

    model = tiny_llama(seed=0)
    batch = random_batch(batch=3, seq=8)
    batch["labels"][:, :4] = -100  # only the last tokens are answers
    proxies = lm_gradient_proxies(model, [batch])
    # reference by autograd: per example, d(sum of token losses)/d(logits), averaged over its answer tokens
    for b in range(3):
        logits = model(input_ids=batch["input_ids"][b : b + 1]).logits.detach().requires_grad_(True)
        loss = torch.nn.functional.cross_entropy(
            logits[0, :-1], batch["labels"][b, 1:], ignore_index=-100, reduction="sum"
        )
        loss.backward()
        count = int((batch["labels"][b, 1:] != -100).sum())
        torch.testing.assert_close(proxies[b], logits.grad[0, :-1].sum(0) / count, atol=1e-5, rtol=1e-4)


def test_bad_input():
    with pytest.raises(ValueError, match=r"size must select between 1 and 5"):
        craig_select(torch.zeros(5, 2), 9)
    with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\]"):
        craig_select(torch.zeros(5, 2), 1.5)
    with pytest.raises(TypeError, match=r"\(n, d\) tensor"):
        craig_select([[0.0]], 1)
