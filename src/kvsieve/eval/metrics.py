"""Scores of generated text and distances between a compressed cache's predictions and the full cache's.

Text metrics (RULER, Hsieh et al. 2024, ``eval/synthetic/constants.py``), case-insensitive substring
matches of each reference in the prediction, for one sample:

* :func:`string_match_all`: the fraction of references found (RULER's metric for every synthetic task);
* :func:`string_match_part`: 1 if any reference is found (RULER's metric for its QA tasks);
* :func:`first_number_match`: the first number in the output equals the first reference (passkey).

Distribution metrics, all teacher-forced (both caches see the same tokens) over an answer span, from
log-probability rows ``(n, vocab)`` where row ``i`` is the next-token distribution predicting token
``i`` of the span:

* :func:`token_logprobs` / :func:`answer_logprob`: log-likelihood of the reference answer;
* :func:`logprob_gap`: ``full - compressed`` (positive: the compressed cache finds the answer less likely);
* :func:`kl_per_position` / :func:`mean_kl`: ``KL(full ‖ compressed)`` per position and its mean;
* :func:`coarse_kl_per_position`: the same over the full cache's top-k tokens plus one "rest" bucket
  (for long spans where storing full rows is too big; a lower bound of the exact KL).

:func:`kvsieve.eval.passes.teacher_forced_logprobs` computes such rows for any cache.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import torch

_NUMBER = re.compile(r"\d+")


def _found(prediction: str, references: Sequence[str]) -> list[float]:
    text = prediction.lower()
    return [1.0 if ref.lower() in text else 0.0 for ref in references]


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """Fraction of ``references`` that occur in ``prediction`` (case-insensitive); 0 with no references."""
    found = _found(prediction, references)
    return sum(found) / len(found) if found else 0.0


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """1.0 if any reference occurs in ``prediction`` (case-insensitive), else 0.0."""
    return max(_found(prediction, references), default=0.0)


def first_number(text: str) -> str | None:
    """The first run of digits in ``text``, or None."""
    match = _NUMBER.search(text)
    return match.group() if match else None


def first_number_match(prediction: str, references: Sequence[str]) -> float:
    """1.0 if the first number in ``prediction`` equals ``references[0]`` exactly, else 0.0."""
    return float(bool(references) and first_number(prediction) == references[0])


#: Metric name → ``metric(prediction, references) -> float`` in [0, 1].
METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
    "first_number": first_number_match,
}


def token_logprobs(logprobs: torch.Tensor, targets: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Log-probability of each target token: ``logprobs[i, targets[i]]``, shape ``(n,)``."""
    index = torch.as_tensor(targets, dtype=torch.long, device=logprobs.device).view(-1, 1)
    return logprobs.gather(1, index).squeeze(1)


def answer_logprob(logprobs: torch.Tensor, targets: Sequence[int] | torch.Tensor) -> float:
    """Teacher-forced log-likelihood of the whole answer: the sum of :func:`token_logprobs`."""
    return float(token_logprobs(logprobs, targets).double().sum())


def logprob_gap(full: float, compressed: float) -> float:
    """``full - compressed`` answer log-likelihood (≥ 0 when compression makes the answer less likely)."""
    return full - compressed


def kl_per_position(full: torch.Tensor, compressed: torch.Tensor) -> torch.Tensor:
    """``KL(full ‖ compressed)`` of each row of two log-probability tensors ``(n, vocab)``, in float64.

    Rows are normalised log-probabilities (``log_softmax``). Rounding can make an exact 0 slightly
    negative; values are clamped at 0.
    """
    if full.shape != compressed.shape:
        raise ValueError(f"shapes differ: {tuple(full.shape)} vs {tuple(compressed.shape)}")
    p_log = full.double()
    kl = (p_log.exp() * (p_log - compressed.double())).sum(-1)
    return kl.clamp_min(0.0)


def mean_kl(full: torch.Tensor, compressed: torch.Tensor) -> float:
    """Mean of :func:`kl_per_position` over the span (0.0 for an empty span)."""
    if full.shape[0] == 0:
        return 0.0
    return float(kl_per_position(full, compressed).mean())


def top_logprobs(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely token ids ``(n, k)`` (int64) and their log-probabilities ``(n, k)``."""
    values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return ids, values


def _log_rest(top: torch.Tensor) -> torch.Tensor:
    """``log(1 - Σ exp(top))`` per row, floored at ``log(1e-30)``."""
    return torch.log((1.0 - top.exp().sum(-1)).clamp_min(1e-30))


def coarse_kl_per_position(
    full_ids: torch.Tensor, full_top: torch.Tensor, compressed: torch.Tensor
) -> torch.Tensor:
    """``KL(full ‖ compressed)`` over the full cache's top-k tokens plus one bucket for the rest, float64.

    ``full_ids``/``full_top`` are :func:`top_logprobs` of the full cache's rows, ``compressed`` the
    compressed cache's rows ``(n, vocab)``. Merging the other tokens into one outcome can only lower
    the divergence (data-processing inequality); with ``k = vocab`` it is the exact KL.
    """
    p_log = full_top.double()
    q_log = compressed.double().gather(1, full_ids.long())
    kl = (p_log.exp() * (p_log - q_log)).sum(-1)
    if full_ids.shape[-1] < compressed.shape[-1]:
        p_rest, q_rest = _log_rest(p_log), _log_rest(q_log)
        kl = kl + p_rest.exp() * (p_rest - q_rest)
    return kl.clamp_min(0.0)
