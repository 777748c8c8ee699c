"""With nothing evicted, kvsieve must reproduce plain transformers (sdpa + DynamicCache).

Exactness: forward logits are bit-identical (``torch.equal``) for every architecture, and so are greedy
tokens and per-step logits, except Gemma3's per-step decoding logits, compared with ``atol=1e-5``
(observed ≤ 3e-7): its sliding-window layers hold one entry more than transformers'
``DynamicSlidingWindowLayer`` (the oldest, always masked; see
``test_budgets.test_sliding_layers_hold_only_visible_entries``), so SDPA reduces over a differently
sized key set. With that fixed, these steps are bit-identical too and the tolerance can go.
"""

from __future__ import annotations

import pytest
import torch
from conftest import ALL_ARCHS, build_model
from helpers import generate, kvsieve_warnings, managed_layers, prompt, reference_cache, sliding_layers
from transformers import DynamicCache

import kvsieve
from kvsieve.transformers_adapter import cache_kwargs

pytestmark = pytest.mark.compat  # runs in the transformers-version matrix (scripts/compat_matrix.sh)

PROMPT_LEN, STEPS = 24, 6
GEMMA3_DECODE_ATOL = 1e-5

#: (policy, params, whether the "nothing was compressed" warning is due)
NO_EVICTION = {
    "full": ("full", {}, False),
    "snapkv-budget-ge-prompt": ("snapkv", {"budget": PROMPT_LEN + 8, "window": 4}, True),
    "snapkv-budget-eq-prompt": ("snapkv", {"budget": PROMPT_LEN, "window": 4}, True),
    "snapkv-ratio0": ("snapkv", {"ratio": 0.0}, True),
    "h2o-ratio0": ("h2o", {"ratio": 0.0}, True),
    "streaming-decode-budget-ge-total": ("streaming_llm", {"budget": 64, "schedule": "decode"}, False),
    "tova-decode-budget-ge-total": ("tova", {"budget": 64, "schedule": "decode", "buffer": 2}, False),
}


def assert_logits_match(arch: str, ours: list[torch.Tensor], ref: list[torch.Tensor], first_exact: bool = True) -> None:
    """Bit-identical, except gemma3 steps that read its sliding layers' history (atol 1e-5)."""
    assert len(ours) == len(ref)
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if arch == "gemma3" and (step > 0 or not first_exact):
            torch.testing.assert_close(a, b, atol=GEMMA3_DECODE_ATOL, rtol=0, msg=f"step {step}")
        else:
            assert torch.equal(a, b), f"step {step}: max diff {(a - b).abs().max().item():.3e}"


@pytest.mark.parametrize("case", list(NO_EVICTION))
def test_forward_logits_identical(arch, model, ref_model, case):
    policy, params, warns = NO_EVICTION[case]
    ids = prompt(batch=2, length=PROMPT_LEN, seed=1)
    _, ref_logits = reference_cache(ref_model, ids)
    cache = kvsieve.KVCache(model, policy, **params)
    if warns:
        with pytest.warns(UserWarning, match="nothing was compressed"):
            logits = model(ids, **cache_kwargs(model, cache)).logits
    else:
        with kvsieve_warnings() as messages:
            logits = model(ids, **cache_kwargs(model, cache)).logits
        assert messages == []
    assert torch.equal(logits, ref_logits)
    assert cache.get_seq_length() == PROMPT_LEN
    # nothing evicted: managed layers hold the whole prompt
    lengths = cache.head_lengths()
    assert (lengths[managed_layers(cache)] == PROMPT_LEN).all()


@pytest.mark.parametrize("case", list(NO_EVICTION))
def test_generate_identical(arch, model, ref_model, case):
    policy, params, warns = NO_EVICTION[case]
    ids = prompt(batch=2, length=PROMPT_LEN, seed=2)
    ref_seq, ref_logits = generate(ref_model, ids, DynamicCache(config=ref_model.config), STEPS)
    cache = kvsieve.KVCache(model, policy, **params)
    if warns:
        with pytest.warns(UserWarning, match="nothing was compressed"):
            seq, logits = generate(model, ids, cache, STEPS)
    else:
        seq, logits = generate(model, ids, cache, STEPS)
    assert torch.equal(seq, ref_seq)
    assert_logits_match(arch, logits, ref_logits)
    assert cache.get_seq_length() == PROMPT_LEN + STEPS - 1


