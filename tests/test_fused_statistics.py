"""Statistics fused into the attention pass (issue 22, opt-in ``fuse_statistics=True``): a prompt forward whose
scorer needs column sums (H2O, EMS, CAOTE over H2O) and that can evict gets its output and the sums from one
blockwise pass.

Against the same cache with the fusion switched off (SDPA, then the statistic on its own): the column sums are
bit-identical, so the kept entries are the same; the logits agree within float32 rounding (1e-5) on every
architecture, with left padding, soft-capping (Gemma2) and sinks (GPT-OSS); a forward that cannot evict is
not fused (its output stays SDPA's, bit-identical to plain transformers: ``test_equivalence``).
"""

from __future__ import annotations

import pytest
import torch
from conftest import ALL_ARCHS, build_model
from helpers import all_kept_positions, left_pad, prompt

import kvsieve
from kvsieve.engine.engine import Engine
from kvsieve.transformers_adapter import cache_kwargs

CASES = [("h2o", {"budget": 24}), ("ems", {"budget": 40}), ("h2o_caote", {"budget": 24}),
         ("h2o", {"ratio": 0.5}), ("h2o", {"budget": 24, "schedule": "blockwise", "block_size": 16})]


def _prefill(model, policy: str, params: dict, fused: bool, monkeypatch) -> tuple[torch.Tensor, list, int]:
    """Logits at the real (non-padding) positions, kept positions per (layer, row, head), fused forwards."""
    calls = []
    original = Engine._fuses_statistics

    def spy(self, call, step):
        decided = original(self, call, step) and fused
        calls.append(decided)
        return decided

    monkeypatch.setattr(Engine, "_fuses_statistics", spy)
    ids, mask, _ = left_pad([prompt(1, 70, seed=1)[0], prompt(1, 53, seed=2)[0]])
    cache = kvsieve.KVCache(model, policy, fuse_statistics=True, **params)
    logits = model(ids, attention_mask=mask, **cache_kwargs(model, cache)).logits[mask.bool()]
    cache.flush()
    kept = [positions.tolist() for *_, positions in all_kept_positions(cache)]
    monkeypatch.setattr(Engine, "_fuses_statistics", original)
    return logits, kept, sum(calls)


@pytest.mark.parametrize("arch", ALL_ARCHS)
@pytest.mark.parametrize(("policy", "params"), CASES[:1])
def test_fused_prefill_equals_unfused_on_every_architecture(arch, policy, params, monkeypatch):
    model = build_model(arch)
    fused_logits, fused_kept, fused_calls = _prefill(model, policy, params, True, monkeypatch)
    plain_logits, plain_kept, plain_calls = _prefill(model, policy, params, False, monkeypatch)
    assert fused_calls > 0 and plain_calls == 0
    assert fused_kept == plain_kept
    torch.testing.assert_close(fused_logits, plain_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("policy", "params"), CASES)
def test_fused_prefill_equals_unfused_for_every_column_sum_scorer(policy, params, monkeypatch):
    model = build_model("llama")
    fused_logits, fused_kept, fused_calls = _prefill(model, policy, params, True, monkeypatch)
    plain_logits, plain_kept, _ = _prefill(model, policy, params, False, monkeypatch)
    assert fused_calls > 0
    assert fused_kept == plain_kept
    torch.testing.assert_close(fused_logits, plain_logits, atol=1e-5, rtol=1e-5)


def test_a_forward_that_cannot_evict_is_not_fused(monkeypatch):
    model = build_model("llama")
    with pytest.warns(UserWarning, match="nothing was compressed"):
        _, _, calls = _prefill(model, "h2o", {"budget": 200}, True, monkeypatch)
    assert calls == 0


def test_fusion_is_opt_in_and_refused_by_shared_prefill():
    model = build_model("llama")
    assert not kvsieve.KVCache(model, "h2o", budget=24).policy.fuse_statistics
    with pytest.raises(kvsieve.PolicyConfigError, match="fuse_statistics must be True or False"):
        kvsieve.KVCache(model, "h2o", budget=24, fuse_statistics="yes")
    from kvsieve.engine.shared_prefill import prefill_shared

    caches = [kvsieve.KVCache(model, "full"), kvsieve.KVCache(model, "h2o", budget=24, fuse_statistics=True)]
    with pytest.raises(ValueError, match=r"caches\[1\] \(h2o\) fuses its statistics"):
        prefill_shared(model, prompt(1, 40), caches)
