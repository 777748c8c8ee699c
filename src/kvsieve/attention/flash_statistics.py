"""Column sums from the flash kernel's log-sum-exp: a causal prompt's output and H2O's statistic, the output SDPA's own.

On a CPU whose matrix units run bfloat16 (AMX), SDPA's flash kernel attends a 4k-token layer in ~33 ms while a
float32 pass over the causal matrix costs 130–185 ms (``benchmarks/results/statistics_prefill_amx_bf16_session23.json``,
README "statistics fused into the attention pass"). That kernel also returns each query's log-sum-exp ``lse_t`` (the
private operator :func:`~kvsieve.attention.kernel._flash_with_logsumexp` names), so the softmax need not be taken
again: ``A[t, j] = exp(s·q_t·k_j − lse_t)``, and the column sums are one float32 ``q·k`` product, one subtraction
and one ``exp`` per block — no row maximum, row sum or division, and no second ``P·V`` (the output is the kernel's).
This is how the paper of EMS computes its statistic: from the attention kernel's log-sum-exp.

Only where it is exact in form: a causal prompt on an empty store (every query sees the entries up to its own position,
no padding, no sliding window), plain attention (no soft-capping, no sinks, no bias), bfloat16, float16 or float32 on
the CPU (float32 since session 31: SDPA's CPU kernel for a float32 causal prompt is this flash kernel too, so its output
is SDPA's bit for bit, and the sums — one ``q·k`` product and one ``exp`` per probability, in C where
:mod:`kvsieve.native.column_sums` runs — cost less than the softmax pass's). Elsewhere
:func:`flash_attention_and_column_sums` returns None and the caller keeps the blockwise softmax pass. The output is the
flash kernel's — SDPA's output on the CPU bit for bit (the keys and values repeated per query head, as SDPA's
grouped-query path does) — and the sums carry that kernel's fast exponential: ~1e-5 relative to the float64 sums,
against ~1e-6 for the softmax pass (``test_flash_statistics.py``).

:func:`fused_attention_and_column_sums` takes the same prompts, float32 ones too, to a kernel the caller passes that
computes the output and the sums from one set of exponentials (the CPU's C pass, :mod:`kvsieve.native.fused_attention`:
AMX tiles for bfloat16, AVX-512 for float32): faster, but its output is its own, within bfloat16 (float32) rounding of
SDPA's, so the engine takes it only under ``fuse_statistics=True``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvsieve.attention.kernel import (
    AttentionForm,
    Visibility,
    _flash_with_logsumexp,
    _grouped_logits,
    as_form,
    query_block_rows,
)


def flash_attention_and_column_sums(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visibility: object, form: AttentionForm | float,
    query_weight: torch.Tensor | None, bias: torch.Tensor | None,
    faster_sums: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The output ``(batch, q, q_heads, d)`` and the column sums ``(batch, q_heads, n)`` of a causal prompt over its own
    entries, from the flash kernel's output and log-sum-exp; None where this route does not apply (see the module).
    ``faster_sums(query, keys, logsumexp, scaling)``, tried first for the sums, may return None for the PyTorch blocks
    (the CPU's C pass with bfloat16 dot products or float32 fused multiply-adds, :mod:`kvsieve.native.column_sums`,
    which this layer does not import)."""
    form = as_form(form)
    batch, q_heads, q_len, _ = query.shape
    kv_heads = keys.shape[1]
    if not plain_causal_prompt(query, keys, visibility, form, query_weight, bias):
        return None
    operator = _flash_with_logsumexp()
    if operator is None:
        return None
    groups = q_heads // kv_heads
    try:
        output, logsumexp = operator(query, keys.repeat_interleave(groups, dim=1),
                                     values.repeat_interleave(groups, dim=1), 0.0, True, scale=form.scaling)[:2]
    except (RuntimeError, TypeError, ValueError):  # another signature in another torch: the softmax pass instead
        return None
    if logsumexp.shape != (batch, q_heads, q_len) or logsumexp.dtype != torch.float32:
        return None
    sums = None if faster_sums is None else faster_sums(query, keys, logsumexp, form.scaling)
    if sums is None:
        sums = _column_sums(query, keys, logsumexp, form.scaling)
    return output.transpose(1, 2).contiguous(), sums


def plain_causal_prompt(query: torch.Tensor, keys: torch.Tensor, visibility: object, form: AttentionForm,
                        query_weight: torch.Tensor | None, bias: torch.Tensor | None,
                        dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)) -> bool:
    """Whether this forward is what the flash routes take: a causal prompt of at least two queries in one of
    ``dtypes`` on the CPU over its own entries only (an empty store before it), no padding, no sliding window, no
    soft-capping, sinks, bias or query weights."""
    return (query.device.type == "cpu" and query.dtype in dtypes and not form.explicit
            and bias is None and query_weight is None and isinstance(visibility, Visibility)
            and visibility.first_query == 0 and visibility.key_valid is None and visibility.sliding_window is None
            and query.shape[2] == keys.shape[2] and query.shape[2] >= 2)


def fused_attention_and_column_sums(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visibility: object, form: AttentionForm | float,
    query_weight: torch.Tensor | None, bias: torch.Tensor | None,
    kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float],
                     tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None],
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The output ``(batch, q, q_heads, d)`` and column sums ``(batch, q_heads, n)`` of the same prompts as
    :func:`flash_attention_and_column_sums` from ``kernel(query, keys, values, scaling)`` — one pass computing both,
    whose output is its own, not SDPA's (the CPU's C pass, :mod:`kvsieve.native.fused_attention`, which this layer
    does not import; it returns ``(output, logsumexp, sums)`` or None). None where this route does not apply or the
    kernel declines."""
    form = as_form(form)
    if not plain_causal_prompt(query, keys, visibility, form, query_weight, bias):
        return None
    result = kernel(query, keys, values, form.scaling)
    if result is None:
        return None
    output, _, sums = result
    return output, sums


def _column_sums(query: torch.Tensor, keys: torch.Tensor, logsumexp: torch.Tensor, scaling: float) -> torch.Tensor:
    """``Σ_t exp(s·q_t·k_j − lse_t)`` over the causal prompt's queries, ``(batch, q_heads, n)`` float32, in the query
    blocks of the softmax pass (:func:`~kvsieve.attention.kernel.query_block_rows`); each block reads the keys up to
    its last query and masks only its diagonal square."""
    batch, q_heads, q_len, _ = query.shape
    kv_heads = keys.shape[1]
    groups = q_heads // kv_heads
    scaled = query.float() * scaling
    keys = keys.float()
    shifts = logsumexp.view(batch, kv_heads, groups, q_len)
    total = torch.zeros(batch, kv_heads, groups, q_len, dtype=torch.float32, device=query.device)
    rows = query_block_rows(batch, q_heads, q_len, query.device)
    later = torch.ones(rows, rows, dtype=torch.bool, device=query.device).triu(1)  # a query's later keys
    ones = torch.ones(1, 1, 1, 1, rows, dtype=torch.float32, device=query.device)
    for lo in range(0, q_len, rows):
        hi = min(lo + rows, q_len)
        logits = _grouped_logits(scaled[:, :, lo:hi], keys[:, :, :hi])  # (b, kv, g, hi − lo, hi)
        logits[..., lo:hi].masked_fill_(later[: hi - lo, : hi - lo], float("-inf"))
        probs = logits.sub_(shifts[:, :, :, lo:hi, None]).exp_()
        total[..., :hi] += torch.matmul(ones[..., : hi - lo], probs).squeeze(3)
    return total.view(batch, q_heads, q_len)
