"""Model passes on one cache: prefill, teacher forcing, greedy decoding, streaming NLL.

All passes call the model directly (no ``generate``), one sample at a time, without position ids or
attention masks: the model derives positions from the cache's logical length. Logits are taken as
float32 log-probabilities. Callers wrap them in ``torch.inference_mode()``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import Cache, PreTrainedModel

from kvsieve.engine.kv_cache import KVCache
from kvsieve.eval.metrics import coarse_kl_per_position, top_logprobs
from kvsieve.policies.policy import Policy
from kvsieve.transformers_adapter import cache_kwargs


def forward_logits(model: torch.nn.Module, ids: Sequence[int], cache: object, keep: int = 1) -> torch.Tensor:
    """Float32 logits ``(tokens, vocab)`` of the last ``keep`` positions (0 = all) after feeding ``ids``.

    Every multi-token forward of the evaluation is a prompt of its own (a turn, a teacher-forced answer, a
    streamed chunk): a kvsieve cache applies its compaction right after it (:meth:`KVCache.flush`), so
    the next forward sees what decoding would see, and prefill timings include the compression.
    """
    input_ids = torch.tensor([list(ids)], dtype=torch.long, device=model.device)
    out = model(input_ids=input_ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=keep)
    if len(ids) > 1 and isinstance(cache, KVCache):
        cache.flush()
    return out.logits[0].float()


def needs_stepwise(policy: Policy) -> bool:
    """Whether teacher forcing must feed one token per forward to see what decoding sees.

    True for schedules that evict during decoding (``decode``, ``blockwise``) and for policies that
    act on single-token forwards (a selector, e.g. ``exact_topk``). Under the ``prefill``
    schedule a multi-token forward computes its outputs before compressing, so feeding the answer in
    one forward gives the same predictions as decoding it.
    """
    return (policy.evicts and policy.schedule.acts_while_decoding) or policy.selector is not None


def teacher_force(
    model: torch.nn.Module,
    cache: object,
    first_logits: torch.Tensor,
    answer_ids: Sequence[int],
    stepwise: bool = False,
    feed_last: bool = False,
) -> torch.Tensor:
    """Rows ``(len(answer_ids), vocab)`` of log-probabilities predicting each answer token.

    ``first_logits`` predicts ``answer_ids[0]`` (the last logits of what the cache holds); the answer's
    tokens but the last are then fed (one forward, or one per token with ``stepwise``). The last answer
    token is *not* fed: the cache ends holding everything before it. ``feed_last`` feeds it too (its
    row is dropped): the same rows in exact arithmetic, and bit for bit the forward ``kvsieve niah`` has
    always made (a forward of one more token may round differently).
    """
    rows = [first_logits.float().log_softmax(-1).view(1, -1)]
    rest = list(answer_ids if feed_last else answer_ids[:-1])
    if rest and stepwise:
        rows += [forward_logits(model, [tok], cache, 1).log_softmax(-1) for tok in rest]
    elif rest:
        rows.append(forward_logits(model, rest, cache, 0).log_softmax(-1))
    return torch.cat(rows)[: len(answer_ids)]


def eos_ids(model: PreTrainedModel) -> set[int]:
    """The model's end-of-sequence ids (empty when it has none)."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)


@dataclass
class Generation:
    """Greedy tokens and, when tracked, the teacher-forced rows of the answer."""

    ids: list[int] = field(default_factory=list)
    text: str = ""
    answer_rows: torch.Tensor | None = None
    copies: int = 0


