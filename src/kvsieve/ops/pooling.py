"""1-D pooling of scores along the sequence (SnapKV clustering, Li et al. 2024, Sec. 4.2)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pool_scores(scores: torch.Tensor, kernel_size: int, pooling: str = "avgpool",
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Smooth ``(..., n)`` scores with a centred 1-D window of odd ``kernel_size`` (stride 1, same length), in
    ``dtype`` (float32, or float64 for scores that must come out the same in another implementation).

    ``avgpool`` divides by the full kernel (zero padding, like SnapKV's reference code); ``maxpool``
    takes the window maximum. ``kernel_size`` 1 returns the scores unchanged.
    """
    if kernel_size <= 1:
        return scores
    shape = scores.shape
    flat = scores.reshape(-1, 1, shape[-1]).to(dtype)
    pad = kernel_size // 2
    if pooling == "avgpool":
        out = F.avg_pool1d(flat, kernel_size, stride=1, padding=pad, count_include_pad=True)
    elif pooling == "maxpool":
        out = F.max_pool1d(flat, kernel_size, stride=1, padding=pad)
    else:
        raise ValueError(f"pooling must be 'avgpool' or 'maxpool'; got {pooling!r}")
    return out[..., : shape[-1]].reshape(shape)
