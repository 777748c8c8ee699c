"""Per-entry side data: what a policy part keeps next to each entry (H2O's accumulated attention, merge
counts, retention gates...), declared once and moved with its entries by the store."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SideSpec:
    """Per-entry side data a policy part keeps: ``name``, trailing ``shape``, ``dtype`` and the value of new entries."""

    name: str
    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32
    fill: float = 0.0
