"""Unit tests of ``LayerStore``: append / keep / dense / select_batch round trips."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsieve.cache.store import GROWTH, LayerStore
from kvsieve.cache.store_compaction import StoreCompaction

B, H, D = 2, 3, 4


def make_store() -> LayerStore:
    return LayerStore(B, H, D, torch.float32, torch.device("cpu"))


def kv(q: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, q, D, generator=generator), torch.randn(B, H, q, D, generator=generator)


def segment(store: LayerStore, b: int, h: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    s = b * store.heads + h
    start, length = int(store.start[s]), int(store.length[s])
    return (
        store.keys[start : start + length],
        store.values[start : start + length],
        store.positions[start : start + length],
    )


def two_runs(counts: torch.Tensor) -> tuple[tuple[int, ...], ...] | None:
    """Strided runs forced on any uneven ``counts``: the shorter and the longer half of the segments."""
    if counts.numel() < 2 or int(counts.min()) == int(counts.max()):
        return None
    order = torch.argsort(counts, stable=True).tolist()
    half = len(order) // 2
    return (tuple(order[:half]), tuple(order[half:]))


def expected_capacity(store: LayerStore, counts: torch.Tensor, layout: str, reserve: int = 0) -> torch.Tensor:
    """Capacities a ragged keep of ``counts`` leaves: what is kept (compact), the longest (padded), each strided
    run's longest (strided), plus the reserved rows."""
    if layout == "padded" and int(counts.min()) != int(counts.max()):
        return torch.full_like(counts, int(counts.max())) + reserve
    capacity = counts.clone()
    if layout == "strided" and store.runs is not None:
        for members in store.runs:
            capacity[list(members)] = int(counts[list(members)].max())
    return capacity + reserve


@pytest.fixture(params=["compact", "padded", "strided"])
def layout(request, monkeypatch) -> str:
    """A ragged compaction's layout, forced: compact (capacity = what is kept), padded (equal capacities) or
    strided (two runs of equal capacities each, segments in run order)."""
    monkeypatch.setattr(StoreCompaction, "pads", lambda self, counts, on=request.param == "padded": on)
    monkeypatch.setattr(StoreCompaction, "plan_runs",
                        lambda self, counts, on=request.param == "strided": two_runs(counts) if on else None)
    return request.param


def test_empty_store():
    store = make_store()
    assert store.lengths().shape == (B, H)
    assert int(store.lengths().sum()) == 0
    assert store.nbytes() == store.used_nbytes() == 0
    view = store.dense()
    assert view.keys.shape == (B, H, 0, D)
    assert view.valid is None


def test_uniform_append_dense_is_zero_copy_view():
    store = make_store()
    keys, values = kv(5)
    store.append(keys, values, 0, None)
    assert store.is_uniform
    view = store.dense()
    assert view.valid is None
    assert torch.equal(view.keys, keys) and torch.equal(view.values, values)
    assert torch.equal(view.positions, torch.arange(5).expand(B, H, 5))
    # zero-copy: a view into the flat buffers, not a gathered copy
    assert view.keys.untyped_storage().data_ptr() == store.keys.untyped_storage().data_ptr()
    assert view.values.untyped_storage().data_ptr() == store.values.untyped_storage().data_ptr()
    store.keys[0] += 1.0  # a write through the buffer shows up in the view
    assert torch.equal(view.keys[0, 0, 0], keys[0, 0, 0] + 1.0)


def test_append_grows_with_slack_and_preserves_entries():
    store = make_store()
    k1, v1 = kv(3, seed=1)
    k2, v2 = kv(1, seed=2)
    store.append(k1, v1, 0, None)
    assert (store.capacity == 3 + GROWTH).all()
    store.append(k2, v2, 3, None)  # fits in the slack: no relayout
    assert (store.capacity == 3 + GROWTH).all()
    view = store.dense()
    assert torch.equal(view.keys, torch.cat([k1, k2], dim=2))
    assert torch.equal(view.values, torch.cat([v1, v2], dim=2))
    assert store.used_nbytes() == B * H * 4 * (2 * D * 4 + 8)
    assert store.nbytes() == B * H * (3 + GROWTH) * (2 * D * 4 + 8)


def test_ragged_append_skips_padding():
    store = make_store()
    keys, values = kv(4, seed=3)
    valid = torch.tensor([[False, True, True, True], [False, False, False, True]])
    store.append(keys, values, 0, valid)
    assert store.lengths().tolist() == [[3] * H, [1] * H]
    for h in range(H):
        k, v, p = segment(store, 0, h)
        assert torch.equal(k, keys[0, h, 1:]) and torch.equal(v, values[0, h, 1:])
        assert p.tolist() == [1, 2, 3]
        k, v, p = segment(store, 1, h)
        assert torch.equal(k, keys[1, h, 3:]) and p.tolist() == [3]
    view = store.dense()
    assert view.valid is not None
    assert view.keys.shape == (B, H, 3, D)
    assert view.valid[0].all() and view.valid[1].sum(dim=-1).tolist() == [1] * H
    assert torch.equal(view.keys[1, :, 0], keys[1, :, 3])
    assert torch.equal(view.positions[0, 0], torch.tensor([1, 2, 3]))
    # a second ragged append lands after each segment's own entries
    k2, v2 = kv(1, seed=4)
    store.append(k2, v2, 4, None)
    assert store.lengths().tolist() == [[4] * H, [2] * H]
    k, _, p = segment(store, 1, 2)
    assert p.tolist() == [3, 4]
    assert torch.equal(k, torch.stack([keys[1, 2, 3], k2[1, 2, 0]]))


