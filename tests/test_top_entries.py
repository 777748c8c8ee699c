"""``top_entries``: the kept entries of each head in position order, whether every head drops one entry
(compaction at every decoding step), every head keeps as many, or heads keep different numbers.

Its ties are broken by ``torch.topk`` (recorded in the engine regression replay: a shortcut that dropped each
head's ``argmin`` when every head drops one entry broke exact ties differently and was not adopted)."""

from __future__ import annotations

import pytest
import torch

from kvsieve.ops.topk import top_entries


def reference(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Each row's ``counts`` highest scores' indices, ascending, filled with ``L`` up to the widest row."""
    batch, heads, length = scores.shape
    width = int(counts.max())
    rows = []
    for row, count in zip(scores.reshape(batch * heads, length), counts.reshape(-1).tolist(), strict=True):
        kept = sorted(torch.argsort(row, descending=True)[:count].tolist())
        rows.append(kept + [length] * (width - count))
    return torch.tensor(rows)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("route", ["drop_one", "uniform", "ragged"])
def test_top_entries_keep_each_heads_highest_scores_in_position_order(route, seed):
    generator = torch.Generator().manual_seed(seed)
    batch, heads, length = 2, 3, 17
    scores = torch.randn(batch, heads, length, generator=generator)
    scores[0, 1, :2] = float("-inf")  # padding slots, never kept while counts fit the real entries
    if route == "drop_one":
        scores[0, 1, :2] = torch.randn(2, generator=generator)  # one dropped per head: no padding here
        counts = torch.full((batch, heads), length - 1)
    elif route == "uniform":
        counts = torch.full((batch, heads), 9)
    else:
        counts = torch.randint(1, length - 2, (batch, heads), generator=generator)
    kept = top_entries(scores, counts)
    assert torch.equal(kept, reference(scores, counts))


def test_dropping_one_entry_drops_the_padding_slot():
    scores = torch.randn(1, 2, 8, generator=torch.Generator().manual_seed(3))
    scores[0, 0, 0] = float("-inf")
    kept = top_entries(scores, torch.tensor([[7, 7]]))
    assert kept[0].tolist() == list(range(1, 8))
    assert torch.equal(kept, reference(scores, torch.tensor([[7, 7]])))
