"""Low-bit quantization ops (KIVI recipe, Liu et al., 2024, arXiv:2402.02750): packing, round trips, groups."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsieve.ops.quantize import SUPPORTED_BITS, code_table, dequantize, pack, quantize, unpack, unpack_float


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@given(n=st.integers(1, 40), seed=st.integers(0, 2**16))
@settings(max_examples=25, deadline=None, derandomize=True)
def test_pack_round_trips_and_really_packs(bits, n, seed):
    codes = torch.randint(0, 1 << bits, (3, n), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, -(-n * bits // 8))
    assert torch.equal(unpack(packed, bits, n), codes)


def test_pack_layout_is_low_bits_first():
    assert pack(torch.tensor([[1, 2, 3, 0]], dtype=torch.uint8), 2).tolist() == [[1 | 2 << 2 | 3 << 4]]
    assert pack(torch.tensor([[0xA, 0x5]], dtype=torch.uint8), 4).tolist() == [[0x5A]]


def _kivi_by_hand(x: torch.Tensor, bits: int, group: int, per_channel: bool) -> torch.Tensor:
    """The recipe written out: per group min/max, step (max-min)/(2^b-1) in float16, round, clamp, read back."""
    levels = 2**bits - 1
    out = torch.empty_like(x, dtype=torch.float32)
    rows, cols = x.shape
    if per_channel:
        slices = [(slice(r, r + group), slice(c, c + 1)) for r in range(0, rows, group) for c in range(cols)]
    else:
        slices = [(slice(r, r + 1), slice(c, c + group)) for r in range(rows) for c in range(0, cols, group)]
    for index in slices:
        block = x[index].float()
        low = block.min().half().float()
        high = block.max().half().float()
        step = ((high - low) / levels).half().float()
        codes = torch.zeros_like(block) if step == 0 else torch.round((block - low) / step).clamp(0, levels)
        out[index] = codes * step + low
    return out


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("per_channel", [True, False])
def test_matches_the_recipe_computed_by_hand(bits, per_channel):
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(bits)) * 3
    x[:, 5] += 20  # an outlier channel, as keys have
    q = quantize(x, bits, group=8, per_channel=per_channel)
    torch.testing.assert_close(dequantize(q, torch.float32), _kivi_by_hand(x, bits, 8, per_channel), rtol=0, atol=0)


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_error_is_at_most_half_a_step(bits):
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    for per_channel in (True, False):
        q = quantize(x, bits, group=16, per_channel=per_channel)
        step = q.scale.float().repeat_interleave(16, dim=0 if per_channel else 1)
        error = (dequantize(q, torch.float32) - x).abs()
        assert bool((error <= step / 2 + 2e-3 * x.abs().amax()).all())  # + float16 rounding of the minimum


def test_constant_groups_read_back_exactly_and_bytes_are_counted():
    x = torch.full((8, 16), 0.75)
    q = quantize(x, 2, group=8, per_channel=True)
    assert torch.equal(dequantize(q, torch.float32), x)
    assert q.nbytes() == 8 * 16 // 4 + 2 * 2 * 16  # packed codes + float16 step and minimum per channel


def test_bad_arguments_name_the_parameter():
    with pytest.raises(ValueError, match="bits must be one of"):
        quantize(torch.zeros(4, 4), 3, group=4, per_channel=False)
    with pytest.raises(ValueError, match="group must divide the columns"):
        quantize(torch.zeros(4, 6), 4, group=4, per_channel=False)
    with pytest.raises(ValueError, match="group must divide the rows"):
        quantize(torch.zeros(6, 4), 4, group=4, per_channel=True)


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_unpack_float_reads_the_same_codes_as_unpack(bits):
    """The word-wise table lookup (the decoding step's unpack on the CPU) gives :func:`unpack`'s codes as floats, for
    partial last bytes, a non-contiguous input and an empty one."""
    generator = torch.Generator().manual_seed(bits)
    table = code_table(bits, torch.device("cpu"))
    for rows, n in ((7, 60), (32, 64), (0, 8)):
        packed = torch.randint(0, 256, (3, rows, (n * bits + 7) // 8), dtype=torch.uint8, generator=generator)
        assert torch.equal(unpack_float(packed, table, n), unpack(packed, bits, n).float())
    wide = torch.randint(0, 256, (4, 16, 8), dtype=torch.uint8, generator=generator).transpose(0, 1)
    assert torch.equal(unpack_float(wide, table, 8 * 8 // bits), unpack(wide, bits, 8 * 8 // bits).float())
