"""A layer store with a quantized tier: the combined view, moves into the tier, and keeps across tiers."""

from __future__ import annotations

import pytest
import torch
from test_quantize_ops import _kivi_by_hand

from kvsieve.cache.store import LayerStore

B, H, D = 2, 2, 16


def _store(length: int = 12, dtype: torch.dtype = torch.float32) -> tuple[LayerStore, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(B, H, length, D, generator=gen).to(dtype)
    values = torch.randn(B, H, length, D, generator=gen).to(dtype)
    store = LayerStore(B, H, D, dtype, torch.device("cpu"))
    store.append(keys, values, 0, None)
    store.add_tier(bits=4, group=4, value_group=8)
    return store, keys, values


def _rows(local: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in local)
    index = torch.tensor([r + [0] * (width - len(r)) for r in local])
    return index, torch.tensor([len(r) for r in local])


def _tiered(low: list[list[int]], full: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keep ``low`` (into tier 1) and ``full`` (full precision) of each segment."""
    merged = [sorted(a + b) for a, b in zip(low, full, strict=True)]
    index, counts = _rows(merged)
    tiers = torch.tensor([[1 if i in a else 0 for i in r] + [0] * (index.shape[1] - len(r))
                          for a, r in zip(low, merged, strict=True)])
    return index, counts, tiers


def test_quantized_entries_join_the_view_in_position_order():
    store, keys, values = _store()
    old = [[0, 1, 2, 3, 4, 5], [0, 2, 4, 6], [1, 3], [0, 1, 2, 3, 4, 5, 6, 7]]  # per segment b·H + h
    stay = [[i for i in range(12) if i not in r] for r in old]
    store.keep(*_tiered(old, stay))  # keep everything: `old` quantized, the rest in full precision
    assert store.lengths().flatten().tolist() == [12] * 4
    assert store.full_lengths().flatten().tolist() == [len(s) for s in stay]
    view = store.dense()
    assert torch.equal(view.positions, torch.arange(12).expand(B, H, 12))
    for seg, moved in enumerate(old):
        b, h = divmod(seg, H)
        for i in range(12):
            if i not in moved:  # full precision: exact
                assert torch.equal(view.keys[b, h, i], keys[b, h, i])
                assert torch.equal(view.values[b, h, i], values[b, h, i])
        moved_keys = keys[b, h, moved]
        for first in range(0, len(moved), 4):  # KIVI key groups of 4 in the order they arrived
            group = moved_keys[first:first + 4]
            expected = _kivi_by_hand(group, 4, group.shape[0], per_channel=True)
            torch.testing.assert_close(view.keys[b, h, moved[first:first + 4]], expected, rtol=0, atol=0)
        expected_v = _kivi_by_hand(values[b, h, moved], 4, 8, per_channel=False)
        torch.testing.assert_close(view.values[b, h, moved], expected_v, rtol=0, atol=0)
    assert store.kv_nbytes() < 12 * B * H * 2 * D * 4  # fewer bytes than all entries in float32


def test_keep_routes_each_entry_to_its_tier():
    store, _, _ = _store()
    store.keep(*_tiered([[0, 1, 2, 3]] * 4, [list(range(4, 12))] * 4))  # nothing dropped, 4 quantized
    before = store.dense()
    keep = [[1, 3, 5, 11], [0, 4, 8], [2, 3, 10, 11], [6]]
    store.keep(*_rows(keep))
    after = store.dense()
    assert store.lengths().flatten().tolist() == [len(k) for k in keep]
    for seg, kept in enumerate(keep):
        b, h = divmod(seg, H)
        n = len(kept)
        assert torch.equal(after.positions[b, h, :n], before.positions[b, h, kept])
        assert torch.equal(after.keys[b, h, :n], before.keys[b, h, kept])  # bit for bit, either tier
        assert torch.equal(after.values[b, h, :n], before.values[b, h, kept])


def test_batch_selection_moves_tiers_with_their_rows():
    store, _, _ = _store()
    low = [[0, 1], [0], [2, 3, 4], [5]]
    store.keep(*_tiered(low, [[i for i in range(12) if i not in r] for r in low]))
    before = store.dense()
    store.select_batch(torch.tensor([1, 1, 0]))
    after = store.dense()
    for new_b, old_b in enumerate([1, 1, 0]):
        assert torch.equal(after.keys[new_b], before.keys[old_b]) and torch.equal(after.positions[new_b],
                                                                                    before.positions[old_b])


def _with_side(store: LayerStore) -> torch.Tensor:
    """Side data ``acc`` set to a distinct value per entry (its position plus 100·segment); returns it."""
    from kvsieve.cache.side_data import SideSpec

    store.ensure_side(SideSpec("acc"))
    view = store.dense()
    seg = torch.arange(B * H).view(B, H, 1).float()
    value = view.positions.float() + 100 * seg
    store.add_dense("acc", value)
    return value


def test_side_data_moves_with_entries_into_a_tier_and_back_out_of_the_view():
    store, _, _ = _store()
    _with_side(store)
    keep = [[0, 2, 3, 5, 9, 11], [1, 4, 6, 8], [0, 1, 2, 3, 10], [7, 8, 9, 10, 11]]
    low = [[0, 2, 3, 5], [1, 4, 6, 8], [0, 1, 2], [7, 8]]
    store.keep(*_tiered(low, [[k for k in row if k not in lo] for row, lo in zip(keep, low, strict=True)]))
    assert store.tiered
    view = store.dense()
    for seg, kept in enumerate(keep):
        b, h = divmod(seg, H)
        n = len(kept)
        assert view.positions[b, h, :n].tolist() == kept
        assert view.extras["acc"][b, h, :n].tolist() == [float(k + 100 * seg) for k in kept]  # moved, not reset


def test_add_dense_reaches_entries_in_every_tier():
    store, _, _ = _store()
    _with_side(store)
    store.keep(*_tiered([[0, 1, 2, 3, 4]] * 4, [list(range(5, 10))] * 4))
    before = store.dense().extras["acc"].clone()
    valid = store.dense().valid
    update = torch.rand(before.shape, generator=torch.Generator().manual_seed(3))
    store.add_dense("acc", update)
    after = store.dense().extras["acc"]
    mask = valid if valid is not None else torch.ones(before.shape, dtype=torch.bool)
    torch.testing.assert_close(after[mask], (before + update)[mask])
    tier_values = store.tiers[0].dense_extras()["acc"]
    assert bool((tier_values[store.tiers[0].dense()[3]] >= 0).all())
    # the quantized entries (positions 0..4) got their share: the tier's own slots changed
    assert not torch.equal(tier_values, torch.zeros_like(tier_values))


def test_tier_side_data_survives_batch_selection_and_saving():
    store, _, _ = _store()
    _with_side(store)
    store.keep(*_tiered([[0, 1, 2, 3]] * 4, [list(range(4, 12))] * 4))
    expected = store.dense()
    entries = store.entries()
    assert any(key.endswith(".extra.acc") for key in entries)
    restored = LayerStore(B, H, D, torch.float32, torch.device("cpu"))
    from kvsieve.cache.side_data import SideSpec

    restored.ensure_side(SideSpec("acc"))
    restored.restore(entries)
    assert torch.equal(restored.dense().extras["acc"], expected.extras["acc"])
    store.select_batch(torch.tensor([1, 1, 0]))
    view = store.dense()
    assert torch.equal(view.extras["acc"][0], expected.extras["acc"][1])
    assert torch.equal(view.extras["acc"][2], expected.extras["acc"][0])


def test_a_trim_drops_quantized_entries_even_when_as_many_stay_as_are_in_full_precision():
    """A sliding-window trim (``keep_positions_after``) of a tiered store counts the kept entries over every tier.
    Here 8 of 12 entries per segment are quantized and the trim keeps the 4 newest — as many as are held in full
    precision: the early return compared the kept count with the full-precision length alone and skipped the trim,
    leaving the 8 quantized entries the window no longer sees."""
    store, _, _ = _store()
    low = [[0, 1, 2, 3, 4, 5, 6, 7]] * 4  # 8 quantized, 4 in full precision (positions 8–11)
    store.keep(*_tiered(low, [[8, 9, 10, 11]] * 4))
    assert store.full_lengths().flatten().tolist() == [4] * 4 and store.lengths().flatten().tolist() == [12] * 4
    store.keep_positions_after(8)  # keeps 4 entries: as many as the full-precision length
    assert store.lengths().flatten().tolist() == [4] * 4
    view = store.dense()
    assert torch.equal(view.positions, torch.arange(8, 12).expand(B, H, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_attention_view_holds_the_dense_views_entries_when_heads_hold_different_group_counts(dtype):
    """Heads with 1, 2 and 3 quantized groups: the attention view gathers the packed groups of its padded layout
    before dequantizing (straight into the view's slice, rounded to the model dtype as the dense view rounds);
    every real slot equals the dense view's entry of the same position bit for bit, and the padded slots are
    marked invalid."""
    store, _, _ = _store(dtype=dtype)
    old = [[0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [0, 2, 4, 6], [1, 3], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
    stay = [[i for i in range(12) if i not in r] for r in old]
    store.keep(*_tiered(old, stay))
    tier = store.tiers[0]
    assert len(set(tier.groups_per_segment.tolist())) > 1  # the gathered (ragged) layout
    dense = store.dense()
    view = store.attention_view()
    positions = view.positions
    valid = view.valid if view.valid is not None else torch.ones(positions.shape, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            real = valid[b, h].nonzero().flatten()
            held = positions[b, h, real]
            assert sorted(held.tolist()) == list(range(12))
            order = held.argsort()
            assert torch.equal(view.keys[b, h, real][order], dense.keys[b, h])
            assert torch.equal(view.values[b, h, real][order], dense.values[b, h])
    index = tier._slot_layout()[0]
    assert index is not None
    gathered = tier.dequantized(index)
    whole = tier.dequantized()
    assert torch.equal(gathered[0], whole[0].index_select(0, index))
    assert torch.equal(gathered[1], whole[1].index_select(0, index))


def test_max_full_entry_units_on_python_floats_equals_the_tensor_form():
    """The byte-budget check each decoding step makes (``max_full_entry_units``) is the tensor form
    ``ceil(max(full_entry_units()))`` exactly, with two tiers, on uniform and ragged full-precision layouts, across
    decoding appends, a keep that changes the tiers, a batch selection and a tier added later."""
    store, _, _ = _store()
    shapes: list[bool] = []

    def check() -> None:
        units = store.length.double()  # the tensor form, from the tiers' bookkeeping (no cached share)
        for tier in store.tiers:
            units = units + tier.segment_kv_nbytes().double() / (2 * D * store.keys.element_size())
        expected = int(torch.ceil(units.max()).item())
        assert torch.equal(store.full_entry_units(), units)
        assert store.max_full_entry_units() == expected
        shapes.append(store.is_uniform)

    store.keep(*_tiered([[0, 1, 2, 3]] * 4, [list(range(4, 12))] * 4))  # 4 quantized, 8 full everywhere
    check()
    gen = torch.Generator().manual_seed(1)
    for step in range(5):
        store.append(torch.randn(B, H, 1, D, generator=gen), torch.randn(B, H, 1, D, generator=gen), 12 + step, None)
        check()
    store.add_tier(bits=2, group=4, value_group=8)
    store.tiers[1].add(torch.randn(6, D, generator=gen), torch.randn(6, D, generator=gen), torch.arange(6),
                       torch.tensor([1, 0, 5, 0]))  # ragged 2-bit groups: 1, 0, 2, 0 groups per segment
    check()
    store.keep(*_rows([[0, 2, 5, 9], [1, 3], list(range(10)), [4]]))  # ragged full precision and tiers
    check()
    for step in range(5):
        store.append(torch.randn(B, H, 1, D, generator=gen), torch.randn(B, H, 1, D, generator=gen), 17 + step, None)
        check()
    store.select_batch(torch.tensor([1, 0, 1]))
    check()
    assert set(shapes) == {True, False}  # both layouts were checked
