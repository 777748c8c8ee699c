"""The kernel's attention statistics (``column_sums``, ``attention_rows``) against a dense softmax reference.

``column_sums`` works in blocks of ``QUERY_BLOCK`` queries, reads only the keys up to the last visible
one and masks only the columns some query of the block cannot see: these tests cover several blocks,
padding (queries that see nothing), sliding windows and arbitrary masks, given whole or per block.
"""

from __future__ import annotations

import pytest
import torch

from kvsieve.attention import kernel
from kvsieve.attention.kernel import (
    QUERY_BLOCK,
    AttentionForm,
    Visibility,
    all_along,
    any_along,
    attention_and_column_maxima,
    attention_and_column_sums,
    attention_rows,
    column_maxima,
    column_sums,
    query_block_rows,
    visibility_mask,
    window_attention_rows,
    window_column_sums,
)

BATCH, Q_HEADS, KV_HEADS, D = 2, 6, 2, 8
GROUPS = Q_HEADS // KV_HEADS
SCALE = D**-0.5


def dense_rows(query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Softmax rows ``(batch, q_heads, q, n)`` in float64; rows that see nothing are zero."""
    logits = query.double() @ keys.double().repeat_interleave(GROUPS, dim=1).transpose(-1, -2) * SCALE
    if bias is not None:
        logits = logits + bias.double().repeat_interleave(GROUPS, dim=1)[:, :, None, :]
    full_mask = mask.repeat_interleave(GROUPS, dim=1) if mask.shape[1] == KV_HEADS else mask
    probs = torch.softmax(logits.masked_fill(~full_mask, float("-inf")), dim=-1)
    return torch.nan_to_num(probs, nan=0.0)


def case(kind: str, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(BATCH, Q_HEADS, n, D, generator=generator)
    keys = torch.randn(BATCH, KV_HEADS, n, D, generator=generator)
    positions = torch.arange(n)
    key_positions = positions.view(1, 1, n).expand(BATCH, KV_HEADS, n)
    valid = None
    window = None
    if kind == "padded":  # row 0 left-padded by 37 entries: its first 37 queries see nothing
        valid = torch.ones(BATCH, KV_HEADS, n, dtype=torch.bool)
        valid[0, :, :37] = False
    if kind == "window":
        window = 100
    mask = visibility_mask(positions, key_positions, valid, window)
    if kind == "random":
        mask = torch.rand(BATCH, KV_HEADS, n, n, generator=generator) > 0.4
    bias = torch.rand(BATCH, KV_HEADS, n, generator=generator) * 2.0 if kind == "bias" else None
    return query, keys, mask, bias


@pytest.mark.parametrize("kind", ["causal", "padded", "window", "random", "bias"])
@pytest.mark.parametrize("per_block", [False, True])
def test_column_sums_equal_dense_reference_over_several_blocks(kind, per_block):
    n = 2 * QUERY_BLOCK + 77
    query, keys, mask, bias = case(kind, n, seed=len(kind))
    weight = torch.ones(BATCH, n)
    weight[1, 5:9] = 0.0  # weighted-out queries add nothing
    expected = (dense_rows(query, keys, mask, bias) * weight[:, None, :, None].double()).sum(dim=2)
    given = (lambda lo, hi: mask[:, :, lo:hi]) if per_block else mask
    got = column_sums(query, keys, given, SCALE, weight, bias)
    assert got.shape == (BATCH, Q_HEADS, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=1e-5)
    assert not torch.isnan(got).any()


def test_query_block_rows_fit_their_byte_budgets():
    """CPU blocks hold ~24 MiB of float32 logits (16–64 rows, a power of two); device blocks ~512 MiB, never
    fewer than 256 rows (the default model's 9 query heads; Llama-8B's 32 at 8k)."""
    cpu, device = torch.device("cpu"), torch.device("meta")
    shapes = ((1, 1024), (1, 8192), (1, 16384), (8, 4096))
    assert [query_block_rows(b, 9, n, cpu) for b, n in shapes] == [64, 64, 32, 16]
    shapes = ((1, 9, 4096), (1, 9, 8192), (8, 9, 8192), (1, 32, 8192), (1, 9, 512))
    assert [query_block_rows(b, q, n, device) for b, q, n in shapes] == [2048, 1024, 256, 512, 16384]
    for b, q, n in ((1, 9, 4096), (2, 32, 3000), (1, 9, 100)):
        rows = query_block_rows(b, q, n, device)
        assert rows & (rows - 1) == 0 and (rows == 256 or rows * b * q * n * 4 <= kernel.DEVICE_BLOCK_BYTES)


@pytest.mark.parametrize("rows", [7, 2048])
def test_one_block_or_odd_blocks_give_the_dense_reference(rows, monkeypatch):
    """Blocks larger than the prompt (a GPU's, one block) and blocks not dividing it give the reference sums."""
    monkeypatch.setattr(kernel, "query_block_rows", lambda *args: rows)
    n = 2 * QUERY_BLOCK + 77
    for kind in ("causal", "padded", "window"):
        query, keys, mask, _ = case(kind, n, seed=3)
        positions = torch.arange(n).view(1, 1, n).expand(BATCH, KV_HEADS, n)
        valid = mask.any(dim=2) if kind == "padded" else None
        visibility = Visibility(0, positions, valid, 100 if kind == "window" else None)
        got = column_sums(query, keys, visibility, SCALE)
        torch.testing.assert_close(got.double(), dense_rows(query, keys, mask, None).sum(dim=2), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["causal", "padded", "window", "random", "bias"])
@pytest.mark.parametrize("per_block", [False, True])
def test_column_maxima_equal_dense_reference_and_skip_padding_queries(kind, per_block):
    """KVzip's statistic: ``max_t A[t, j]`` over the non-padding queries, with the blocks, key cropping and partial
    masking of the sums; the one-pass variant gives the same maxima bit for bit and the reference ``A·V``."""
    n = 2 * QUERY_BLOCK + 77
    query, keys, mask, bias = case(kind, n, seed=len(kind) + 7)
    valid = torch.ones(BATCH, n, dtype=torch.bool)
    valid[1, 5:9] = False
    valid[0, -3:] = False  # the newest queries see the most: dropping them changes the maxima
    rows = dense_rows(query, keys, mask, bias) * valid[:, None, :, None].double()
    expected = rows.amax(dim=2)
    given = (lambda lo, hi: mask[:, :, lo:hi]) if per_block else mask
    got = column_maxima(query, keys, given, SCALE, valid, bias)
    assert got.shape == (BATCH, Q_HEADS, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, atol=1e-6, rtol=1e-5)
    values = torch.randn(BATCH, KV_HEADS, n, D, generator=torch.Generator().manual_seed(2))
    output, best = attention_and_column_maxima(query, keys, values, given, SCALE, valid, bias)
    assert torch.equal(best, got)
    reference = (dense_rows(query, keys, mask, bias) @ values.double().repeat_interleave(GROUPS, dim=1))
    torch.testing.assert_close(output.double(), reference.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_column_sums_of_a_causal_prefill_count_every_query_once():
    n = QUERY_BLOCK + 40
    query, keys, mask, _ = case("causal", n, seed=3)
    total = column_sums(query, keys, mask, SCALE).sum(dim=-1)
    torch.testing.assert_close(total, torch.full((BATCH, Q_HEADS), float(n)), atol=1e-3, rtol=0)


def test_attention_rows_without_a_mask_is_the_plain_softmax():
    query, keys, mask, bias = case("bias", 30, seed=5)
    last = query[:, :, -1:]
    expected = dense_rows(last, keys, torch.ones(BATCH, KV_HEADS, 1, 30, dtype=torch.bool), bias)
    got = attention_rows(last, keys, None, SCALE, bias)
    torch.testing.assert_close(got.double(), expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got, attention_rows(last, keys, mask[:, :, -1:], SCALE, bias))


@pytest.mark.parametrize("seed", range(4))
def test_byte_reductions_equal_torch_any_all(seed):
    generator = torch.Generator().manual_seed(seed)
    mask = torch.rand(3, 5, 7, generator=generator) > (0.1 + 0.25 * seed)
    strided = mask.transpose(0, 2)  # non-contiguous input
    for tensor in (mask, strided):
        for dim in range(tensor.dim()):
            assert torch.equal(any_along(tensor, dim), tensor.any(dim=dim))
            assert torch.equal(all_along(tensor, dim), tensor.all(dim=dim))
            assert torch.equal(any_along(tensor, dim, keepdim=True), tensor.any(dim=dim, keepdim=True))


@pytest.mark.parametrize("kind", ["causal", "padded", "window", "random", "bias"])
def test_one_pass_output_and_column_sums(kind):
    """``attention_and_column_sums``: the column sums are bit-identical to ``column_sums`` (same blocks, same
    probabilities) and the output equals the dense softmax reference's ``A·V`` (float64) within 1e-5; queries
    that see nothing get a zero output."""
    n = 2 * QUERY_BLOCK + 77
    query, keys, mask, bias = case(kind, n, seed=len(kind) + 1)
    values = torch.randn(BATCH, KV_HEADS, n, D, generator=torch.Generator().manual_seed(9))
    weight = torch.ones(BATCH, n)
    weight[1, 5:9] = 0.0
    output, sums = attention_and_column_sums(query, keys, values, mask, SCALE, weight, bias)
    assert torch.equal(sums, column_sums(query, keys, mask, SCALE, weight, bias))
    rows = dense_rows(query, keys, mask, bias)
    expected = (rows @ values.double().repeat_interleave(GROUPS, dim=1)).transpose(1, 2)
    assert output.shape == (BATCH, n, Q_HEADS, D) and output.dtype == values.dtype
    torch.testing.assert_close(output.double(), expected, atol=1e-5, rtol=1e-5)


def test_one_pass_output_matches_sdpa_in_bfloat16():
    """On bfloat16 inputs (what the model runs) the one-pass output follows SDPA's own recipe (float32 logits
    and softmax, probabilities rounded to bfloat16 for ``P·V``, float32 accumulation, one rounding of the
    output), so its error from the exact result (float64) is of SDPA's size: the mean within 1.5× SDPA's, the
    largest within 2× (measured: 3.0e-4 / 1.1e-2 against SDPA's 2.7e-4 / 8.0e-3), and the mean within two
    bfloat16 epsilons of the outputs' size. (A float32 ``P·V`` would give the exact result rounded once, at
    5–6× the cost of the bfloat16 product on CPUs with native bfloat16.)"""
    n = QUERY_BLOCK + 50
    query, keys, mask, _ = case("causal", n, seed=3)
    values = torch.randn(BATCH, KV_HEADS, n, D, generator=torch.Generator().manual_seed(4))
    q, k, v = query.bfloat16(), keys.bfloat16(), values.bfloat16()
    output, _ = attention_and_column_sums(q, k, v, mask, SCALE)
    assert output.dtype == torch.bfloat16

    def sdpa(q, k, v):
        k, v = k.repeat_interleave(GROUPS, dim=1), v.repeat_interleave(GROUPS, dim=1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE).transpose(1, 2)

    exact = sdpa(q.double(), k.double(), v.double())
    ours = (output.double() - exact).abs()
    theirs = (sdpa(q, k, v).double() - exact).abs()
    assert ours.mean() <= 1.5 * theirs.mean()
    assert ours.max() <= 2.0 * theirs.max()
    assert ours.mean() <= 2 * torch.finfo(torch.bfloat16).eps * exact.abs().mean()


@pytest.mark.parametrize("kind", ["causal", "padded", "window", "shuffled", "shuffled_window"])
@pytest.mark.parametrize("first", [0, 40])
def test_visibility_bounds_give_the_same_blocks_as_the_reduced_mask(kind, first):
    """:class:`Visibility` finds each block's cropped and masked columns from one comparison per column; the
    blockwise passes then give bit for bit what the same mask given as a function gives (which reduces the
    whole block mask), with several blocks, left padding, a sliding window, entries out of position order
    (after a merge or a tier's view) and queries that continue a prompt (``first`` > 0)."""
    n = 2 * QUERY_BLOCK + 77
    q_len = n - first
    generator = torch.Generator().manual_seed(first + len(kind))
    query = torch.randn(BATCH, Q_HEADS, q_len, D, generator=generator)
    keys = torch.randn(BATCH, KV_HEADS, n, D, generator=generator)
    values = torch.randn(BATCH, KV_HEADS, n, D, generator=generator)
    positions = torch.arange(n).view(1, 1, n).expand(BATCH, KV_HEADS, n).clone()
    valid = None
    window = 100 if kind.endswith("window") else None
    if kind == "padded":
        valid = torch.ones(BATCH, KV_HEADS, n, dtype=torch.bool)
        valid[0, :, :37] = False
    if kind.startswith("shuffled"):
        positions = torch.stack([torch.randperm(n, generator=generator) for _ in range(BATCH * KV_HEADS)])
        positions = positions.view(BATCH, KV_HEADS, n)
    visibility = Visibility(first, positions, valid, window)

    def reduced(lo: int, hi: int) -> torch.Tensor:
        return visibility_mask(torch.arange(first + lo, first + hi), positions, valid, window)

    for lo, hi in ((0, 16), (16, 80), (q_len - 16, q_len)):
        assert torch.equal(visibility(lo, hi), reduced(lo, hi))
        mask = reduced(lo, hi).flatten(0, -2)
        seen, everyone = mask.any(dim=0), mask.all(dim=0)
        limit, first_hidden = visibility.bounds(lo, hi)
        assert limit == (int(seen.nonzero().max()) + 1 if seen.any() else 0)
        assert first_hidden == (int((~everyone).nonzero().min()) if not everyone.all() else n)
    weight = torch.ones(BATCH, q_len)
    weight[1, 3:6] = 0.0
    for fast, slow in ((column_sums(query, keys, visibility, SCALE, weight),
                        column_sums(query, keys, reduced, SCALE, weight)),
                       (column_maxima(query, keys, visibility, SCALE), column_maxima(query, keys, reduced, SCALE))):
        assert torch.equal(fast, slow)
    fast_out, fast_sums = attention_and_column_sums(query, keys, values, visibility, SCALE, weight)
    slow_out, slow_sums = attention_and_column_sums(query, keys, values, reduced, SCALE, weight)
    assert torch.equal(fast_out, slow_out) and torch.equal(fast_sums, slow_sums)
    assert not torch.isnan(fast_out).any()


@pytest.mark.parametrize("kind", ["causal", "padded", "window", "shuffled", "blind", "capped_sinks_bias"])
@pytest.mark.parametrize("first", [0, 40])
def test_window_rows_mask_only_what_some_query_cannot_see_and_equal_the_full_mask(kind, first, monkeypatch):
    """SnapKV's window rows (the forward's last ``w`` queries) masked from :class:`Visibility`'s bounds — columns no
    query sees filled, only the hidden square compared — are bit for bit the rows under the whole ``w × n`` mask:
    causal, left padding, a sliding window, entries out of position order, a window whose first query sees nothing
    (padding: zero rows, not NaN), soft-capping with sinks and a per-entry bias."""
    n, w = 3 * 64 + 5, 32
    generator = torch.Generator().manual_seed(first + len(kind))
    query = torch.randn(BATCH, Q_HEADS, w, D, generator=generator)
    keys = torch.randn(BATCH, KV_HEADS, n, D, generator=generator)
    positions = torch.arange(n).view(1, 1, n).expand(BATCH, KV_HEADS, n).clone()
    valid, window, bias = None, None, None
    form = AttentionForm(SCALE)
    if kind == "padded":
        valid = torch.ones(BATCH, KV_HEADS, n, dtype=torch.bool)
        valid[0, :, :37] = False
    if kind == "window":
        window = 20
    if kind == "shuffled":
        positions = torch.stack([torch.randperm(n, generator=generator) for _ in range(BATCH * KV_HEADS)])
        positions = positions.view(BATCH, KV_HEADS, n)
    start = n - w + first  # the window's first query position (a continued prompt when first > 0)
    if kind == "blind":  # every entry after the window's first query: it sees nothing, the later ones a few
        positions = positions + start + 1
    if kind == "capped_sinks_bias":
        form = AttentionForm(SCALE, softcap=5.0, sinks=torch.randn(Q_HEADS, generator=generator))
        bias = torch.rand(BATCH, KV_HEADS, n, generator=generator)
    visibility = Visibility(start, positions, valid, window)
    full = visibility_mask(torch.arange(start, start + w), positions, valid, window)
    got = window_attention_rows(query, keys, visibility, form, bias)
    assert torch.equal(got, attention_rows(query, keys, full, form, bias))
    assert not torch.isnan(got).any()
    if kind == "blind":
        assert got[:, :, 0].abs().sum() == 0 and got[:, :, -1].sum() > 0
    # SnapKV's vote without holding the rows: one KV head (and some batch rows) at a time, the same sums bit for bit
    weight = torch.ones(BATCH, w)
    weight[1, :5] = 0.0  # left-padding queries of the second row
    for chunk in (1, 10**9):  # one batch row per chunk / every row in one
        monkeypatch.setattr(kernel, "WINDOW_CHUNK_BYTES", chunk)
        assert torch.equal(window_attention_rows(query, keys, visibility, form, bias), got)  # the rows chunk by chunk
        # one KV head's group: one chunk, returned without a copy
        one_head = Visibility(start, positions[:, :1], None if valid is None else valid[:, :1], window)
        groups = Q_HEADS // KV_HEADS
        group_form = AttentionForm(form.scaling, form.softcap, None if form.sinks is None else form.sinks[:groups])
        assert torch.equal(window_attention_rows(query[:, :groups], keys[:, :1], one_head, group_form,
                                                 None if bias is None else bias[:, :1]), got[:, :groups])
        for given in (None, weight):
            sums = window_column_sums(query, keys, visibility, form, bias, given)
            rows = got if given is None else got * given[:, None, :, None]
            assert torch.equal(sums, rows.sum(dim=2))

