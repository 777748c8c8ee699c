"""Policy scores on a synthetic layer step, against the papers' formulas / the papers' code."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import kvsieve
from kvsieve.cache.store import LayerStore, SideSpec
from kvsieve.core.step import LayerStep
from kvsieve.models.architectures import ArchitectureSpec, ModelInfo
from kvsieve.parts.scorers.base import Scorer
from kvsieve.parts.scorers.h2o import ACCUMULATOR, AccumulatedAttention
from kvsieve.parts.scorers.snapkv import WindowAttention
from kvsieve.parts.scorers.streaming_llm import Sinks
from kvsieve.parts.scorers.tova import LastQueryAttention

BATCH, Q_HEADS, KV_HEADS, N, D = 2, 4, 2, 20, 8
GROUPS = Q_HEADS // KV_HEADS
SCALE = D**-0.5


def make_step(seed: int = 0) -> tuple[LayerStep, torch.Tensor]:
    """A prefill step of N tokens; returns the step and the reference causal attention (b, qh, N, N)."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(BATCH, Q_HEADS, N, D, generator=generator)
    keys = torch.randn(BATCH, KV_HEADS, N, D, generator=generator)
    values = torch.randn(BATCH, KV_HEADS, N, D, generator=generator)
    store = LayerStore(BATCH, KV_HEADS, D, torch.float32, torch.device("cpu"))
    store.append(keys, values, 0, None)
    info = ModelInfo(ArchitectureSpec(), 1, Q_HEADS, KV_HEADS, D, (None,))
    step = LayerStep(
        module=None,
        layer_idx=0,
        info=info,
        query=query,
        first_position=0,
        query_valid=None,
        store=store,
        scaling=SCALE,
    )
    logits = query @ keys.repeat_interleave(GROUPS, dim=1).transpose(-1, -2) * SCALE
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    attention = torch.softmax(logits.masked_fill(~causal, -math.inf), dim=-1)
    return step, attention


def group_mean(scores: torch.Tensor) -> torch.Tensor:
    return scores.view(BATCH, KV_HEADS, GROUPS, -1).mean(dim=2)


def nominal(budget: int) -> torch.Tensor:
    """The per-head budget ``(batch, kv_heads)`` a uniform allocator hands the scorer."""
    return torch.full((BATCH, KV_HEADS), budget)


def observe(scorer: Scorer, step: LayerStep) -> None:
    """Apply the scorer's side-data updates to the step's store, as the engine does."""
    for name, update in scorer.observe(step).items():
        step.store.ensure_side(next(spec for spec in scorer.side() if spec.name == name))
        step.store.add_dense(name, update)


def test_h2o_accumulates_column_sums_of_all_queries():
    step, attention = make_step(1)
    scorer = AccumulatedAttention()
    assert scorer.side() == (SideSpec(ACCUMULATOR),)
    updates = scorer.observe(step)
    assert set(updates) == {ACCUMULATOR} and updates[ACCUMULATOR].shape == (BATCH, KV_HEADS, N)
    observe(scorer, step)
    accumulated = step.store.dense().extras[ACCUMULATOR]
    torch.testing.assert_close(accumulated, group_mean(attention.sum(dim=2)), atol=1e-5, rtol=1e-5)
    assert step.view.extras[ACCUMULATOR] is accumulated  # the step reads the store's current view


def test_h2o_score_protects_recent_share_of_budget():
    step, attention = make_step(2)
    scorer = kvsieve.make_policy("h2o", budget=8, recent_ratio=0.5).scorer
    assert isinstance(scorer, AccumulatedAttention) and scorer.recent_ratio == 0.5
    observe(scorer, step)
    scores = scorer.score(step, nominal(8))
    assert torch.isinf(scores[..., -4:]).all()
    torch.testing.assert_close(scores[..., :-4], group_mean(attention.sum(dim=2))[..., :-4], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(scorer.raw(step, nominal(8)), group_mean(attention.sum(dim=2)), atol=1e-5, rtol=1e-5)


def test_tova_group_scores_last_query_row():
    """``heads="group"`` (kvsieve ≤ 0.1): the last query's row averaged over each GQA group."""
    step, attention = make_step(3)
    scores = LastQueryAttention(heads="group").score(step, nominal(8))
    torch.testing.assert_close(scores, group_mean(attention[:, :, -1]), atol=1e-6, rtol=1e-5)


def test_tova_default_scores_last_query_row_averaged_over_the_layer():
    """The official reading (default ``heads="layer"``): the last query's row averaged over *all* query
    heads of the layer — the same score for every KV head; nothing is protected."""
    step, attention = make_step(3)
    scorer = kvsieve.make_policy("tova", budget=8).scorer
    assert isinstance(scorer, LastQueryAttention) and scorer.heads == "layer"
    scores = scorer.score(step, nominal(8))
    expected = attention[:, :, -1].mean(dim=1, keepdim=True).expand(BATCH, KV_HEADS, N)
    torch.testing.assert_close(scores, expected, atol=1e-6, rtol=1e-5)
    assert torch.equal(scores[:, :1].expand_as(scores), scores)
    assert not torch.allclose(scores, group_mean(attention[:, :, -1]), atol=1e-4)  # differs from per-group


def test_streaming_llm_scores_sinks_then_recency():
    step, _ = make_step(4)
    scores = Sinks().score(step, nominal(8))
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
    scorer = kvsieve.make_policy("snapkv", budget=8, window=window, kernel_size=kernel_size).scorer
    assert scorer == WindowAttention(window=window, kernel_size=kernel_size)
    scores = scorer.score(step, nominal(8))
    votes = attention[:, :, -window:, :-window].sum(dim=-2)
    pooled = F.avg_pool1d(votes, kernel_size, stride=1, padding=kernel_size // 2, count_include_pad=True)
    expected = group_mean(pooled)
    assert torch.isinf(scores[..., -window:]).all()
    torch.testing.assert_close(scores[..., :-window], expected, atol=1e-5, rtol=1e-5)