def test_noop_warning_only_once_per_cache(model):
    """The no-op warning is emitted once (first managed layer, first prefill), not per layer/step."""
    cache = kvsieve.KVCache(model, "snapkv", budget=64, window=4)
    with kvsieve_warnings() as messages:
        generate(model, prompt(length=12), cache, 3)
        model(prompt(length=5, seed=9), **cache_kwargs(model, cache))  # a second chunk, still under budget
    assert len(messages) == 1
    assert "nothing was compressed" in messages[0]


def test_real_eviction_does_not_warn(model):
    cache = kvsieve.KVCache(model, "snapkv", budget=8, window=4)
    with kvsieve_warnings() as messages:
        model(prompt(length=PROMPT_LEN), **cache_kwargs(model, cache))
    assert messages == []


def test_pyramidkv_no_warning_when_deeper_layers_compress():
    """pyramidkv(budget=8, window=4) on 3 layers: layer budgets 12, 8, 4. An 11-token prompt fits
    layer 0 but layers 1 and 2 are compressed, so "nothing was compressed" would be false."""
    from conftest import get_model

    model = get_model("llama", "kv")
    cache = kvsieve.KVCache(model, "pyramidkv", budget=8, window=4)
    with kvsieve_warnings() as messages:
        model(prompt(length=11), **cache_kwargs(model, cache))
    assert cache.head_lengths()[:, 0, 0].tolist() == [11, 8, 4]  # really compressed
    assert not any("nothing was compressed" in m for m in messages), messages


def test_prepared_model_without_kvsieve_cache_is_plain_sdpa(arch, ref_model, fresh_model):
    """``prepare_model`` alone changes nothing: forward (padded and not) and default-cache generate."""
    model = kvsieve.prepare_model(fresh_model(arch))
    assert model.config._attn_implementation == "kvsieve"
    ids = prompt(batch=2, length=20, seed=3)
    assert torch.equal(model(ids).logits, ref_model(ids).logits)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    ours, ref = model(ids, attention_mask=mask).logits, ref_model(ids, attention_mask=mask).logits
    real = mask.bool()
    assert torch.equal(ours[real], ref[real])
    seq, logits = generate(model, ids, None, 5, attention_mask=mask)
    ref_seq, ref_logits = generate(ref_model, ids, None, 5, attention_mask=mask)
    assert torch.equal(seq, ref_seq)
    for a, b in zip(logits, ref_logits, strict=True):
        assert torch.equal(a, b)


def test_full_kv_bytes_equal_dynamic_cache(arch, model, ref_model):
    """A ``full`` cache holds exactly the K/V bytes a DynamicCache holds (same entries, no padding)."""
    ids = prompt(batch=2, length=PROMPT_LEN, seed=4)
    dyn, _ = reference_cache(ref_model, ids)
    cache = kvsieve.KVCache(model, "full")
    model(ids, **cache_kwargs(model, cache))
    layers = managed_layers(cache)  # sliding layers: see test_budgets.test_sliding_layers_*
    expected = sum(dyn.layers[i].keys.nbytes + dyn.layers[i].values.nbytes for i in layers)
    held = int(cache.head_lengths()[layers].sum())
    assert held * 2 * cache.info.head_dim * 4 == expected  # fp32 keys + values
    if not sliding_layers(cache):
        assert cache.kv_nbytes() == expected


# ---------------------------------------------------------------------------------------- exact_topk


