"""EMS (Li et al., 2024, arXiv:2412.08521): Global-Local score (Eq. 2, decoding window swap), head-wise
evict-then-merge with a zero class (Sec. 4.2), raw keys through the rotary table, budgets at every step, and memory."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import build_model
from helpers import decode_loop, left_pad, prompt
from transformers import LlamaConfig, Phi3Config

import kvsieve
from kvsieve.attention.kernel import attend, output_mask
from kvsieve.cache.store import LayerStore
from kvsieve.core.step import MERGE_COUNT
from kvsieve.ops.rope import UnsupportedRotaryError, rotary_table, rotate, unrotate
from kvsieve.parts.actions.base import Evict
from kvsieve.parts.actions.evict_merge import EvictThenMerge
from kvsieve.parts.actions.evict_merge_pos import POSITION_TABLE, EvictThenMergePos
from kvsieve.parts.actions.merge import Merge
from kvsieve.parts.scorers.global_local import GLOBAL, LOCAL_CUR, LOCAL_PAST, LOCAL_ROWS, GlobalLocal, global_local
from kvsieve.policies import Policy, make_policy
from kvsieve.transformers_adapter import cache_kwargs


# ---------------------------------------------------------------------------------------------- Eq. 2
def test_global_local_hand_computed():
    glo = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])
    loc = torch.tensor([[[0.0, 0.0, 4.0, 4.0]]])
    valid = torch.ones(1, 1, 4, dtype=torch.bool)
    # mean(loc)/mean(glo) = 2/2.5 = 0.8 → glo·0.8 = [0.8, 1.6, 2.4, 3.2]; element-wise max with loc
    expected = torch.tensor([[[0.8, 1.6, 4.0, 4.0]]], dtype=torch.float64)  # computed in float64 (merge.c's too)
    torch.testing.assert_close(global_local(glo, loc, valid), expected)
    # padding entries take no part in the means
    glo_p = torch.cat([glo, torch.tensor([[[100.0]]])], -1)
    loc_p = torch.cat([loc, torch.tensor([[[100.0]]])], -1)
    valid_p = torch.tensor([[[True, True, True, True, False]]])
    torch.testing.assert_close(global_local(glo_p, loc_p, valid_p)[..., :4], expected)


class _Step(SimpleNamespace):
    """The part of a LayerStep the scorer reads, fed by hand."""

    def entry_valid(self):
        return torch.ones(self.view.positions.shape, dtype=torch.bool)

    def all_column_sums(self):
        return self.row

    def window_rows(self, window):
        return self.rows[:, :, -window:]

    def window_column_sums(self, window):
        return self.window_rows(window).sum(dim=2)

    def lengths(self):
        return torch.full(self.view.positions.shape[:2], self.view.positions.shape[-1])


def _store(length: int) -> LayerStore:
    store = LayerStore(1, 1, 2, torch.float32, torch.device("cpu"))
    for spec in GlobalLocal.SIDE:
        store.ensure_side(spec)
    store.append(torch.zeros(1, 1, length, 2), torch.zeros(1, 1, length, 2), 0, None)
    return store


def test_local_score_window_swap_by_hand():
    """Sec. 3.3: past = the prompt's last w rows; cur accumulates; after w decoding rows cur becomes past."""
    scorer, n = GlobalLocal(window=2, kernel_size=1), 4
    store = _store(n)
    prompt_rows = torch.arange(12.0).view(1, 1, 3, n)
    step = _Step(view=store.dense(), kv_heads=1, q_len=3, row=prompt_rows.sum(2), rows=prompt_rows)
    for name, delta in scorer.observe(step).items():
        store.add_dense(name, delta)
    extras = store.dense().extras
    torch.testing.assert_close(extras[LOCAL_PAST][0, 0], prompt_rows[0, 0, 1:].sum(0))
    torch.testing.assert_close(extras[GLOBAL][0, 0], prompt_rows[0, 0].sum(0))
    decoded = [torch.tensor([[[1.0, 0, 0, 0]]]), torch.tensor([[[0, 2.0, 0, 0]]]), torch.tensor([[[0, 0, 3.0, 0]]])]
    first_two = decoded[0][0, 0] + decoded[1][0, 0]
    expected_past = [prompt_rows[0, 0, 1:].sum(0), first_two, first_two]
    expected_cur = [decoded[0][0, 0], torch.zeros(n), decoded[2][0, 0]]
    for row, past, cur in zip(decoded, expected_past, expected_cur, strict=True):
        step = _Step(view=store.dense(), kv_heads=1, q_len=1, row=row, rows=None)
        for name, delta in scorer.observe(step).items():
            store.add_dense(name, delta)
        extras = store.dense().extras
        torch.testing.assert_close(extras[LOCAL_PAST][0, 0], past)
        torch.testing.assert_close(extras[LOCAL_CUR][0, 0], cur)
    assert extras[LOCAL_ROWS][0, 0].tolist() == [1.0] * n
    total = prompt_rows[0, 0].sum(0) + sum(r[0, 0] for r in decoded)
    torch.testing.assert_close(extras[GLOBAL][0, 0], total)


