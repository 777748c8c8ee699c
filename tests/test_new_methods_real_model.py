"""KeyDiff, Expected Attention and CAKE on the real default model (SmolLM2-135M-Instruct, float32, a 1k-token
passkey prompt): kept entries per layer (30) and KV head (3) against the re-derived reference code of
:mod:`test_keydiff_expected_attention_cake`. Near-ties at the top-k boundary (two float32 routes to one
score) may swap; every swapped entry must score within 1e-4 of the boundary."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_keydiff_expected_attention_cake import (
    assert_kept,
    cake_reference,
    compress,
    kvpress_expected_attention,
    reference_adjust_budgets,
    run_reference,
)

from kvsieve.eval.tasks.passkey_prompt import make_passkey_sample
from kvsieve.generation.reconstruction import reconstruct

pytestmark = pytest.mark.slow

BUDGET, RTOL = 128, 1e-4


@pytest.fixture(scope="module")
def default_model():
    from kvsieve.models.default_model import load_default_model

    model, tokenizer = load_default_model(dtype=torch.float32)
    ids = torch.tensor([make_passkey_sample(tokenizer, 1024, 0.5, seed=0).prompt_ids])
    with torch.inference_mode():
        captured = run_reference(model, ids)
    return model, ids, captured, tokenizer


def test_kvzip_on_the_default_model(default_model):
    """One chunk (1k tokens): kvpress's subsampled keys are every key, so the maxima are the same quantity."""
    from test_kvzip import kvzip_reference

    model, ids, _, tokenizer = default_model
    with torch.inference_mode():
        reference = kvzip_reference(model, ids, tokenizer=tokenizer)
        cache = compress(model, ids, "kvzip", budget=BUDGET)
        reconstruct(model, tokenizer, cache, ids)
    layers, heads, n = reference.shape
    flat = reference.flatten().float()
    top = flat.topk(layers * heads * BUDGET)
    boundary = float(top.values[-1])
    expected = torch.zeros_like(flat, dtype=torch.bool)
    expected[top.indices] = True
    expected = expected.view(layers, heads, n)
    assert int(cache.head_lengths().sum()) == layers * heads * BUDGET
    for layer in range(layers):
        for head in range(heads):
            kept = set(cache.kept_positions(layer, 0, head).tolist())
            want = set(expected[layer, head].nonzero().flatten().tolist())
            for position in kept ^ want:  # only near-ties at the global boundary may swap
                assert abs(float(reference[layer, head, position]) - boundary) <= RTOL * boundary, (layer, head)


def test_keydiff_on_the_default_model(default_model):
    model, ids, captured, _ = default_model
    reference = []
    for _, keys, _ in captured:
        anchor = F.normalize(keys, p=2, dim=-1).mean(dim=2, keepdim=True)
        reference.append(-F.cosine_similarity(keys, anchor, dim=-1))
    with torch.inference_mode():
        cache = compress(model, ids, "keydiff", budget=BUDGET)
    assert_kept(cache, reference, [BUDGET] * len(reference), RTOL)


def test_expected_attention_on_the_default_model(default_model):
    model, ids, captured, _ = default_model
    with torch.inference_mode():
        reference = [kvpress_expected_attention(model, i, h, k, v) for i, (h, k, v) in enumerate(captured)]
        cache = compress(model, ids, "expected_attention", budget=BUDGET)
    assert_kept(cache, reference, [BUDGET] * len(reference), RTOL)


def test_cake_on_the_default_model(default_model):
    model, ids, captured, _ = default_model
    window, length = 32, ids.shape[1]
    with torch.inference_mode():
        preferences, indicators = cake_reference(model, captured, window, 1.0, 1.0, 200.0)
        cache = compress(model, ids, "cake", budget=BUDGET)
    total = (BUDGET - window) * len(captured)
    budgets = reference_adjust_budgets([p / sum(preferences) * total for p in preferences], total,
                                       length - window, len(captured))
    lengths = cache.head_lengths()[:, 0, 0]
    assert lengths.tolist() == [b + window for b in budgets]
    padded = [F.pad(ind, (0, window), value=float("inf")) for ind in indicators]  # the window is always kept
    assert_kept(cache, padded, [b + window for b in budgets], RTOL)