def test_exact_topk_with_budget_ge_context_matches_full(arch, model):
    """k ≥ every context length: selection is a no-op (fp32 softmax vs SDPA: atol 1e-5)."""
    ids = prompt(batch=2, length=20, seed=5)
    full_cache = kvsieve.KVCache(model, "full")
    full_seq, full_logits = generate(model, ids, full_cache, STEPS)
    cache = kvsieve.KVCache(model, "exact_topk", budget=64)
    seq, logits = generate(model, ids, cache, STEPS)
    assert torch.equal(seq, full_seq)
    for a, b in zip(logits, full_logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert torch.equal(cache.head_lengths(), full_cache.head_lengths())


def test_exact_topk_small_budget_differs_but_keeps_everything(arch, model):
    ids = prompt(batch=2, length=20, seed=5)
    full_cache = kvsieve.KVCache(model, "full")
    _, full_logits = generate(model, ids, full_cache, STEPS)
    cache = kvsieve.KVCache(model, "exact_topk", budget=4)
    _, logits = generate(model, ids, cache, STEPS)
    # prefill attention is dense: the first step is identical
    assert torch.equal(logits[0], full_logits[0])
    # decoding attention is sparse: later steps differ
    assert max((a - b).abs().max().item() for a, b in zip(logits[1:], full_logits[1:], strict=True)) > 1e-3
    # selection, not eviction: every entry is still held, same bytes
    assert torch.equal(cache.head_lengths(), full_cache.head_lengths())
    assert cache.kv_nbytes() == full_cache.kv_nbytes()
    for layer in range(cache.head_lengths().shape[0]):
        assert torch.equal(cache.kept_positions(layer, 1, 1), full_cache.kept_positions(layer, 1, 1))


@pytest.mark.parametrize("padded", [False, True])
def test_topk_attention_matches_manual_selection(padded):
    """Unit check of the selection kernel (``ExactTopK.select`` + ``attend(subset=...)``) against a
    hand-written top-k softmax; with ``padded``, batch row 1 holds only its last ``length - 3`` entries."""
    from kvsieve.attention.kernel import attend
    from kvsieve.cache.store import LayerStore
    from kvsieve.core.step import LayerStep
    from kvsieve.models.architectures import ArchitectureSpec, ModelInfo
    from kvsieve.parts.selectors.exact_topk import ExactTopK

    generator = torch.Generator().manual_seed(0)
    batch, kv_heads, groups, length, dim, k = 2, 2, 2, 11, 8, 3
    query = torch.randn(batch, kv_heads * groups, 1, dim, generator=generator)
    keys = torch.randn(batch, kv_heads, length, dim, generator=generator)
    values = torch.randn(batch, kv_heads, length, dim, generator=generator)
    scaling = dim**-0.5
    token_valid = None
    if padded:
        token_valid = torch.ones(batch, length, dtype=torch.bool)
        token_valid[1, :3] = False
    store = LayerStore(batch, kv_heads, dim, torch.float32, torch.device("cpu"))
    store.append(keys, values, 0, token_valid)
    info = ModelInfo(ArchitectureSpec(), 1, kv_heads * groups, kv_heads, dim, (None,))
    step = LayerStep(module=None, layer_idx=0, info=info, query=query, first_position=length - 1,
                     query_valid=None, store=store, scaling=scaling)
    view = step.view
    subset = ExactTopK(k).select(step)
    assert subset is not None and subset.shape == (batch, kv_heads * groups, k)
    out = attend(None, query, view.keys, view.values, None, scaling, subset=subset, key_valid=view.valid)
    assert out.shape == (batch, 1, kv_heads * groups, dim)
    for b in range(batch):
        first = 3 if padded and b == 1 else 0
        for qh in range(kv_heads * groups):
            kh = qh // groups
            logits = keys[b, kh, first:] @ query[b, qh, 0] * scaling
            top = torch.topk(logits, k).indices
            # the selected dense-view slots hold exactly the top-k entries (by absolute position)
            assert sorted(view.positions[b, kh, subset[b, qh]].tolist()) == sorted((top + first).tolist())
            probs = torch.softmax(logits[top], dim=0)
            expected = probs @ values[b, kh, first:][top]
            torch.testing.assert_close(out[b, 0, qh], expected, atol=1e-6, rtol=1e-5)
    assert ExactTopK(length).select(step) is None  # k ≥ held: attend to everything


# ------------------------------------------------------------------------ beam search and multi-turn


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_beam_search_full_matches_sdpa(arch):
    """Beam search reorders the cache every step (``reorder_cache`` → ``select_batch``)."""
    from conftest import get_model

    model, ref_model = get_model(arch, "kv"), get_model(arch, "ref")
    ids = prompt(batch=2, length=20, seed=6)
    kwargs = {"max_new_tokens": 6, "num_beams": 3, "do_sample": False}
    expected = ref_model.generate(ids, **cache_kwargs(ref_model, DynamicCache(config=ref_model.config)), **kwargs)
    cache = kvsieve.KVCache(model, "full")
    assert torch.equal(model.generate(ids, **cache_kwargs(model, cache), **kwargs), expected)
    assert cache.head_lengths().shape[1] == 2 * 3


@pytest.mark.parametrize("policy", ["snapkv", "adakv", "h2o"])
def test_beam_search_with_compression_keeps_budget(model, policy):
    params = {"budget": 8, "window": 4} if policy != "h2o" else {"budget": 8, "schedule": "decode", "buffer": 1}
    cache = kvsieve.KVCache(model, policy, **params)
    ids = prompt(batch=2, length=20, seed=7)
    out = model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=5, num_beams=3, do_sample=False)
    assert out.shape == (2, 25)
    lengths = cache.head_lengths()[managed_layers(cache)]
    assert lengths.shape[1] == 6
    if policy == "adakv":  # ragged heads; per layer and beam: heads × (budget + 4 decoded tokens)
        assert (lengths.sum(-1) == 2 * 8 + 2 * 4).all()
    elif policy == "h2o":  # decoding-time eviction: budget ≤ held ≤ budget + buffer
        assert ((lengths >= 8) & (lengths <= 8 + 1)).all()
    else:
        assert (lengths == 8 + 4).all()


