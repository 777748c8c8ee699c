"""The low-precision tier of a layer (KIVI groups, Liu et al., 2024, arXiv:2402.02750): what is stored reads
back as the recipe says, removals keep the rest bit for bit, and the bytes are really packed."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_quantize_ops import _kivi_by_hand

from kvsieve.cache.quantized_tier import QuantizedTier

D = 16


def _entries(counts: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n = sum(counts)
    keys = torch.randn(n, D, generator=gen) * 2
    keys[:, 3] += 9  # an outlier channel
    values = torch.randn(n, D, generator=gen)
    positions = torch.cat([torch.arange(c) * 3 + 1 for c in counts]) if n else torch.zeros(0, dtype=torch.long)
    return keys, values, positions


def _tier(bits: int = 4, group: int = 4, batch: int = 2, heads: int = 2) -> QuantizedTier:
    return QuantizedTier(batch, heads, D, bits, group, value_group=8, dtype=torch.float32, device=torch.device("cpu"))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_entries_read_back_as_the_recipe_says(bits):
    counts = [5, 0, 8, 3]  # segments b·heads + h, ragged, one empty
    keys, values, positions = _entries(counts, bits)
    tier = _tier(bits)
    tier.add(keys, values, positions, torch.tensor(counts))
    k, v, pos, valid = tier.dense()
    assert tier.lengths().flatten().tolist() == counts
    start = 0
    for seg, count in enumerate(counts):
        b, h = divmod(seg, 2)
        got = valid[b, h].nonzero().flatten()
        assert got.numel() == count
        assert torch.equal(pos[b, h, got], positions[start:start + count])
        for first in range(0, count, 4):  # key groups: G consecutive entries, per channel
            members = slice(start + first, start + min(first + 4, count))
            expected = _kivi_by_hand(keys[members], bits, keys[members].shape[0], per_channel=True)
            torch.testing.assert_close(k[b, h, got[first:first + 4]], expected, rtol=0, atol=0)
        expected_v = _kivi_by_hand(values[start:start + count], bits, 8, per_channel=False)
        torch.testing.assert_close(v[b, h, got], expected_v, rtol=0, atol=0)
        start += count


@given(counts=st.lists(st.integers(0, 9), min_size=4, max_size=4), seed=st.integers(0, 999),
       data=st.data())
@settings(max_examples=30, deadline=None, derandomize=True)
def test_removals_keep_the_rest_bit_for_bit_and_free_empty_groups(counts, seed, data):
    keys, values, positions = _entries(counts, seed)
    tier = _tier(2)
    tier.add(keys, values, positions, torch.tensor(counts))
    k, v, pos, valid = tier.dense()
    drawn = data.draw(st.lists(st.booleans(), min_size=valid.numel(), max_size=valid.numel()))
    keep = valid & torch.tensor(drawn, dtype=torch.bool).view(valid.shape)
    before = tier.kv_nbytes()
    tier.keep(keep)
    k2, v2, pos2, valid2 = tier.dense()
    assert tier.lengths().tolist() == keep.sum(-1).tolist()
    for b in range(2):
        for h in range(2):
            kept = keep[b, h].nonzero().flatten()
            now = valid2[b, h].nonzero().flatten()
            assert torch.equal(pos2[b, h, now], pos[b, h, kept])
            assert torch.equal(k2[b, h, now], k[b, h, kept]) and torch.equal(v2[b, h, now], v[b, h, kept])
    assert tier.kv_nbytes() <= before
    assert bool(tier.valid.any(dim=1).all())  # no group without an entry is held


def test_later_entries_follow_each_segments_earlier_ones():
    tier = _tier(4, batch=1, heads=2)
    keys, values, positions = _entries([3, 2], 0)
    tier.add(keys, values, positions, torch.tensor([3, 2]))
    more_k, more_v, _ = _entries([1, 4], 1)
    tier.add(more_k, more_v, torch.tensor([100, 200, 201, 202, 203]), torch.tensor([1, 4]))
    _, _, pos, valid = tier.dense()
    assert pos[0, 0][valid[0, 0]].tolist() == [1, 4, 7, 100]
    assert pos[0, 1][valid[0, 1]].tolist() == [1, 4, 200, 201, 202, 203]


def test_bytes_are_packed_codes_and_float16_parameters():
    tier = _tier(2, group=4, batch=1, heads=1)
    keys, values, positions = _entries([8], 0)
    tier.add(keys, values, positions, torch.tensor([8]))
    codes = 2 * 8 * D * 2 // 8  # keys and values, 2 bits a number
    key_params = 2 * 2 * D * 2  # two groups × (step, minimum) × channels × 2 bytes
    value_params = 8 * 2 * (D // 8) * 2  # every token × (step, minimum) × channel groups × 2 bytes
    assert tier.kv_nbytes() == codes + key_params + value_params
    assert tier.kv_nbytes() < 8 * D * 2 * 2  # less than the same entries in bfloat16


def test_bad_arguments_name_the_parameter():
    with pytest.raises(ValueError, match="bits must be one of"):
        QuantizedTier(1, 1, D, 3, 4, 8, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="value_group must divide head_dim"):
        QuantizedTier(1, 1, D, 4, 4, 5, torch.float32, torch.device("cpu"))
    tier = _tier()
    with pytest.raises(ValueError, match="counts sum to"):
        tier.add(torch.zeros(3, D), torch.zeros(3, D), torch.zeros(3, dtype=torch.long), torch.tensor([1, 1, 0, 0]))
