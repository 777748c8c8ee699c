"""Policy scores on a synthetic layer step, against the formulas of METHODS.md / the papers' code."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kvsieve.attention.step import LayerStep
from kvsieve.cache.store import RaggedLayerStore
from kvsieve.models.architectures import ARCHITECTURES, ModelInfo
from kvsieve.policies.h2o import ACCUMULATOR, H2O
from kvsieve.policies.snapkv import SnapKV
from kvsieve.policies.streaming_llm import StreamingLLM
from kvsieve.policies.tova import TOVA

BATCH, Q_HEADS, KV_HEADS, N, D = 2, 4, 2, 20, 8
GROUPS = Q_HEADS // KV_HEADS
SCALE = D**-0.5


def make_step(seed: int = 0) -> tuple[LayerStep, torch.Tensor]:
    """A prefill step of N tokens; returns the step and the reference causal attention (b, qh, N, N)."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(BATCH, Q_HEADS, N, D, generator=generator)
    keys = torch.randn(BATCH, KV_HEADS, N, D, generator=generator)
    values = torch.randn(BATCH, KV_HEADS, N, D, generator=generator)
    store = RaggedLayerStore(BATCH, KV_HEADS, D, torch.float32, torch.device("cpu"))
    store.append(keys, values, torch.arange(N), None)
    info = ModelInfo(ARCHITECTURES["llama"], 1, Q_HEADS, KV_HEADS, D, (None,))
    step = LayerStep(
        module=None,
        layer_idx=0,
        info=info,
        query=query,
        query_positions=torch.arange(N),
        query_valid=None,
        store=store,
        view=store.dense(),
        scaling=SCALE,
    )
    logits = query @ keys.repeat_interleave(GROUPS, dim=1).transpose(-1, -2) * SCALE
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    attention = torch.softmax(logits.masked_fill(~causal, -math.inf), dim=-1)
    return step, attention


def group_mean(scores: torch.Tensor) -> torch.Tensor:
    return scores.view(BATCH, KV_HEADS, GROUPS, -1).mean(dim=2)


def test_h2o_accumulates_column_sums_of_all_queries():
    step, attention = make_step(1)
    H2O(budget=8).observe(step)
    accumulated = step.store.dense().extras[ACCUMULATOR]
    torch.testing.assert_close(accumulated, group_mean(attention.sum(dim=2)), atol=1e-5, rtol=1e-5)


def test_h2o_score_protects_recent_share_of_budget():
    step, attention = make_step(2)
    policy = H2O(budget=8, recent_ratio=0.5)
    policy.observe(step)
    scores = policy.score(step)
    assert torch.isinf(scores[..., -4:]).all()
    torch.testing.assert_close(scores[..., :-4], group_mean(attention.sum(dim=2))[..., :-4], atol=1e-5, rtol=1e-5)


def test_tova_scores_last_query_row():
    step, attention = make_step(3)
    scores = TOVA(budget=8).score(step)
    torch.testing.assert_close(scores, group_mean(attention[:, :, -1]), atol=1e-6, rtol=1e-5)


def test_streaming_llm_scores_sinks_then_recency():
    step, _ = make_step(4)
    scores = StreamingLLM(budget=8).score(step)
    assert torch.isinf(scores[..., :4]).all()
    assert bool((scores[..., 5:] > scores[..., 4:-1]).all())


@pytest.mark.parametrize("kernel_size", [1, 5, 7])
def test_snapkv_scores_match_reference_code(kernel_size):
    """SnapKV's reference code (``snapkv_utils.py``) votes with the window queries over the *prefix*
    columns only, ``attn[..., -w:, :-w].sum(-2)``, and pools those; the window itself is kept apart.
    Pooling over all columns lets the window's own (large, recent) attention leak into the scores of
    the last ``kernel_size // 2`` prefix entries, biasing selection towards tokens next to the window."""
    window = 4
    step, attention = make_step(5)
    scores = SnapKV(budget=8, window=window, kernel_size=kernel_size).score(step)
    votes = attention[:, :, -window:, :-window].sum(dim=-2)
    pooled = F.avg_pool1d(votes, kernel_size, stride=1, padding=kernel_size // 2, count_include_pad=True)
    expected = group_mean(pooled)
    assert torch.isinf(scores[..., -window:]).all()
    torch.testing.assert_close(scores[..., :-window], expected, atol=1e-5, rtol=1e-5)