def test_multi_turn_generate_full_matches_sdpa(arch, model, ref_model):
    """A second ``generate`` on the same cache only feeds the unseen tokens (logical length)."""
    ids, turn = prompt(length=20, seed=8), prompt(length=7, seed=9)
    dyn = DynamicCache(config=ref_model.config)
    ref_first, _ = generate(ref_model, ids, dyn, 5)
    ref_seq, ref_logits = generate(ref_model, torch.cat([ref_first, turn], 1), dyn, 5)
    cache = kvsieve.KVCache(model, "full")
    first, _ = generate(model, ids, cache, 5)
    seq, logits = generate(model, torch.cat([first, turn], 1), cache, 5)
    assert torch.equal(seq, ref_seq)
    assert_logits_match(arch, logits, ref_logits, first_exact=False)
    assert cache.get_seq_length() == dyn.get_seq_length() == 20 + 5 + 7 + 4


def _plain_step_equals_general(model, ids, make_cache, monkeypatch) -> tuple[list[bool], kvsieve.KVCache]:
    """Generate with the plain decoding step (recording, per decoding forward of a layer, whether it served it), then
    with it switched off (the general step), and check the two bit for bit; the plain run's calls and cache."""
    from kvsieve.engine.engine import Engine

    original = Engine._plain_decoding_step
    taken: list[bool] = []

    def counted(self, *args):
        output = original(self, *args)
        taken.append(output is not None)
        return output

    monkeypatch.setattr(Engine, "_plain_decoding_step", counted)
    cache = make_cache()
    with kvsieve_warnings():
        fast_seq, fast_logits = generate(model, ids, cache, STEPS)
    monkeypatch.setattr(Engine, "_plain_decoding_step", lambda self, *args: None)
    with kvsieve_warnings():
        general_seq, general_logits = generate(model, ids, make_cache(), STEPS)
    assert torch.equal(fast_seq, general_seq)
    for fast, general in zip(fast_logits, general_logits, strict=True):
        assert torch.equal(fast, general)
    return taken, cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_decoding_step_takes_the_plain_path_and_equals_the_general_step(arch, fresh_model, dtype, monkeypatch):
    """``full`` decodes through :meth:`Engine._plain_decoding_step` (append in place, transformers' SDPA call) on
    its uniform layers: bit for bit what the general step (describe, attend, observe, plan) gives it."""
    model = fresh_model(arch).to(dtype)
    ids = prompt(batch=2, length=PROMPT_LEN, seed=4)
    taken, cache = _plain_step_equals_general(model, ids, lambda: kvsieve.KVCache(model, "full"), monkeypatch)
    # every decoding forward of every layer but the sliding-window ones (they take the general step) ran it
    assert all(taken) and len(taken) == (STEPS - 1) * (len(cache.layers) - len(sliding_layers(cache)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("policy", "params"), [
    ("snapkv", {"budget": 12, "window": 4}), ("tova", {"budget": 12}), ("restkv", {"budget": 12, "window": 4}),
    ("adakv", {"budget": 12, "window": 4}),
])
def test_prefill_schedule_decoding_takes_the_plain_path_and_equals_the_general_step(
        arch, fresh_model, dtype, policy, params, monkeypatch):
    """A prefill-schedule policy whose scorer observes nothing decodes its compacted cache through the plain step
    (transformers' call, or the packed call in bfloat16 once compacted): bit for bit the general step."""
    model = fresh_model(arch).to(dtype)
    ids = prompt(batch=2, length=PROMPT_LEN, seed=5)
    taken, cache = _plain_step_equals_general(model, ids, lambda: kvsieve.KVCache(model, policy, **params),
                                              monkeypatch)
    assert int(cache.head_lengths()[managed_layers(cache)].max()) < PROMPT_LEN  # compacted at the prompt
    assert sum(taken) == (STEPS - 1) * (len(cache.layers) - len(sliding_layers(cache)))
    if policy == "adakv":  # heads of different lengths: ragged layouts decode through the plain step too
        assert any(not layer.store.is_uniform for layer in cache.layers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("policy", "params"), [
    ("mixed", {"budget": 8, "window": 2, "group": 4, "value_group": 8}),
    ("snapkv", {"budget": 8, "action": "quantize", "bits": (4, 2), "low_share": (0.25, 0.25), "window": 2, "group": 4,
                "value_group": 8}),
    ("adakv", {"budget": 8, "action": "quantize", "bits": 2, "low_share": 0.5, "window": 2, "group": 4,
               "value_group": 8}),  # heads holding different numbers of quantized groups: the view's validity
])
def test_quantized_tiers_decode_through_the_plain_step_and_equal_the_general_step(
        arch, fresh_model, dtype, policy, params, monkeypatch):
    """A prefill-schedule policy with a quantizing action decodes through the plain step once its prompt left
    quantized tiers (every held entry in the tiers' attention view, dequantized per step): bit for bit the
    general step."""
    model = fresh_model(arch).to(dtype)
    ids = prompt(batch=2, length=PROMPT_LEN, seed=6)
    taken, cache = _plain_step_equals_general(model, ids, lambda: kvsieve.KVCache(model, policy, **params),
                                              monkeypatch)
    assert any(cache.layers[i].store.tiered for i in managed_layers(cache))
    assert sum(taken) == (STEPS - 1) * (len(cache.layers) - len(sliding_layers(cache)))
    assert all(layer.store.view_nbytes() == 0 for layer in cache.layers)  # no step's view is held after it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("policy", "params"), [
    ("dbtrimkv", {"budget": 10, "window": 2, "buffer": 3}), ("trimkv", {"budget": 10, "window": 2, "buffer": 3}),
])
def test_deferring_scorer_decodes_plainly_between_its_plans_and_equals_the_general_step(
        arch, fresh_model, dtype, policy, params, monkeypatch):
    """The retention gates only defer side data at a decoding step: a step that plans nothing takes the plain step
    (append, defer the gate's input, attend), a step whose schedule fires the general step; bit for bit the
    general step at every step, and the gates' ``log β`` the same."""
    from helpers import random_gates

    from kvsieve.engine.engine import Engine

    model = fresh_model(arch).to(dtype)
    gates = random_gates(model, tied=policy == "dbtrimkv")
    ids = prompt(batch=2, length=PROMPT_LEN, seed=6)
    taken, cache = _plain_step_equals_general(model, ids, lambda: kvsieve.KVCache(model, policy, gates=gates,
                                                                                  **params), monkeypatch)
    plain_layers = len(cache.layers) - len(sliding_layers(cache))
    assert sum(taken) > 0 and sum(taken) < len(taken)  # plain between plans, general when the schedule fires
    assert sum(taken) >= (STEPS - 1) * plain_layers // 2
    monkeypatch.undo()
    general = kvsieve.KVCache(model, policy, gates=gates, **params)
    monkeypatch.setattr(Engine, "_plain_decoding_step", lambda self, *args: None)
    with kvsieve_warnings():
        generate(model, ids, general, STEPS)
    for layer in managed_layers(cache):
        a, b = cache.layers[layer].store.dense(), general.layers[layer].store.dense()
        valid = torch.ones(a.positions.shape, dtype=torch.bool) if a.valid is None else a.valid
        assert torch.equal(a.positions[valid], b.positions[valid])
        assert torch.equal(a.extras["log_beta"][valid], b.extras["log_beta"][valid])


