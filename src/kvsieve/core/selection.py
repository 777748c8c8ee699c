"""What a selector hands the kernel at a decoding step when it also mixes the output (SparQ's mean value)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Selection:
    """A subset plus an output mix: ``weight · attn(subset) + (1 − weight) · fallback`` (SparQ's mean value).

    ``indices`` ``(batch, q_heads, k)`` as :meth:`Selector.select` returns them; ``weight``
    ``(batch, q_heads)`` and ``fallback`` ``(batch, q_heads, d)``.
    """

    indices: torch.Tensor
    weight: torch.Tensor
    fallback: torch.Tensor