def test_keep_copies_exact_entries_and_shrinks_capacity(layout):
    store = make_store()
    keys, values = kv(6, seed=5)
    store.append(keys, values, 10, None)
    counts = torch.tensor([2, 0, 3, 1, 6, 4])
    local = torch.full((B * H, 6), 6, dtype=torch.long)  # filler past counts is ignored
    choices = [[1, 4], [], [0, 2, 5], [3], [0, 1, 2, 3, 4, 5], [0, 1, 4, 5]]
    for s, chosen in enumerate(choices):
        local[s, : len(chosen)] = torch.tensor(chosen, dtype=torch.long)
    store.keep(local, counts)
    assert store.lengths().reshape(-1).tolist() == counts.tolist()
    capacity = expected_capacity(store, counts, layout)  # padded: every segment the longest's
    assert torch.equal(store.capacity, capacity) and store.is_padded == (layout == "padded")
    assert (store.runs is not None) == (layout == "strided")
    assert store.keys.shape[0] == int(capacity.sum())
    assert (store.nbytes() == store.used_nbytes()) == (layout == "compact")
    for s, chosen in enumerate(choices):
        b, h = divmod(s, H)
        k, v, p = segment(store, b, h)
        assert torch.equal(k, keys[b, h, chosen]) and torch.equal(v, values[b, h, chosen])
        assert p.tolist() == [10 + c for c in chosen]
    view = store.dense()
    assert view.valid is not None and view.valid.sum().item() == int(counts.sum())
    assert torch.equal(view.keys[0, 2][:3], keys[0, 2, [0, 2, 5]])
    # appending after a ragged keep relayouts and keeps everything in place
    k2, v2 = kv(1, seed=6)
    store.append(k2, v2, 16, None)
    for s, chosen in enumerate(choices):
        b, h = divmod(s, H)
        k, _, p = segment(store, b, h)
        assert torch.equal(k, torch.cat([keys[b, h, chosen], k2[b, h]]))
        assert p.tolist() == [*(10 + c for c in chosen), 16]


def test_decoding_appends_write_their_slots_across_view_windows_and_growths():
    """A decoding append writes its slot through views made ahead for the next ``SLOT_VIEWS`` slots: over more steps
    than a window and a growth hold — with a keep between, which moves the entries and the slot — every entry and
    position is the one appended."""
    from kvsieve.cache.store_append import SLOT_VIEWS

    store = make_store()
    keys, values = kv(5, seed=3)
    store.append(keys, values, 0, None)
    all_keys, all_values, positions = [keys], [values], list(range(5))
    for step in range(SLOT_VIEWS + GROWTH + 7):
        if step == SLOT_VIEWS // 2:  # keep all but the first entry of every segment: new buffers, a lower slot
            length = len(positions)
            store.keep(torch.arange(1, length).expand(B * H, length - 1).contiguous(),
                       torch.full((B * H,), length - 1))
            all_keys, all_values = [torch.cat(all_keys, 2)[:, :, 1:]], [torch.cat(all_values, 2)[:, :, 1:]]
            positions = positions[1:]
        position = 1000 + 3 * step  # not consecutive: each step writes its own
        k, v = kv(1, seed=100 + step)
        store.append(k, v, position, None)
        all_keys.append(k)
        all_values.append(v)
        positions.append(position)
    assert store.is_uniform
    view = store.dense()
    assert torch.equal(view.keys, torch.cat(all_keys, 2))
    assert torch.equal(view.values, torch.cat(all_values, 2))
    assert torch.equal(view.positions, torch.tensor(positions).expand(B, H, len(positions)))


def test_decoding_appends_start_side_data_at_its_fill_across_view_windows_growths_and_new_sides():
    """A decoding append starts each side-data field of its slot at the field's fill through views made ahead (as the
    entries' slots are): over more steps than a window and a growth hold, with an in-place-kept layout, a keep that
    moves the entries, and a field created midway, every new entry's side data is its fill and every older one keeps
    what was added to it; the side buffers a growth replaced are freed."""
    import gc
    import weakref

    from kvsieve.cache.store_append import SLOT_VIEWS

    store = make_store()
    store.append(*kv(5, seed=3), 0, None)
    store.ensure_extra("acc", fill=7.0)
    expected = {"acc": torch.full((B, H, 5), 7.0)}
    replaced = None
    for step in range(SLOT_VIEWS + GROWTH + 9):
        if step == SLOT_VIEWS // 2:  # a keep: new buffers, a lower slot
            length = expected["acc"].shape[2]
            store.keep(torch.arange(1, length).expand(B * H, length - 1).contiguous(),
                       torch.full((B * H,), length - 1))
            expected = {name: t[:, :, 1:] for name, t in expected.items()}
        if step == SLOT_VIEWS // 2 + 3:  # a second field: the views ahead must cover it too
            store.ensure_extra("count", fill=-2.0)
            expected["count"] = torch.full((B, H, expected["acc"].shape[2]), -2.0)
        if step == 3:
            replaced = weakref.ref(store.extras["acc"])
        store.append(*kv(1, seed=100 + step), 5 + step, None)
        fills = {"acc": 7.0, "count": -2.0}
        for name in expected:
            expected[name] = torch.cat([expected[name], torch.full((B, H, 1), fills[name])], 2)
        for name in expected:
            assert torch.equal(store.dense().extras[name], expected[name]), (step, name)
        for name in expected:  # something other than the fill on every held entry, as a scorer adds
            added = torch.randn(B, H, expected[name].shape[2], generator=torch.Generator().manual_seed(step))
            store.add_dense(name, added)
            expected[name] = expected[name] + added
    assert store.is_uniform and set(store.extras) == {"acc", "count"}
    for name in expected:
        assert torch.equal(store.dense().extras[name], expected[name])
    gc.collect()
    assert replaced is not None and replaced() is None  # the growth's old buffer, viewed ahead, is freed