def test_a_policy_that_observes_or_compacts_while_decoding_takes_the_general_step(fresh_model, monkeypatch):
    from kvsieve.engine.engine import Engine

    model = fresh_model("llama")
    calls: list[bool] = []
    original = Engine._plain_decoding_step
    monkeypatch.setattr(Engine, "_plain_decoding_step", lambda self, *args: calls.append(True) or original(self, *args))
    for policy, params in (("h2o", {"budget": 12}), ("tova", {"budget": 12, "schedule": "decode"}),
                           ("snapkv", {"budget": 12, "window": 4, "selector": "quest"})):
        with kvsieve_warnings():
            generate(model, prompt(batch=1, length=PROMPT_LEN, seed=6), kvsieve.KVCache(model, policy, **params), 3)
    assert calls == []


@pytest.mark.parametrize("layout", ["padded", "compact", "strided"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("native", [True, False])
def test_ragged_plain_decoding_equals_the_general_step_in_every_layout(fresh_model, layout, dtype, native,
                                                                       monkeypatch):
    """adakv's ragged heads laid out padded, compact (one dense view per step) or in strided runs (forced): the plain
    decoding step gives the general step's logits bit for bit, through the CPU's C pass over each segment's rows or
    (``native`` False) the PyTorch routes."""
    from kvsieve.cache.store_compaction import StoreCompaction
    from kvsieve.native import segment_attention

    if not native:
        monkeypatch.setattr(segment_attention, "attend", lambda *args, **kwargs: None)

    def two_runs(self, counts):
        if counts.numel() < 2 or int(counts.min()) == int(counts.max()):
            return None
        order = torch.argsort(counts, stable=True).tolist()
        return (tuple(sorted(order[: len(order) // 2])), tuple(sorted(order[len(order) // 2 :])))

    monkeypatch.setattr(StoreCompaction, "pads", lambda self, counts, on=layout == "padded": on)
    monkeypatch.setattr(StoreCompaction, "plan_runs", two_runs if layout == "strided" else lambda self, counts: None)
    model = fresh_model("llama").to(dtype)
    ids = prompt(batch=2, length=PROMPT_LEN, seed=7)
    _, cache = _plain_step_equals_general(model, ids, lambda: kvsieve.KVCache(model, "adakv", budget=12, window=4),
                                          monkeypatch)
    kinds = {"padded": "is_padded", "strided": "runs", "compact": None}
    ragged = [layer.store for layer in cache.layers if not layer.store.is_uniform]
    assert ragged and all(
        (not s.is_padded and s.runs is None) if kinds[layout] is None else getattr(s, kinds[layout]) for s in ragged)



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kvzip_decodes_plainly_once_reconstructed_and_equals_the_general_step(arch, fresh_model, dtype, monkeypatch):
    """KVzip's scorer observes probe forwards only: once its reconstruction compressed the context, its ragged heads
    decode through the plain step (their score appended at its fill), bit for bit the general step; before its
    probe the general step runs (and warns)."""
    from test_row_independence import CharTokenizer

    from kvsieve.engine.engine import Engine
    from kvsieve.generation.reconstruction import reconstruct

    original = Engine._plain_decoding_step
    model = fresh_model(arch).to(dtype)
    ids = prompt(batch=2, length=PROMPT_LEN, seed=8)

    def reconstructed() -> kvsieve.KVCache:  # the context, then its probe; generate() feeds the last token on
        cache = kvsieve.KVCache(model, "kvzip", budget=12)
        with torch.inference_mode():
            model(ids[:, :-1], **cache_kwargs(model, cache))
            reconstruct(model, CharTokenizer(), cache, ids[:, :-1])
        return cache

    taken, cache = _plain_step_equals_general(model, ids, reconstructed, monkeypatch)
    assert int(cache.head_lengths()[managed_layers(cache)].min()) < PROMPT_LEN - 1  # compressed by its probe
    assert any(not layer.store.is_uniform for layer in cache.layers)
    assert sum(taken) == STEPS * (len(cache.layers) - len(sliding_layers(cache)))
    assert set(cache.layers[managed_layers(cache)[0]].store.extras) == {"kvzip_score"}
    served: list[bool] = []
    monkeypatch.setattr(Engine, "_plain_decoding_step",
                        lambda self, *args: served.append(original(self, *args) is not None))  # None: general step
    with pytest.warns(UserWarning, match="reconstruct"):
        generate(model, ids, kvsieve.KVCache(model, "kvzip", budget=12), 2)
    assert served and not any(served)


def test_a_merging_action_keeps_the_general_step_for_its_merge_counts(fresh_model, monkeypatch):
    """snapkv's scores with the ``merge`` action: merged entries carry a count (side data the attention reads as a
    ``log n`` bias), so its decoding takes the general step, which is what the plain step's guard leaves it."""
    model = fresh_model("llama")
    ids = prompt(batch=2, length=PROMPT_LEN, seed=9)
    taken, cache = _plain_step_equals_general(
        model, ids, lambda: kvsieve.KVCache(model, "snapkv", budget=12, window=4, action="merge"), monkeypatch)
    assert taken and not any(taken)
    assert "merge_count" in cache.layers[managed_layers(cache)[0]].store.extras



@pytest.mark.parametrize(("policy", "params"), [
    ("full", {}), ("snapkv", {"budget": 12, "window": 4}), ("h2o", {"budget": 12, "schedule": "decode"}),
])
@pytest.mark.parametrize("arch_name", ALL_ARCHS)
def test_a_decoding_call_that_sdpas_form_serves_goes_straight_to_the_decoding_route(arch_name, policy, params,
                                                                                   monkeypatch):
    """The attention function hands a decoding call of a layer without a sliding window, soft-capping or sinks to
    ``Engine.attend_decoding`` directly (issue 22: the general entry's layers of checks were ~1% of a small model's
    step); a sliding-window layer's decoding calls, a soft-capped (Gemma2) or sink (GPT-OSS) model's, and every
    prompt's go through ``Engine.attend``. ``full`` still gives plain transformers' tokens and logits bit for bit."""
    from kvsieve.engine.engine import Engine

    model = build_model(arch_name)
    calls: list[tuple[str, int]] = []
    inside = [False]
    attend, attend_decoding = Engine.attend, Engine.attend_decoding

    def spied_attend(self, layer, module, query, *args):
        calls.append(("attend", layer.layer_idx))
        inside[0] = True
        try:
            return attend(self, layer, module, query, *args)
        finally:
            inside[0] = False

    def spied_attend_decoding(self, layer, *args):
        if not inside[0]:
            calls.append(("direct", layer.layer_idx))
        return attend_decoding(self, layer, *args)

    monkeypatch.setattr(Engine, "attend", spied_attend)
    monkeypatch.setattr(Engine, "attend_decoding", spied_attend_decoding)
    cache = kvsieve.KVCache(model, policy, **params)
    ids = prompt(batch=2, length=PROMPT_LEN, seed=7)
    with kvsieve_warnings():
        seq, logits = generate(model, ids, cache, STEPS)
    layers = len(cache.layers)
    explicit = arch_name in ("gemma2", "gpt_oss")  # soft-capping / learned sinks: not SDPA's form
    direct = [] if explicit else [i for i in range(layers) if i not in sliding_layers(cache)]
    general = [i for i in range(layers) if i not in direct]
    expected = [("attend", i) for i in range(layers)]  # the prompt
    for _ in range(STEPS - 1):
        expected += [("direct" if i in direct else "attend", i) for i in range(layers)]
    assert calls == expected
    assert len(general) < layers or explicit
    if policy == "full":
        ref = build_model(arch_name)
        ref_seq, ref_logits = generate(ref, ids, DynamicCache(config=ref.config), STEPS)
        assert torch.equal(seq, ref_seq)
        for ours, theirs in zip(logits, ref_logits, strict=True):
            assert torch.equal(ours, theirs)