def test_global_term_ablation_scores_the_local_term_alone():
    """``use_global=False``: the score is the pooled ``s_loc`` (the window rows' sum), whatever ``s_glo`` holds;
    with the global term, an entry the prompt attended to a lot but the window did not is still ranked."""
    n = 6
    store = _store(n)
    rows = torch.zeros(1, 1, 3, n)
    rows[0, 0, 0, 1] = 5.0  # only the first (non-window) query attends to entry 1
    rows[0, 0, 1:, 3] = 1.0  # the window's two queries attend to entry 3
    step = _Step(view=store.dense(), kv_heads=1, q_len=3, row=rows.sum(2), rows=rows)
    ablated, full = GlobalLocal(window=2, kernel_size=1, use_global=False), GlobalLocal(window=2, kernel_size=1)
    for name, delta in full.observe(step).items():
        store.add_dense(name, delta)
    step = _Step(view=store.dense(), kv_heads=1, q_len=3, row=rows.sum(2), rows=rows)
    local = ablated.raw(step, torch.zeros(1, 1, n))
    assert local[0, 0, :4].tolist() == [0.0, 0.0, 0.0, 2.0]  # the last 2 entries are the protected window
    assert full.raw(step, torch.zeros(1, 1, n))[0, 0, 1] > 0  # the global term keeps entry 1 in the running
    with pytest.raises(kvsieve.PolicyConfigError, match="use_global must be True or False"):
        GlobalLocal(use_global="no")


def test_decoding_window_swap_in_a_model():
    """New entries (fill 0) pick up the row count from the others; s_loc spans w … 2w − 1 decoding queries."""
    model = build_model("llama")
    cache = kvsieve.KVCache(model, "ems", budget=64, window=3)
    counts = []

    def record(_: int) -> None:
        counts.append(int(cache.layers[0].store.dense().extras[LOCAL_ROWS].amax()))
        assert bool((cache.layers[0].store.dense().extras[LOCAL_ROWS] == counts[-1]).all())

    decode_loop(model, cache, prompt(length=20), 7, after_step=record)
    assert counts == [0, 1, 2, 0, 1, 2, 0, 1]


def test_short_chunks_accumulate_like_decoding_rows():
    """A forward of fewer than ``window`` queries (streamed text) joins ``cur``; it swaps once ``cur`` holds ≥ w."""
    model = build_model("llama")
    cache = kvsieve.KVCache(model, "ems", budget=64, window=8)
    model(prompt(length=20), **cache_kwargs(model, cache))
    rows = []
    for seed in range(3):
        cache.flush()
        model(prompt(length=3, seed=seed), **cache_kwargs(model, cache))
        rows.append(int(cache.layers[0].store.dense().extras[LOCAL_ROWS].amax()))
    assert rows == [3, 6, 0]