def test_replaced_buffers_are_freed():
    """The uniform store's cached capacity views hold the buffers they view; once a compaction (to a ragged layout
    here, which never reads them) or a growth replaces the buffers, the old ones must be freed — a prompt's
    whole buffer kept alive would undo the memory a compression saves."""
    import gc
    import weakref

    store = make_store()
    keys, values = kv(6, seed=5)
    store.append(keys, values, 0, None)
    store.dense()  # views the uniform buffers (and caches them)
    grown = weakref.ref(store.keys)
    for step in range(GROWTH + 1):  # appends until the buffers grow
        store.append(*kv(1, seed=step), 6 + step, None)
    gc.collect()
    assert grown() is None
    prompt = weakref.ref(store.keys)
    counts = torch.tensor([2, 0, 3, 1, 6, 4])
    store.keep(torch.arange(6).expand(B * H, 6).contiguous(), counts)
    assert not store.is_uniform
    gc.collect()
    assert prompt() is None


def test_keep_everything_removed_then_append():
    store = make_store()
    keys, values = kv(3, seed=7)
    store.append(keys, values, 0, None)
    store.keep(torch.zeros(B * H, 0, dtype=torch.long), torch.zeros(B * H, dtype=torch.long))
    assert int(store.lengths().sum()) == 0 and store.keys.shape[0] == 0
    k2, v2 = kv(2, seed=8)
    store.append(k2, v2, 3, None)
    assert torch.equal(store.dense().keys, k2)
    assert torch.equal(store.dense().positions[0, 0], torch.tensor([3, 4]))


def test_uniform_keep_gives_uniform_view():
    store = make_store()
    keys, values = kv(5, seed=9)
    store.append(keys, values, 0, None)
    local = torch.tensor([[0, 2, 4]] * (B * H))
    store.keep(local, torch.full((B * H,), 3))
    assert store.is_uniform
    view = store.dense()
    assert view.valid is None
    assert torch.equal(view.keys, keys[:, :, [0, 2, 4]])


@pytest.mark.parametrize("index", [[1, 0], [1, 1, 0], [0], [1]])
def test_select_batch_reorders_and_repeats(index):
    store = make_store()
    keys, values = kv(4, seed=10)
    valid = torch.tensor([[False, True, True, True], [True, True, True, True]])
    store.append(keys, values, 0, valid)
    store.ensure_extra("acc")
    store.add_dense("acc", torch.arange(B * H * 4, dtype=torch.float32).view(B, H, 4))
    before = {(b, h): segment(store, b, h) for b in range(B) for h in range(H)}
    acc_before = store.dense().extras["acc"].clone()
    store.select_batch(torch.tensor(index))
    assert store.batch == len(index)
    assert store.lengths().shape == (len(index), H)
    for new_b, old_b in enumerate(index):
        for h in range(H):
            k, v, p = segment(store, new_b, h)
            ok, ov, op = before[(old_b, h)]
            assert torch.equal(k, ok) and torch.equal(v, ov) and torch.equal(p, op)
            n = len(p)
            assert torch.equal(store.dense().extras["acc"][new_b, h, :n], acc_before[old_b, h, :n])


def test_extras_follow_entries_and_start_at_zero():
    store = make_store()
    keys, values = kv(3, seed=11)
    store.append(keys, values, 0, None)
    store.ensure_extra("acc")
    store.add_dense("acc", torch.ones(B, H, 3))
    store.add_dense("acc", torch.arange(3, dtype=torch.float32).expand(B, H, 3))
    assert torch.equal(store.dense().extras["acc"], torch.tensor([1.0, 2.0, 3.0]).expand(B, H, 3))
    store.ensure_extra("acc", fill=9.0)  # already present: untouched
    assert torch.equal(store.dense().extras["acc"][0, 0], torch.tensor([1.0, 2.0, 3.0]))
    k2, v2 = kv(1, seed=12)
    store.append(k2, v2, 3, None)
    assert store.dense().extras["acc"][..., -1].eq(0).all()
    store.keep(torch.tensor([[1, 3]] * (B * H)), torch.full((B * H,), 2))
    assert torch.equal(store.dense().extras["acc"], torch.tensor([2.0, 0.0]).expand(B, H, 2))
    assert store.used_nbytes() == B * H * 2 * (2 * D * 4 + 8 + 4)