def greedy(
    model: PreTrainedModel,
    cache: Cache,
    first_logits: torch.Tensor,
    max_new_tokens: int,
    decode: Callable[[Sequence[int]], str],
    stop: Callable[[str], bool],
    answer_ids: Sequence[int] | None = None,
) -> Generation:
    """Greedy decoding from ``first_logits`` on ``cache``, one token per forward.

    Stops at an EOS token, when ``stop(text)`` is true, or after ``max_new_tokens``. The last token is
    not fed to the cache (nothing would read its output).

    With ``answer_ids``, the teacher-forced rows of the answer are computed stepwise *alongside*: while
    the greedy tokens equal the answer's, decoding is teacher forcing, so the rows are shared; at the
    first divergence the cache is deep-copied (it then holds the prompt and the answer so far) and the
    rest of the answer is teacher-forced on the copy. No copy and no extra forward when the model
    generates the answer.
    """
    out = Generation()
    eos = eos_ids(model)
    answer = list(answer_ids) if answer_ids is not None else None
    rows: list[torch.Tensor] = []
    on_answer = answer is not None
    logits = first_logits
    for _ in range(max_new_tokens):
        lp = logits.float().log_softmax(-1)
        if answer is not None and on_answer and len(rows) < len(answer):
            rows.append(lp.view(1, -1))
        token = int(lp.argmax())
        out.ids.append(token)
        out.text = decode(out.ids)
        stopping = token in eos or stop(out.text) or len(out.ids) == max_new_tokens
        if answer is not None and on_answer and (len(out.ids) > len(answer) or token != answer[len(out.ids) - 1]):
            on_answer = False
            if len(rows) < len(answer) and not stopping:
                # Diverged: the cache holds prompt + answer[:len(rows) - 1]; finish the answer on a copy.
                tf_cache = copy.deepcopy(cache)
                out.copies += 1
                rows.append(_finish_rows(model, tf_cache, answer, len(rows)))
                del tf_cache
        if stopping:
            break
        logits = forward_logits(model, [token], cache, 1)[-1]
    if answer is not None:
        if not rows:
            rows.append(first_logits.float().log_softmax(-1).view(1, -1))
        have = sum(r.shape[0] for r in rows)
        if have < len(answer):
            # Stopped on (or just off) the answer: the cache holds prompt + answer[:have - 1].
            rows.append(_finish_rows(model, cache, answer, have))
        out.answer_rows = torch.cat(rows)[: len(answer)]
    return out


def _finish_rows(model: torch.nn.Module, cache: object, answer: Sequence[int], have: int) -> torch.Tensor:
    """Rows ``have .. n-1`` of the answer, stepwise, on a cache holding prompt + ``answer[:have - 1]``."""
    assert 1 <= have < len(answer)
    rows = [forward_logits(model, [tok], cache, 1).log_softmax(-1) for tok in answer[have - 1 : len(answer) - 1]]
    return torch.cat(rows)


@dataclass
class StreamResult:
    """Per-position NLL of a text fed through a cache (position ``i`` predicts token ``i + 1``)."""

    nll: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor
    kl: torch.Tensor | None


def stream_nll(
    model: torch.nn.Module,
    cache: object,
    ids: Sequence[int],
    start: int,
    chunk: int,
    top_k: int,
    reference: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> StreamResult:
    """Feed ``ids[:-1]``: ``start`` tokens in one forward, then ``chunk`` tokens per forward.

    Returns the NLL of every next token ``(n - 1,)``, the ``top_k`` log-probabilities of every row
    (what a full-cache reference stores) and, with ``reference = (top_ids, top_logprobs)`` of the
    full cache, the coarse KL(full ‖ this cache) per position (see
    :func:`kvsieve.eval.metrics.coarse_kl_per_position`). Rows are never all kept: memory is one chunk.
    """
    targets = torch.as_tensor(list(ids[1:]), dtype=torch.long)
    n = len(targets)
    nll, top_i, top_v, kls = [], [], [], []
    lo = 0
    while lo < n:
        hi = min(n, max(start, 1) if lo == 0 else lo + chunk)
        lp = forward_logits(model, ids[lo:hi], cache, 0).log_softmax(-1)
        nll.append(-lp.gather(1, targets[lo:hi].view(-1, 1).to(lp.device)).squeeze(1).cpu())
        ti, tv = top_logprobs(lp, top_k)
        top_i.append(ti.cpu())
        top_v.append(tv.cpu())
        ref_i, ref_v = (ti, tv) if reference is None else (reference[0][lo:hi], reference[1][lo:hi])
        kls.append(coarse_kl_per_position(ref_i.to(lp.device), ref_v.to(lp.device), lp).cpu())
        lo = hi
    return StreamResult(
        nll=torch.cat(nll),
        top_ids=torch.cat(top_i),
        top_logprobs=torch.cat(top_v),
        kl=torch.cat(kls),
    )


@torch.inference_mode()
def teacher_forced_logprobs(
    model: torch.nn.Module,
    cache: object,
    prompt_ids: Sequence[int],
    answer_ids: Sequence[int],
    stepwise: bool = False,
) -> torch.Tensor:
    """Log-probability rows ``(len(answer_ids), vocab)`` (float32) of the answer after the prompt.

    The prompt is fed in one forward on ``cache`` (a fresh ``KVCache``/``DynamicCache``), then the
    answer: row ``i`` predicts ``answer_ids[i]``. ``stepwise`` feeds the answer one token per forward
    (what decoding-time eviction and decoding-time selection see), otherwise in one forward.
    """
    first = forward_logits(model, prompt_ids, cache, keep=1)[-1]
    return teacher_force(model, cache, first, answer_ids, stepwise=stepwise)