# ---------------------------------------------------------------------------------------------- raw keys
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3"])
def test_unrotate_inverts_the_models_rotary(arch):
    """Raw-key recovery: the model's own rotation of a raw key, un-rotated, round-trips to 1e-5."""
    model = build_model(arch)
    layer = model.config.num_hidden_layers - 2  # gemma3: a full-attention (global rope) layer
    table = rotary_table(model.config, layer)
    positions = torch.arange(0, 3000, 7)[None, None]
    raw = torch.randn(1, 2, positions.shape[-1], table.rotary_dim)
    x = torch.zeros_like(raw)
    args = (x, positions[0]) if arch != "gemma3" else (x, positions[0], "full_attention")
    cos, sin = model.model.rotary_emb(*args)
    half = raw.shape[-1] // 2
    turned = raw * cos[:, None] + torch.cat((-raw[..., half:], raw[..., :half]), -1) * sin[:, None]
    torch.testing.assert_close(rotate(raw, positions, table), turned, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(unrotate(turned, positions, table), raw, atol=1e-5, rtol=1e-5)


def test_rotary_variants_partial_scaled_per_layer_type_and_refused():
    partial = Phi3Config(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1,
                         vocab_size=50, partial_rotary_factor=0.5)
    table = rotary_table(partial, 0)
    assert table.rotary_dim == 16
    keys, positions = torch.randn(3, 5, 32), torch.arange(5).expand(3, 5)
    turned = rotate(keys, positions, table)
    assert torch.equal(turned[..., 16:], keys[..., 16:])  # the pass-through half is untouched
    torch.testing.assert_close(unrotate(turned, positions, table), keys, atol=1e-5, rtol=1e-5)
    scaled = LlamaConfig(hidden_size=64, num_attention_heads=2, num_hidden_layers=1, vocab_size=50,
                         rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                          "original_max_position_embeddings": 64})
    table = rotary_table(scaled, 0)
    assert table.scaling != 1.0
    torch.testing.assert_close(unrotate(rotate(keys, positions, table), positions, table), keys, atol=1e-5, rtol=1e-5)
    gemma = build_model("gemma3")
    local, full = rotary_table(gemma.config, 0), rotary_table(gemma.config, 1)
    assert not torch.equal(local.inv_freq, full.inv_freq)  # local and global rope bases differ
    dynamic = LlamaConfig(hidden_size=64, num_attention_heads=2, num_hidden_layers=1, vocab_size=50,
                          rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(UnsupportedRotaryError, match="rope_type 'dynamic'"):
        rotary_table(dynamic, 0)


def test_unsupported_rope_refused_before_the_model_is_touched():
    model = build_model("llama")
    model.config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    before = model.config._attn_implementation
    with pytest.raises(UnsupportedRotaryError):
        kvsieve.KVCache(model, "ems", budget=8, window=2)
    assert model.config._attn_implementation == before


# ---------------------------------------------------------------------------------------------- merging
def test_centre_of_n_identical_copies_is_exact():
    """A centre that absorbed n copies of itself (same raw key and value, other positions) + log n bias gives
    the attention output of n copies of the centre."""
    torch.manual_seed(0)
    model = build_model("llama")
    table = rotary_table(model.config, 0)
    d = table.rotary_dim
    positions = torch.arange(10)
    raw = torch.randn(10, d)
    values = torch.randn(10, d)
    copies = [7, 8]  # entry 3 is the centre; 7 and 8 are copies of it at other positions
    raw[copies] = raw[3].clone()
    values[copies] = values[3].clone()
    keys = rotate(raw, positions, table)
    store = LayerStore(1, 1, d, torch.float32, torch.device("cpu"))
    store.ensure_side(EvictThenMerge.SIDE[0])
    store.append(keys[None, None], values[None, None], 0, None)
    scores = torch.tensor([[[0.9, 0.8, 0.1, 0.95, 0.05, 0.5, 0.02, 0.4, 0.3, float("inf")]]])
    step = SimpleNamespace(module=SimpleNamespace(config=model.config), layer_idx=0, view=store.dense())
    action = EvictThenMerge(gamma=2.0, tau=0.99)
    plan = action.plan(scores, torch.tensor([[5]]), step)  # keep 0, 1, 3, 9 + one more; TBM the next five
    action.apply(store, plan)
    view = store.dense()
    kept = view.positions[0, 0].tolist()
    assert kept == [0, 1, 3, 5, 9]
    count = view.extras[MERGE_COUNT][0, 0]
    assert count.tolist() == [1.0, 1.0, 3.0, 1.0, 1.0]  # 7 and 8 merged into 3, nothing else is that close
    torch.testing.assert_close(view.keys[0, 0, 2], keys[3], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(view.values[0, 0, 2], values[3], atol=1e-6, rtol=1e-6)
    query = torch.randn(1, 1, 1, d)
    expanded_k = torch.cat([view.keys[0, 0], keys[3].expand(2, d)])
    expanded_v = torch.cat([view.values[0, 0], values[3].expand(2, d)])
    module = torch.nn.Module()
    copies_out = attend(module, query, expanded_k[None, None], expanded_v[None, None], None, d**-0.5)
    bias = count.log()[None, None]
    mask = output_mask(lambda: torch.tensor([10]), lambda: view.positions, None, None, 1, bias, newest_query=True)
    merged_out = attend(module, query, view.keys, view.values, mask, d**-0.5)
    torch.testing.assert_close(merged_out, copies_out, atol=1e-5, rtol=1e-5)


def _run(model, policy, ids, steps=6, mask=None):
    cache = kvsieve.KVCache(model, policy)
    tokens, logits = decode_loop(model, cache, ids, steps, attention_mask=mask)
    return cache, tokens, logits


def _same_cache(a, b) -> None:
    for la, lb in zip(a.layers, b.layers, strict=True):
        va, vb = la.store.dense(), lb.store.dense()
        assert torch.equal(va.positions, vb.positions)
        assert torch.equal(va.keys, vb.keys) and torch.equal(va.values, vb.values)


@pytest.mark.parametrize("params", [{"tau": 1.0}, {"gamma": 1.0, "tau": -1.0}])
def test_tau_one_or_gamma_one_is_pure_eviction_by_the_same_score(params):
    """Bitwise equal to eviction through the merge executor with no assignments (same log-count path), and the
    same kept entries as plain ``Evict`` (whose logits differ only by the all-zero bias mask: ≤ 1e-5)."""
    model = build_model("llama")
    ids = prompt(length=40)
    ems = make_policy("ems", budget=12, window=4, **params)
    no_merge = Policy(scorer=GlobalLocal(window=4), action=Merge(), schedule="decode", budget=12, name="glo_merge")
    evict = Policy(scorer=GlobalLocal(window=4), action=Evict(), schedule="decode", budget=12, name="glo_evict")
    a, ta, la = _run(model, ems, ids)
    b, tb, lb = _run(model, no_merge, ids)
    c, tc, lc = _run(model, evict, ids)
    assert torch.equal(ta, tb) and all(torch.equal(x, y) for x, y in zip(la, lb, strict=True))
    _same_cache(a, b)
    for layer in a.layers:
        assert bool((layer.store.dense().extras[MERGE_COUNT] == 1).all())
    assert torch.equal(ta, tc)
    for x, y in zip(la, lc, strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    for la_, lc_ in zip(a.layers, c.layers, strict=True):
        assert torch.equal(la_.store.dense().positions, lc_.store.dense().positions)


def test_merging_happens_and_every_token_is_accounted_for():
    """γ = inf, τ = −1: nothing is evicted, every token seen is kept or merged (Σ counts = tokens seen)."""
    model = build_model("qwen2")
    ids = prompt(length=40)
    cache, _, _ = _run(model, make_policy("ems", budget=12, window=4, gamma=float("inf"), tau=-1.0), ids, steps=5)
    for layer in cache.layers:
        counts = layer.store.dense().extras[MERGE_COUNT]
        assert torch.equal(counts.sum(-1), torch.full_like(counts.sum(-1), 45.0))
        assert int(layer.store.max_length) == 12


@pytest.mark.parametrize("arch", ["llama", "gemma3", "phi3"])
def test_every_head_at_or_under_budget_at_every_step(arch):
    model = build_model(arch)
    ids, mask, _ = left_pad([prompt(length=40)[0], prompt(length=29, seed=1)[0]])
    cache = kvsieve.KVCache(model, "ems", budget=10, window=4)
    managed = cache.info.managed_layers
    merged = []

    def check(_: int) -> None:
        lengths = cache.head_lengths()[list(managed)]
        assert int(lengths.max()) <= 10
        seen = cache.get_seq_length()
        for i in managed:  # the local window is always held: the newest 4 slots of every head
            positions = cache.layers[i].store.dense().positions
            assert bool((positions[..., -4:] == torch.arange(seen - 4, seen)).all())
        merged.append(max(float(cache.layers[i].store.dense().extras[MERGE_COUNT].max()) for i in managed))

    decode_loop(model, cache, ids, 8, after_step=check, attention_mask=mask)
    assert max(merged) > 1  # something was merged along the way (τ = 0.6 on a random model)


def test_kv_nbytes_equal_snapkv_and_side_data_counted():
    model = build_model("llama")
    ids = prompt(length=40)
    ems = kvsieve.KVCache(model, "ems", budget=12, window=4, schedule="prefill")
    snap = kvsieve.KVCache(model, "snapkv", budget=12, window=4)
    model(ids, **cache_kwargs(model, ems))
    model(ids, **cache_kwargs(model, snap))
    assert ems.kv_nbytes() == snap.kv_nbytes()
    side = 5 * 4  # merge_count, s_glo, s_loc past/cur, row count: float32 each
    assert ems.used_nbytes - snap.used_nbytes == side * int(ems.head_lengths().sum())


def test_parameters_validated_at_construction():
    with pytest.raises(kvsieve.PolicyConfigError, match="gamma"):
        make_policy("ems", budget=8, gamma=0.5)
    with pytest.raises(kvsieve.PolicyConfigError, match="tau"):
        make_policy("ems", budget=8, tau=1.5)
    with pytest.raises(kvsieve.PolicyConfigError, match="kernel_size"):
        make_policy("ems", budget=8, kernel_size=4)
    with pytest.raises(kvsieve.PolicyConfigError, match="window"):
        make_policy("ems", budget=8, window=16)
    policy = make_policy("ems", budget=64)
    assert policy.schedule.name == "decode" and isinstance(policy.action, EvictThenMerge)
    action, scorer = policy.action, policy.scorer
    assert (action.gamma, action.tau, scorer.window, scorer.kernel_size) == (4.0, 0.6, 32, 7)


# ---------------------------------------------------------------------------------------------- ems_pos
def test_position_table_expansion_equals_the_original_tokens():
    """EMS w. pos: a centre that absorbed tokens with its raw key and value, expanded at attention time to
    their positions and re-rotated at each, gives the attention of the original tokens (to 1e-5)."""
    torch.manual_seed(1)
    model = build_model("llama")
    table = rotary_table(model.config, 0)
    d = table.rotary_dim
    positions = torch.arange(10)
    raw, values = torch.randn(10, d), torch.randn(10, d)
    raw[[7, 8]] = raw[3].clone()
    values[[7, 8]] = values[3].clone()
    keys = rotate(raw, positions, table)
    action = EvictThenMergePos(gamma=2.0, tau=0.99, table_width=2)
    store = LayerStore(1, 1, d, torch.float32, torch.device("cpu"))
    for spec in action.side():
        store.ensure_side(spec)
    store.append(keys[None, None], values[None, None], 0, None)
    scores = torch.tensor([[[0.9, 0.8, 0.1, 0.95, 0.05, 0.5, 0.02, 0.4, 0.3, float("inf")]]])
    step = SimpleNamespace(module=SimpleNamespace(config=model.config), layer_idx=0, view=store.dense())
    action.apply(store, action.plan(scores, torch.tensor([[5]]), step))
    view = store.dense()
    assert view.positions[0, 0].tolist() == [0, 1, 3, 5, 9]
    assert view.extras[POSITION_TABLE][0, 0, 2].tolist() == [8, 7]  # most recent first
    assert view.extras[MERGE_COUNT][0, 0].tolist() == [1.0, 1.0, 3.0, 1.0, 1.0]
    step = SimpleNamespace(module=SimpleNamespace(config=model.config), layer_idx=0, view=view)
    e_keys, e_values, e_positions, e_valid, e_bias = action.expanded(step)
    assert e_keys.shape[2] == 5 * 3 and int(e_valid.sum()) == 7
    query = torch.randn(1, 1, 1, d)
    mask = output_mask(lambda: torch.tensor([10]), lambda: e_positions, e_valid, None, 1, e_bias, newest_query=True)
    module = torch.nn.Module()
    expanded_out = attend(module, query, e_keys, e_values, mask, d**-0.5)
    kept = [0, 1, 3, 5, 9, 7, 8]
    original = attend(module, query, keys[kept][None, None], values[kept][None, None], None, d**-0.5)
    torch.testing.assert_close(expanded_out, original, atol=1e-5, rtol=1e-5)


def test_ems_pos_without_merges_matches_ems_and_costs_its_table():
    model = build_model("llama")
    ids = prompt(length=40)
    a, ta, la = _run(model, make_policy("ems_pos", budget=12, window=4, tau=1.0), ids)
    b, tb, lb = _run(model, make_policy("ems", budget=12, window=4, tau=1.0), ids)
    assert torch.equal(ta, tb)
    for x, y in zip(la, lb, strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    for layer_a, layer_b in zip(a.layers, b.layers, strict=True):
        assert torch.equal(layer_a.store.dense().positions, layer_b.store.dense().positions)
    assert a.kv_nbytes() == b.kv_nbytes()
    width = a.policy.action.width
    assert width == 3  # ⌈γ⌉ − 1
    assert a.used_nbytes - b.used_nbytes == 4 * width * int(a.head_lengths().sum())


def test_ems_pos_overflowing_tables_keep_counts_and_budgets():
    """γ = inf, τ = −1, one slot per entry: every token is held or merged; each expanded centre's copies carry
    ``log(n/m)``, so they weigh ``n`` in all."""
    model = build_model("qwen2")
    cache, _, logits = _run(model, make_policy("ems_pos", budget=12, window=4, gamma=float("inf"), tau=-1.0,
                                               table_width=1), prompt(length=40), steps=5)
    assert all(bool(torch.isfinite(x).all()) for x in logits)
    for layer_idx, layer in enumerate(cache.layers):
        view = layer.store.dense()
        counts = view.extras[MERGE_COUNT]
        assert torch.equal(counts.sum(-1), torch.full_like(counts.sum(-1), 45.0))
        assert int(layer.store.max_length) == 12
        step = SimpleNamespace(module=model.model.layers[layer_idx].self_attn, layer_idx=layer_idx, view=view)
        _, _, _, valid, bias = cache.policy.action.expanded(step)
        weight = (bias.exp() * valid).view(*counts.shape, 2).sum(-1)
        torch.testing.assert_close(weight, counts)