def test_add_dense_on_ragged_store():
    store = make_store()
    keys, values = kv(3, seed=13)
    valid = torch.tensor([[True, True, True], [False, False, True]])
    store.append(keys, values, 0, valid)
    store.ensure_extra("acc")
    view = store.dense()
    update = torch.arange(B * H * 3, dtype=torch.float32).view(B, H, 3)
    store.add_dense("acc", update)
    acc = store.dense().extras["acc"]
    assert torch.equal(acc[0], update[0])
    assert torch.equal(acc[1, :, 0], update[1, :, 0])  # padded slots of the view are not written back
    assert view.valid is not None
    for h in range(H):
        s = 1 * H + h
        start = int(store.start[s])
        assert store.extras["acc"][start].item() == update[1, h, 0].item()


def test_keep_positions_after():
    store = make_store()
    keys, values = kv(6, seed=14)
    valid = torch.tensor([[True] * 6, [False, False, True, True, True, True]])
    store.append(keys, values, 0, valid)
    store.keep_positions_after(3)
    assert store.lengths().tolist() == [[3] * H, [3] * H]
    for h in range(H):
        assert segment(store, 0, h)[2].tolist() == [3, 4, 5]
        assert torch.equal(segment(store, 1, h)[0], keys[1, h, 3:])
    before = store.keys.clone()
    store.keep_positions_after(0)  # nothing to drop: no change
    assert torch.equal(store.keys, before)


def test_dense_view_is_cached_until_the_next_mutation():
    store = make_store()
    keys, values = kv(4, seed=15)
    valid = torch.tensor([[True] * 4, [False, True, True, True]])
    store.append(keys, values, 0, valid)
    view = store.dense()
    assert store.dense() is view  # no mutation: the same object, no second gather
    store.ensure_extra("acc")
    with_side = store.dense()
    assert with_side is not view and "acc" in with_side.extras
    store.add_dense("acc", torch.ones(B, H, 4))
    assert store.dense() is not with_side and store.dense().extras["acc"][0].eq(1).all()
    k2, v2 = kv(1, seed=16)
    before_append = store.dense()
    store.append(k2, v2, 4, None)
    after = store.dense()
    assert after is not before_append and after.keys.shape[2] == 5
    assert torch.equal(after.keys[1, :, 3], k2[1, :, 0])  # row 1 holds 3 + 1 entries, in order


def test_keep_returns_the_kept_source_rows(layout):
    store = make_store()
    keys, values = kv(5, seed=17)
    store.append(keys, values, 0, None)
    start = store.start.clone()
    old_keys = store.keys.clone()
    local = torch.tensor([[0, 2, 4], [1, 3, 0], [4, 0, 0], [0, 1, 2], [2, 0, 0], [3, 4, 0]])
    counts = torch.tensor([3, 2, 1, 3, 1, 2])
    rows = store.keep(local, counts)
    expected = torch.cat([start[s] + local[s, : int(counts[s])] for s in range(B * H)])
    assert torch.equal(rows, expected)
    held = torch.cat([store.keys[int(store.start[s]) : int(store.start[s]) + int(counts[s])] for s in range(B * H)])
    assert torch.equal(held, old_keys[rows])  # the kept entries, in order, are those source rows


def expected_after_appended(before: torch.Tensor, view_positions: torch.Tensor, valid: torch.Tensor | None,
                            values: torch.Tensor, first: int) -> torch.Tensor:
    """``before`` (the side data over the dense view) plus ``values[..., p - first]`` on entries at ``p ≥ first``."""
    offset = view_positions - first
    is_new = offset >= 0
    if valid is not None:
        is_new = is_new & valid
    added = values.gather(-1, offset.clamp(0, values.shape[-1] - 1))
    return before + torch.where(is_new, added, torch.zeros(()))


@pytest.mark.parametrize("path", ["uniform_prompt", "uniform_step", "ragged_padded_prompt", "ragged_step"])
def test_add_to_appended_writes_only_the_last_appended_entries(path):
    store = make_store()
    keys, values = kv(5, seed=21)
    store.append(keys, values, 0, None)
    store.ensure_extra("acc")
    store.add_dense("acc", torch.rand(B, H, 5, generator=torch.Generator().manual_seed(1)))
    if path.startswith("ragged"):  # different lengths per segment
        local = torch.tensor([[0, 2, 4], [1, 3, 0], [0, 1, 2], [4, 0, 0], [0, 1, 3], [2, 3, 4]])
        store.keep(local, torch.tensor([3, 2, 3, 1, 3, 3]))
        assert not store.is_uniform
    first = 5
    if path == "ragged_step":  # a first step grows every segment with slack; the next is written in place
        store.append(*kv(1, seed=24), first, None)
        first += 1
    q, valid = (3, None) if path.endswith("prompt") else (1, None)
    if path == "ragged_padded_prompt":
        valid = torch.tensor([[False, True, True], [True, True, True]])
    new_keys, new_values = kv(q, seed=22)
    store.append(new_keys, new_values, first, valid)
    if path == "ragged_step":
        assert store._next_rows is not None  # the in-place decoding append
    before = store.dense().extras["acc"].clone()
    update = torch.randn(B, H, q, generator=torch.Generator().manual_seed(2))
    view = store.dense()
    expected = expected_after_appended(before, view.positions, view.valid, update, first)
    store.add_to_appended("acc", update)
    after = store.dense()
    assert torch.equal(after.positions, view.positions)
    if after.valid is not None:
        assert torch.equal(after.extras["acc"][after.valid], expected[after.valid])
    else:
        assert torch.equal(after.extras["acc"], expected)


def test_add_to_appended_refuses_after_a_layout_change():
    store = make_store()
    keys, values = kv(4, seed=23)
    store.append(keys, values, 0, None)
    store.ensure_extra("acc")
    store.keep(torch.tensor([[0, 1]] * (B * H)), torch.full((B * H,), 2))
    with pytest.raises(RuntimeError, match="changed since its last append"):
        store.add_to_appended("acc", torch.zeros(B, H, 4))


def same_entries(a: LayerStore, b: LayerStore) -> bool:
    """Both stores hold the same entries (keys, values, positions, side data) per segment."""
    if not torch.equal(a.lengths(), b.lengths()):
        return False
    view_a, view_b = a.dense(), b.dense()
    valid = view_a.valid if view_a.valid is not None else torch.ones(view_a.positions.shape, dtype=torch.bool)
    pairs = [(getattr(view_a, n), getattr(view_b, n)) for n in ("keys", "values", "positions")]
    pairs += [(view_a.extras[n], view_b.extras[n]) for n in view_a.extras]
    return all(torch.equal(x[valid], y[valid]) for x, y in pairs)


@pytest.mark.parametrize("counts", [[2, 2, 2, 2, 2, 2], [3, 1, 0, 2, 3, 1]])
def test_keep_with_reserved_rows_keeps_the_same_entries_and_appends_in_place(counts, layout):
    plain, reserved = make_store(), make_store()
    keys, values = kv(4, seed=31)
    local = torch.tensor([[0, 1, 3]] * (B * H))
    for store in (plain, reserved):
        store.append(keys, values, 0, None)
        store.ensure_extra("acc")
        store.add_dense("acc", torch.rand(B, H, 4, generator=torch.Generator().manual_seed(3)))
    plain.keep(local, torch.tensor(counts))
    with reserved.reserving(3):
        reserved.keep(local, torch.tensor(counts))
    assert reserved._reserve == 0  # only inside the block
    kept = torch.tensor(counts)
    assert torch.equal(reserved.capacity, expected_capacity(reserved, kept, layout, reserve=3))
    assert same_entries(plain, reserved)
    buffer = reserved.keys
    for step in range(3):  # three decoding appends fit in the reserved rows: written in place
        new_keys, new_values = kv(1, seed=40 + step)
        plain.append(new_keys, new_values, 4 + step, None)
        reserved.append(new_keys, new_values, 4 + step, None)
        assert reserved.keys is buffer
        assert same_entries(plain, reserved)
    reserved.append(*kv(1, seed=50), 7, None)  # the fourth does not fit
    assert reserved.keys is not buffer


@pytest.mark.parametrize("reserve", [0, 2])
def test_keeping_as_many_in_every_segment_of_a_uniform_store_stays_uniform(reserve, monkeypatch):
    """Every-step decoding eviction (each head drops one entry): one gather per buffer, the layout stays uniform,
    the kept entries are the originals in order, reserved rows repeat each segment's last kept row, and the
    returned source rows are what the general path returns."""
    store = make_store()
    keys, values = kv(6, seed=23)
    store.append(keys, values, 0, None)
    store.ensure_extra("acc")
    store.add_dense("acc", torch.rand(B, H, 6, generator=torch.Generator().manual_seed(5)))
    before = {name: t.clone() for name, t in (("keys", store.keys), ("values", store.values),
                                              ("positions", store.positions), ("acc", store.extras["acc"]))}
    local = torch.tensor([[0, 1, 2, 4, 5], [1, 2, 3, 4, 5], [0, 2, 3, 4, 5], [0, 1, 2, 3, 4], [0, 1, 3, 4, 5],
                          [1, 2, 3, 4, 5]])
    cap = int(store.capacity[0])  # the prompt's rows plus growth slack
    calls = []
    original = type(store)._keep_uniform

    def spy(self, *args):
        calls.append(args[1])
        return original(self, *args)

    monkeypatch.setattr(type(store), "_keep_uniform", spy)
    with store.reserving(reserve):
        rows = store.keep(local, torch.full((B * H,), 5))
    assert calls == [5] and store.is_uniform and store.capacity.tolist() == [5 + reserve] * (B * H)
    assert torch.equal(rows, (torch.arange(B * H)[:, None] * cap + local).reshape(-1))
    padded = torch.cat([local, local[:, -1:].expand(-1, reserve)], dim=1)
    flat = (torch.arange(B * H)[:, None] * cap + padded).reshape(-1)
    assert torch.equal(store.keys, before["keys"][flat]) and torch.equal(store.values, before["values"][flat])
    assert torch.equal(store.positions, before["positions"][flat])
    assert torch.equal(store.extras["acc"], before["acc"][flat])
    view = store.dense()
    assert view.valid is None and torch.equal(view.keys, keys.reshape(B * H, 6, D)[
        torch.arange(B * H)[:, None], local].view(B, H, 5, D))


def test_similar_lengths_are_laid_out_padded_and_viewed_in_place():
    """Heads of similar lengths (one padded view at decoding, no length groups): equal capacities back to back, a
    zero-copy dense view equal to the gathered one on every held entry, finite free rows, and the decoding views
    (keys, values, additive validity mask) equal to it; decoding appends, a relayout when the slack runs out and side
    data keep it so. Very uneven heads stay compact (length groups)."""
    store = make_store()
    keys, values = kv(40, seed=61)
    store.append(keys, values, 0, None)
    store.ensure_extra("acc")
    counts = torch.tensor([30, 28, 32, 29, 31, 30])
    local = torch.stack([torch.sort(torch.randperm(40, generator=torch.Generator().manual_seed(s))[:32]).values
                         for s in range(B * H)])
    store.keep(local, counts)
    assert store.is_padded and torch.equal(store.capacity, torch.full((B * H,), 32))

    def check() -> None:
        view = store.dense()
        assert view.keys.untyped_storage().data_ptr() == store.keys.untyped_storage().data_ptr()
        assert view.values.untyped_storage().data_ptr() == store.values.untyped_storage().data_ptr()
        lengths = store.length.view(B, H)
        assert torch.equal(view.valid, torch.arange(view.keys.shape[2]) < lengths[..., None])
        for b in range(B):
            for h in range(H):
                k, v, p = segment(store, b, h)
                n = int(lengths[b, h])
                assert torch.equal(view.keys[b, h, :n], k) and torch.equal(view.values[b, h, :n], v)
                assert torch.equal(view.positions[b, h, :n], p)
        assert torch.isfinite(store.keys).all() and torch.isfinite(store.values).all()
        # what a decoding step reads instead of the dense view: the same keys and values, the validity as 0 / −inf
        keys, values, bias = store.padded_decoding_views()
        assert torch.equal(keys, view.keys) and torch.equal(values, view.values)
        assert torch.equal(bias, torch.zeros(bias.shape).masked_fill(~view.valid, float("-inf")))
        assert keys.untyped_storage().data_ptr() == store.keys.untyped_storage().data_ptr()

    check()
    for step in range(3):  # the longest segment has no slack: the first append relayouts, padded again
        store.append(*kv(1, seed=70 + step), 40 + step, None)
        store.add_to_appended("acc", torch.ones(B, H, 1))
        assert store.is_padded
        check()
    assert store.view_nbytes() == 0
    assert not store.pads(torch.tensor([1, 1, 1, 1, 1, 400]))  # a long head among short ones: length groups
    assert not store.pads(torch.tensor([5, 5, 5, 5, 5, 5]))  # equal: uniform
    assert not store.pads(torch.tensor([100, 100, 100, 100, 100, 200]))  # padding above MAX_PADDING of the held
    assert store.pads(torch.tensor([10, 10, 10, 10, 10, 20]))  # ... but only SMALL_PADDING_ROWS per segment
    assert not store.pads(torch.tensor([10, 10, 10, 10, 10, 30]))  # above both
    assert store.pads(torch.tensor([10, 10, 10, 10, 10, 12]))


def check_rows_map_to_their_segments(store: LayerStore) -> None:
    """Every held row's segment, as :meth:`segments_of` finds it, is the segment holding it."""
    for s in range(store.segments):
        start, length = int(store.start[s]), int(store.length[s])
        rows = torch.arange(start, start + length)
        assert torch.equal(store.segments_of(rows), torch.full_like(rows, s))


def _kept_beside_a_compact_twin(counts: torch.Tensor, length: int, seed: int) -> tuple[LayerStore, LayerStore]:
    """Two stores given the same ``length`` entries (with side data) and the same keep of ``counts`` per segment (the
    lowest positions of a random subset): the store as laid out by default, and a twin refused strided runs."""
    store, twin = make_store(), make_store()
    twin.plan_runs = lambda counts: None  # type: ignore[method-assign]
    keys, values = kv(length, seed=seed)
    width = int(counts.max())
    local = torch.stack([torch.sort(torch.randperm(length, generator=torch.Generator().manual_seed(s))[:width]).values
                         for s in range(B * H)])
    for each in (store, twin):
        each.append(keys, values, 0, None)
        each.ensure_extra("acc")
        each.keep(local, counts)
    return store, twin


def test_heads_of_very_different_lengths_are_laid_out_in_strided_runs():
    """Long and short heads (a decoding step attends by length group): each group a run of equal capacities back to
    back, viewed in place by the decoding step; its validity, the row → segment map, decoding appends (in place,
    then a relayout that keeps the runs) and side data hold, and the entries are those of a compact twin."""
    counts = torch.tensor([5, 300, 6, 290, 4, 310])
    store, twin = _kept_beside_a_compact_twin(counts, 320, seed=63)
    assert store.runs is not None and twin.runs is None and not store.is_padded
    assert sorted(sorted(members) for members in store.runs) == [[0, 2, 4], [1, 3, 5]]
    assert torch.equal(store.capacity, torch.tensor([6, 310, 6, 310, 6, 310]))

    def check() -> None:
        groups = store.length_groups()
        assert groups is not None and len(groups) == 2
        valid = store.row_valid()
        for group, width in groups:
            assert group.base is not None and group.stride == int(store.capacity[group.members[0]])
            assert width == int(store.length[list(group.members)].max())
            for i, s in enumerate(group.members):
                assert int(store.start[s]) == group.base + i * group.stride
                held = int(store.length[s])
                rows = valid[group.base + i * group.stride: group.base + (i + 1) * group.stride]
                assert rows[:held].all() and not rows[held:].any()
        _same_entries_and_views(store, twin)
        check_rows_map_to_their_segments(store)
        assert torch.isfinite(store.keys).all() and torch.isfinite(store.values).all()

    check()
    buffer = store.keys
    for step in range(3):  # the longest of each run has no slack: the first append relayouts, in runs again
        for each in (store, twin):
            each.append(*kv(1, seed=80 + step), 320 + step, None)
            each.add_to_appended("acc", torch.full((B, H, 1), float(step + 1)))
        assert store.runs is not None
        check()
    assert store.keys is not buffer
    assert store.plan_runs(torch.tensor([5, 300, 6, 290, 4, 310])) is not None
    empty = make_store()  # segments holding nothing (no rows) among others: rows still map to their segments
    empty.plan_runs = lambda counts: ((3,), (0, 1), (2, 4, 5))  # type: ignore[method-assign]
    empty.pads = lambda counts: False  # type: ignore[method-assign]
    keys, values = kv(320, seed=63)
    empty.append(keys[:, :, :4], values[:, :, :4], 0, None)
    empty.keep(torch.tensor([[0, 1, 2, 3]] * (B * H)), torch.tensor([2, 1, 3, 0, 3, 4]))
    assert empty.runs == ((3,), (0, 1), (2, 4, 5)) and int(empty.start[3]) == int(empty.start[0]) == 0
    check_rows_map_to_their_segments(empty)
    # 3 runs, no padding; laid out as close to segment order as the cut allows (ascending, runs by their first)
    assert store.plan_runs(torch.tensor([1, 300, 1, 200, 1, 100])) == ((0, 2, 4), (1, 3), (5,))
    assert store.plan_runs(torch.tensor([1, 100, 1, 170, 290, 490])) is None  # every cut above MAX_PADDING
    assert store.plan_runs(torch.tensor([30, 31, 29, 30, 32, 30])) is None  # one padded view: no groups
    assert store.plan_runs(torch.tensor([7, 7, 7, 7, 7, 7])) is None  # uniform


def test_strided_runs_survive_batch_selection_and_a_saved_copy():
    """A store in strided runs, reordered by batch row (beam search) or saved and restored (a saved context),
    holds the same entries as a compact twin after the same operation; both then lay out compact."""
    stores = {}
    for strided in (True, False):
        store = make_store()
        if not strided:
            store.plan_runs = lambda counts: None  # type: ignore[method-assign]
        keys, values = kv(320, seed=64)
        store.append(keys, values, 0, None)
        store.ensure_extra("acc")
        store.add_dense("acc", torch.rand(B, H, 320, generator=torch.Generator().manual_seed(5)))
        local = torch.arange(320).expand(B * H, 320)
        store.keep(local, torch.tensor([5, 300, 6, 290, 4, 310]))
        stores[strided] = store
    assert stores[True].runs is not None and stores[False].runs is None
    saved = {strided: store.entries() for strided, store in stores.items()}
    for store in stores.values():
        store.select_batch(torch.tensor([1, 0]))
    _same_entries_and_views(stores[True], stores[False])
    assert stores[True].runs is None
    for strided, store in stores.items():
        store.restore(saved[strided])
    _same_entries_and_views(stores[True], stores[False])
    check_rows_map_to_their_segments(stores[True])


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.data())
def test_padded_and_compact_layouts_hold_the_same_entries(data):
    """Property: whatever each segment keeps, then any mix of decoding appends, ragged prompt appends (some tokens
    padding) and further compactions, stores laid out padded, in strided runs and compact hold the same entries —
    lengths, keys, values, positions and side data per segment, and the same dense view on every valid slot; the
    rows' totals each keeps (``row_totals``) are its lengths' sums."""
    stores = {}
    for layout in ("padded", "strided", "compact"):
        store = make_store()
        store.pads = lambda counts, on=layout == "padded": (  # type: ignore[method-assign]
            on and counts.numel() > 1 and int(counts.min()) != int(counts.max()))
        store.plan_runs = lambda counts, on=layout == "strided": two_runs(counts) if on else None  # type: ignore
        stores[layout] = store
    keys, values = kv(12, seed=data.draw(st.integers(0, 99)))
    for store in stores.values():
        store.append(keys, values, 0, None)
        store.ensure_extra("acc")
    position = 12
    for action in data.draw(st.lists(st.sampled_from(["keep", "step", "prompt"]), min_size=1, max_size=6)):
        lengths = stores["compact"].length
        if action == "keep":
            seed = data.draw(st.integers(0, 999))
            picks = []
            for s, n in enumerate(lengths.tolist()):
                order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + s))
                chosen = order[: data.draw(st.integers(0, n))]
                picks.append(torch.sort(chosen).values)
            counts = torch.tensor([pick.numel() for pick in picks])
            width = max(1, int(counts.max()))
            local = torch.stack([torch.cat([pick, torch.full((width - pick.numel(),), width, dtype=torch.long)])
                                 for pick in picks])
            for store in stores.values():
                store.keep(local, counts)
            uneven = int(counts.min()) != int(counts.max())
            assert stores["padded"].is_padded == uneven and not stores["compact"].is_padded
            assert (stores["strided"].runs is not None or stores["strided"].is_padded) == uneven
            assert stores["compact"].runs is None
        elif action == "step":
            new_keys, new_values = kv(1, seed=position)
            for store in stores.values():
                store.append(new_keys, new_values, position, None)
                store.add_to_appended("acc", torch.full((B, H, 1), float(position)))
            position += 1
        else:
            q = data.draw(st.integers(1, 3))
            token_valid = torch.tensor([[data.draw(st.booleans()) for _ in range(q)] for _ in range(B)])
            new_keys, new_values = kv(q, seed=position)
            for store in stores.values():
                store.append(new_keys, new_values, position, token_valid)
            position += q
        _same_entries_and_views(stores["padded"], stores["compact"])  # views read between actions too
        _same_entries_and_views(stores["strided"], stores["compact"])
        check_rows_map_to_their_segments(stores["strided"])
        for store in stores.values():  # the rows' totals kept by the appends are the lengths' sums
            assert store.row_totals() == store.lengths().sum(dim=1).tolist()


def test_heads_too_uneven_to_pad_but_too_even_to_group_are_laid_out_in_runs_not_compact():
    """No length groups pay (one padded view would do) but padding every head to the longest exceeds the cap: the
    layout was compact, its decoding step gathering a padded view of every entry; on a CPU it is now strided runs
    under the cap when they cost less than that gather — the same entries, views and decoding output as the compact
    twin. Heads as even as the cap allows stay padded; elsewhere than a CPU (not measured) the layout stays compact."""
    from kvsieve.cache import length_groups
    from kvsieve.cache.store_compaction import padding_limit
    from kvsieve.engine.attention_output import packed_decoding_output, ragged_decoding_output

    counts = torch.tensor([40, 60, 50, 80, 45, 70])
    assert length_groups.plan_groups(counts) is None and padding_limit(counts) < 6 * 80  # the case: neither
    store, twin = _kept_beside_a_compact_twin(counts, 96, seed=5)
    assert twin.runs is None and not twin.is_padded  # compact
    assert store.runs is not None and not store.is_padded and len(store.runs) == 2
    assert int(store.capacity.sum()) <= padding_limit(counts)
    _same_entries_and_views(store, twin)
    query = torch.randn(B, 2 * H, 1, D, generator=torch.Generator().manual_seed(6))
    in_runs = ragged_decoding_output(store, query, 0.5)
    view = twin.dense()
    assert in_runs is not None and ragged_decoding_output(twin, query, 0.5) is None
    torch.testing.assert_close(in_runs, packed_decoding_output(query, view.keys, view.values, 0.5, view.valid))
    assert store.plan_runs(torch.tensor([40, 44, 42, 48, 41, 46])) is None  # under the cap: padded
    assert length_groups.compact_step_cost(6, 80, torch.device("cuda")) is None


def _same_entries_and_views(padded: LayerStore, compact: LayerStore) -> None:
    """The same lengths and per-segment entries, and the same dense view on every valid slot."""
    assert torch.equal(padded.length, compact.length)
    for b in range(B):
        for h in range(H):
            for got, want in zip(segment(padded, b, h), segment(compact, b, h), strict=True):
                assert torch.equal(got, want)
    view_p, view_c = padded.dense(), compact.dense()
    valid = view_c.valid if view_c.valid is not None else torch.ones(view_c.keys.shape[:3], dtype=torch.bool)
    assert view_p.keys.shape == view_c.keys.shape
    assert torch.equal(view_p.valid if view_p.valid is not None else torch.ones_like(valid), valid)
    assert torch.equal(view_p.positions[valid], view_c.positions[valid])
    assert torch.equal(view_p.extras["acc"][valid], view_c.extras["acc"][valid])
    assert torch.equal(view_p.keys[valid], view_c.keys[valid])
    assert torch.equal(view_p.values[valid], view_c.values[valid])



def test_decoding_appends_on_a_ragged_layout_keep_their_positions_and_fills(layout):
    """Decoding appends on a ragged layout take their rows from a table built for the next steps, which writes the
    positions consecutive steps will have and the side data's fill ahead: a step at another position (a jump, as
    after a skipped token) still stores its own, every appended entry's side data starts at the fill, and the
    held entries are the appended keys, values and positions, in every layout."""
    store = make_store()
    keys, values = kv(40, seed=90)
    store.append(keys, values, 0, None)
    store.ensure_extra("acc")
    store.add_dense("acc", torch.full((B, H, 40), 7.0))
    counts = torch.tensor([3, 30, 4, 28, 5, 31])
    local = torch.stack([torch.cat([torch.arange(40 - int(n), 40), torch.zeros(32 - int(n), dtype=torch.long)])
                         for n in counts])  # each segment keeps its newest entries
    store.keep(local, counts)
    appended = []
    for step, position in enumerate([40, 41, 57, 58, 59, 200]):
        k, v = kv(1, seed=100 + step)
        store.append(k, v, position, None)
        appended.append((k, v, position))
    for b in range(B):
        for h in range(H):
            stored_keys, stored_values, stored_positions = segment(store, b, h)
            n = len(appended)
            assert stored_positions[-n:].tolist() == [40, 41, 57, 58, 59, 200]
            assert torch.equal(stored_keys[-n:], torch.stack([k[b, h, 0] for k, _, _ in appended]))
            assert torch.equal(stored_values[-n:], torch.stack([v[b, h, 0] for _, v, _ in appended]))
            s = b * H + h
            start, length = int(store.start[s]), int(store.length[s])
            side = store.extras["acc"][start : start + length]
            assert side[-n:].tolist() == [0.0] * n and side[:-n].tolist() == [7.0] * (length - n)
