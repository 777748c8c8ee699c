"""One evaluation cell: a (task, policy, budget, length, sample) → a flat, JSON-serialisable record.

:func:`evaluate_cell` is what the sweep runner calls. Per cell:

1. build sample ``sample_index`` of the task (deterministic in task, length, seed, index);
2. prefill the prompt once on ``KVCache(model, policy, budget=budget, **policy_params)`` (``"full"``:
   the full cache) with ``logits_to_keep=1``;
3. teacher-force the canonical answer and greedy-decode, both from that one prefill: under the
   ``prefill`` schedule the answer is fed in one forward on a ``copy.deepcopy`` of the prefilled cache;
   when the policy acts during decoding (``decode``/``blockwise`` schedules, ``exact_topk``) the answer
   is fed one token per forward, sharing the decoding steps while the model generates the answer
   itself (:func:`kvsieve.eval.passes.greedy`). Decoding stops early once the score cannot change;
4. compare with the full cache's reference (answer log-probs and next-token log-distributions over
   the answer span), computed once per sample and, with ``reference_dir``, saved as safetensors
   there and reused by every later cell of the sweep (:mod:`kvsieve.eval.reference`).

:func:`evaluate_cells` evaluates several caches on one sample (what the sweep runner sends a worker):
the sample is built once, the full-cache cell runs first and its reference is kept in memory, and
every cache whose prompt forward does not depend on its policy (all schedules but ``blockwise``) is
filled by one shared forward (:func:`kvsieve.engine.shared_prefill.prefill_shared`), which leaves each
cache exactly as its own prefill would. Records are the same as from :func:`evaluate_cell` apart from
timings; ``prefill_shared`` says how many caches shared the forward (1: its own) and ``prefill_s`` is
the shared forward's time, of which ``elapsed_s`` counts an equal share.

Record fields (all kinds): ``task, policy, budget, length, sample, seed, prompt_tokens, score,
generated, answer_logprob, answer_logprob_full, logprob_gap, kl_full_compressed, kv_bytes_held,
kv_bytes_full, elapsed_s``, plus ``policy_desc, references, answer, answer_tokens, generated_tokens,
argmax_match, prefill_s, decode_s, reference_cached`` and the sample's scalar meta (``depth`` for the
passkey grid). ``logprob_gap`` is full − compressed (≥ 0: compression made the answer less likely);
``kl_full_compressed`` is the mean KL(full ‖ compressed) over the answer's positions.

Multi-turn adds ``turn_scores`` (``score`` is their mean), ``turn_generated``,
``turn_answer_logprobs``, ``turn_answer_logprobs_full`` and ``turn_kl``. Perplexity adds ``nll``,
``ppl``, ``nll_full``, ``ppl_full``, ``ppl_bucket_edges``, ``ppl_buckets``, ``ppl_buckets_full``,
``nll_positions`` (per predicted position), ``chunk`` and ``prefill_tokens``; there ``score`` is
``1 / ppl``, the log-likelihoods are of the whole text, ``kl_full_compressed`` is the coarse KL over
the full cache's top-64 tokens (:func:`kvsieve.eval.metrics.coarse_kl_per_position`) and
``kv_bytes_held`` is measured after the last token.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

from kvsieve.engine.kv_cache import KVCache
from kvsieve.engine.shared_prefill import prefill_shared
from kvsieve.eval.metrics import answer_logprob, kl_per_position, mean_kl, token_logprobs
from kvsieve.eval.passes import forward_logits, greedy, needs_stepwise, stream_nll, teacher_force
from kvsieve.eval.reference import fingerprint, load_reference, reference_path, save_reference
from kvsieve.eval.tasks import Task, TaskSample, get_task
from kvsieve.eval.tasks.multiturn import MultiTurnRetrieval
from kvsieve.eval.tasks.perplexity import EssayPerplexity

#: Chunk size of the full-cache perplexity reference (exact in any chunking) and its stored top-k.
PPL_REFERENCE_CHUNK = 256
PPL_TOP_K = 64


@dataclass
class _Cell:
    model: torch.nn.Module
    tokenizer: Any
    task: Task
    sample: TaskSample
    make_cache: Callable[[], KVCache]
    is_full: bool
    stepwise: bool
    budget: int | None
    reference_dir: Path | None
    #: Filled by a shared prefill: ``(cache, last logits, seconds, caches sharing it)``.
    prefilled: tuple[KVCache, torch.Tensor, float, int] | None = None
    #: References of this sample already computed in this process, by fingerprint extra.
    memory: dict[str, dict[str, torch.Tensor]] | None = None

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def load(self, extra: str = "") -> dict[str, torch.Tensor] | None:
        if self.memory is not None and extra in self.memory:
            return self.memory[extra]
        if self.reference_dir is None:
            return None
        path = reference_path(self.reference_dir, self.sample)
        return load_reference(path, fingerprint(self.model, self.sample, extra))

    def save(self, tensors: dict[str, torch.Tensor], extra: str = "") -> None:
        if self.memory is not None:
            self.memory[extra] = tensors
        if self.reference_dir is not None:
            path = reference_path(self.reference_dir, self.sample)
            save_reference(path, tensors, fingerprint(self.model, self.sample, extra))

    def full_kv_bytes(self, cache: KVCache, tokens: int) -> int:
        """Keys and values a full cache holds after ``tokens`` tokens (sliding layers: their window)."""
        info = cache.info
        element = torch.empty((), dtype=next(self.model.parameters()).dtype).element_size()
        per_token = info.num_kv_heads * info.head_dim * 2 * element
        held = sum(tokens if w is None else min(tokens, w - 1) for w in info.sliding_windows)
        return held * per_token


CellSpec = tuple[str, int | None, dict[str, Any] | None]
"""One cache of :func:`evaluate_cells`: ``(policy, budget, policy_params)``."""


def evaluate_cell(
    model: torch.nn.Module,
    tokenizer: Any,
    task: str,
    policy: str,
    budget: int | None,
    length: int,
    sample_index: int,
    seed: int,
    policy_params: dict[str, Any] | None = None,
    reference_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Evaluate one sample of ``task`` under one cache policy; see the module docstring for the record.

    Args:
        model, tokenizer: a causal LM supported by kvsieve and its tokenizer.
        task: a name from :data:`kvsieve.eval.tasks.TASKS`.
        policy: a registered policy name; ``"full"`` is the uncompressed reference (budget ignored).
        budget: entries per KV head (None: give ``ratio`` in ``policy_params``).
        length: target prompt length in tokens.
        sample_index, seed: which sample.
        policy_params: extra policy parameters (``schedule``, ``window``...).
        reference_dir: folder for the full-cache references of the sweep (None: recompute each time).
    """
    cells = [(policy, budget, policy_params)]
    return evaluate_cells(model, tokenizer, task, cells, length, sample_index, seed, reference_dir)[0]


def evaluate_cells(
    model: torch.nn.Module,
    tokenizer: Any,
    task: str,
    cells: list[CellSpec],
    length: int,
    sample_index: int,
    seed: int,
    reference_dir: str | Path | None = None,
) -> list[dict[str, Any]]:
    """Evaluate one sample of ``task`` under several caches, sharing what can be shared.

    Every policy is validated before any model work. Returns one record per entry of ``cells``, in
    order (see the module docstring).
    """
    started = time.perf_counter()
    spec = get_task(task)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and length > limit:
        raise ValueError(f"length: {length} tokens exceed the model's {limit} positions (max_position_embeddings); "
                         "beyond them its rotary positions were never trained and the scores mean nothing")
    probes: list[tuple[str, int | None, Callable[[], KVCache], KVCache]] = []
    for policy, budget, policy_params in cells:
        params = dict(policy_params or {})
        if policy != "full" and budget is not None:
            params["budget"] = budget

        def make_cache(policy: str = policy, params: dict[str, Any] = params) -> KVCache:
            return KVCache(model, policy, **params)

        probes.append((policy, budget, make_cache, make_cache()))  # validates before any model work
    sample = spec.make_sample(tokenizer, length, sample_index, seed)
    ref_dir = Path(reference_dir) if reference_dir is not None else None
    memory: dict[str, dict[str, torch.Tensor]] = {}
    prepared: list[tuple[_Cell, KVCache, dict[str, Any]]] = []
    for policy, budget, make_cache, probe in probes:
        cell = _Cell(
            model, tokenizer, spec, sample, make_cache, policy == "full", needs_stepwise(probe.policy), budget,
            ref_dir, memory=memory,
        )
        prepared.append((cell, probe, {"task": task, "policy": policy, "budget": budget}))
    setup_s = time.perf_counter() - started
    runners = {"generate": _generate_cell, "multiturn": _multiturn_cell, "perplexity": _perplexity_cell}
    records: list[dict[str, Any] | None] = [None] * len(prepared)
    with torch.inference_mode():
        shared = [i for i, (_, probe, _) in enumerate(prepared) if probe.policy.schedule.name != "blockwise"]
        if spec.kind != "perplexity" and len(shared) > 1:
            t0 = time.perf_counter()
            out = prefill_shared(model, _ids(model, sample.prompt_ids), [prepared[i][1] for i in shared],
                                 logits_to_keep=1)
            first, prefill_s = out.logits[0, -1].float(), time.perf_counter() - t0
            for i in shared:
                prepared[i][0].prefilled = (prepared[i][1], first, prefill_s, len(shared))
        # The full cache first: the others compare against the reference it leaves in memory.
        order = sorted(range(len(prepared)), key=lambda i: not prepared[i][0].is_full)
        for i in order:
            cell, probe, head = prepared[i]
            t0 = time.perf_counter()
            share = cell.prefilled[3] if cell.prefilled is not None else 1
            prefill_part = cell.prefilled[2] / share if cell.prefilled is not None else 0.0
            body = runners[spec.kind](cell)
            cell.prefilled = None
            record: dict[str, Any] = {
                **head, "length": length, "sample": sample_index, "seed": seed,
                "prompt_tokens": sample.prompt_tokens, **body, "policy_desc": str(probe.policy),
                "prefill_shared": share,
            }
            for key, value in sample.meta.items():
                if isinstance(value, int | float | str | bool) and key not in record:
                    record[key] = value
            record["elapsed_s"] = time.perf_counter() - t0 + prefill_part + setup_s / len(prepared)
            records[i] = record
    return [r for r in records if r is not None]


def _ids(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return torch.tensor([list(ids)], dtype=torch.long, device=model.device)


def _prefill(cell: _Cell) -> tuple[KVCache, torch.Tensor, float]:
    if cell.prefilled is not None:
        cache, first, seconds, _ = cell.prefilled
        return cache, first, seconds
    cache = cell.make_cache()
    started = time.perf_counter()
    first = forward_logits(cell.model, cell.sample.prompt_ids, cache, 1)[-1]
    return cache, first, time.perf_counter() - started


def _answer_fields(rows: torch.Tensor, ref: dict[str, torch.Tensor], answer: list[int]) -> dict[str, Any]:
    own = answer_logprob(rows, answer)
    full = float(ref["answer_logprobs"].double().sum())
    return {
        "answer_logprob": own,
        "answer_logprob_full": full,
        "logprob_gap": full - own,
        "kl_full_compressed": mean_kl(ref["rows"], rows),
        "argmax_match": bool((rows.argmax(-1).cpu() == torch.tensor(answer)).all()),
    }


def _generate_cell(cell: _Cell) -> dict[str, Any]:
    model, sample, task = cell.model, cell.sample, cell.task
    ref = cell.load()
    cache, first, prefill_s = _prefill(cell)
    held = cache.kv_nbytes()
    started = time.perf_counter()

    def stop(text: str) -> bool:
        return task.done(sample, text)

    if cell.stepwise:
        gen = greedy(model, cache, first, task.max_new_tokens, cell.decode, stop, answer_ids=sample.answer_ids)
        assert gen.answer_rows is not None
        rows = gen.answer_rows
    else:
        tf_cache = copy.deepcopy(cache)
        rows = teacher_force(model, tf_cache, first, sample.answer_ids)
        del tf_cache
        gen = greedy(model, cache, first, task.max_new_tokens, cell.decode, stop)
    decode_s = time.perf_counter() - started
    cached = ref is not None
    if ref is None:
        if cell.is_full and not cell.stepwise:
            ref = {"rows": rows, "answer_logprobs": token_logprobs(rows, sample.answer_ids)}
        else:
            full_cache = KVCache(model, "full")
            full_first = forward_logits(model, sample.prompt_ids, full_cache, 1)[-1]
            full_rows = teacher_force(model, full_cache, full_first, sample.answer_ids)
            ref = {"rows": full_rows, "answer_logprobs": token_logprobs(full_rows, sample.answer_ids)}
        cell.save(ref)
    return {
        "score": task.score(sample, gen.text),
        "generated": gen.text,
        "references": list(sample.references),
        "answer": sample.answer,
        "answer_tokens": len(sample.answer_ids),
        "generated_tokens": len(gen.ids),
        **_answer_fields(rows, ref, sample.answer_ids),
        "kv_bytes_held": held,
        "kv_bytes_full": cell.full_kv_bytes(cache, sample.prompt_tokens),
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "reference_cached": cached,
    }


def _dialogue_rows(
    model: torch.nn.Module, cache: KVCache, first: torch.Tensor, questions: list[list[int]], answers: list[list[int]]
) -> torch.Tensor:
    """Teacher-forced rows of every turn's answer, the answers fed one token per forward.

    Each turn's last answer token is fed together with the next question, as after decoding.
    """
    rows, logits = [], first
    for turn, answer in enumerate(answers):
        if turn:
            logits = forward_logits(model, [answers[turn - 1][-1], *questions[turn]], cache, 1)[-1]
        rows.append(teacher_force(model, cache, logits, answer, stepwise=True))
    return torch.cat(rows)


def _multiturn_cell(cell: _Cell) -> dict[str, Any]:
    model, sample, task = cell.model, cell.sample, cell.task
    assert isinstance(task, MultiTurnRetrieval)
    questions: list[list[int]] = sample.meta["turn_question_ids"]
    answers: list[list[int]] = sample.meta["turn_answer_ids"]
    flat_answer = [tok for answer in answers for tok in answer]
    ref = cell.load()
    cache, first, prefill_s = _prefill(cell)
    held = cache.kv_nbytes()
    started = time.perf_counter()
    tf_cache = copy.deepcopy(cache)
    rows = _dialogue_rows(model, tf_cache, first, questions, answers)
    del tf_cache
    texts, logits, generated = [], first, 0
    pending: list[int] = []
    for turn in range(len(answers)):
        if turn:
            logits = forward_logits(model, [*pending, *questions[turn]], cache, 1)[-1]

        def stop(text: str, turn: int = turn) -> bool:
            return task.turn_done(sample, turn, text)

        gen = greedy(model, cache, logits, task.max_new_tokens, cell.decode, stop)
        texts.append(gen.text)
        # The last token is fed with the next question, unless it ended the line (the question starts one).
        pending = [] if "\n" in cell.decode(gen.ids[-1:]) else gen.ids[-1:]
        generated += len(gen.ids)
    decode_s = time.perf_counter() - started
    cached = ref is not None
    if ref is None:
        if cell.is_full:
            full_rows = rows
        else:
            full_cache = KVCache(model, "full")
            full_first = forward_logits(model, sample.prompt_ids, full_cache, 1)[-1]
            full_rows = _dialogue_rows(model, full_cache, full_first, questions, answers)
        ref = {"rows": full_rows, "answer_logprobs": token_logprobs(full_rows, flat_answer)}
        cell.save(ref)
    bounds = [0]
    for answer in answers:
        bounds.append(bounds[-1] + len(answer))
    own_lp = token_logprobs(rows, flat_answer).double()
    full_lp = ref["answer_logprobs"].double()
    kl = kl_per_position(ref["rows"], rows)
    turn_scores = [task.score_turn(sample, t, text) for t, text in enumerate(texts)]
    return {
        "score": sum(turn_scores) / len(turn_scores),
        "generated": "\n".join(texts),
        "references": list(sample.references),
        "answer": " | ".join(sample.references),
        "answer_tokens": len(flat_answer),
        "generated_tokens": generated,
        **_answer_fields(rows, ref, flat_answer),
        "turn_scores": turn_scores,
        "turn_generated": texts,
        "turn_answer_logprobs": [float(own_lp[a:b].sum()) for a, b in pairwise(bounds)],
        "turn_answer_logprobs_full": [float(full_lp[a:b].sum()) for a, b in pairwise(bounds)],
        "turn_kl": [float(kl[a:b].mean()) for a, b in pairwise(bounds)],
        "kv_bytes_held": held,
        "kv_bytes_full": cell.full_kv_bytes(cache, sample.prompt_tokens),
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "reference_cached": cached,
    }


def _buckets(nll: torch.Tensor, size: int) -> tuple[list[int], list[float]]:
    """Bucket edges over predicted positions ``1 .. n`` and the perplexity of each bucket."""
    positions = torch.arange(1, len(nll) + 1)
    edges = list(range(0, len(nll) + 1, size))
    if edges[-1] < len(nll) + 1:
        edges.append(len(nll) + 1)
    ppl = []
    for lo, hi in pairwise(edges):
        part = nll[(positions >= lo) & (positions < hi)]
        ppl.append(math.exp(float(part.double().mean())) if len(part) else math.nan)
    return edges, ppl


def _perplexity_cell(cell: _Cell) -> dict[str, Any]:
    model, sample, task = cell.model, cell.sample, cell.task
    assert isinstance(task, EssayPerplexity)
    ids = sample.prompt_ids
    extra = f"ppl:chunk={PPL_REFERENCE_CHUNK}:top={PPL_TOP_K}"
    ref = cell.load(extra)
    cached = ref is not None
    pair = None if ref is None else (ref["top_ids"].long(), ref["top_logprobs"])

    def full_run(reference: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[Any, KVCache, float]:
        cache = KVCache(model, "full")
        t0 = time.perf_counter()
        out = stream_nll(model, cache, ids, PPL_REFERENCE_CHUNK, PPL_REFERENCE_CHUNK, PPL_TOP_K, reference)
        return out, cache, time.perf_counter() - t0

    if cell.is_full:
        result, cache, run_s = full_run(pair)
        prefill = PPL_REFERENCE_CHUNK
        full_nll = result.nll if ref is None else ref["nll"]
    else:
        if ref is None:
            full_result, _, _ = full_run(None)
            ref = {
                "nll": full_result.nll, "top_ids": full_result.top_ids.int(), "top_logprobs": full_result.top_logprobs,
            }
            pair = (full_result.top_ids, full_result.top_logprobs)
        cache = cell.make_cache()
        prefill = min(len(ids) - 1, max(task.start, cell.budget or 0))
        t0 = time.perf_counter()
        result = stream_nll(model, cache, ids, prefill, task.chunk, PPL_TOP_K, pair)
        run_s = time.perf_counter() - t0
        full_nll = ref["nll"]
    if ref is None:  # the full cell is its own reference
        ref = {"nll": result.nll, "top_ids": result.top_ids.int(), "top_logprobs": result.top_logprobs}
    if not cached:
        cell.save(ref, extra)
    nll, full_nll = result.nll.double(), full_nll.double()
    mean_nll, mean_full = float(nll.mean()), float(full_nll.mean())
    edges, buckets = _buckets(result.nll, task.bucket)
    _, buckets_full = _buckets(full_nll, task.bucket)
    assert result.kl is not None
    return {
        "score": task.score_nll(mean_nll),
        "generated": "",
        "nll": mean_nll,
        "ppl": math.exp(mean_nll),
        "nll_full": mean_full,
        "ppl_full": math.exp(mean_full),
        "answer_logprob": -float(nll.sum()),
        "answer_logprob_full": -float(full_nll.sum()),
        "logprob_gap": float(nll.sum() - full_nll.sum()),
        "kl_full_compressed": float(result.kl.mean()),
        "ppl_bucket_edges": edges,
        "ppl_buckets": buckets,
        "ppl_buckets_full": buckets_full,
        "nll_positions": [round(float(x), 4) for x in result.nll],
        "chunk": PPL_REFERENCE_CHUNK if cell.is_full else task.chunk,
        "prefill_tokens": prefill,
        "kv_bytes_held": cache.kv_nbytes(),
        "kv_bytes_full": cell.full_kv_bytes(cache, len(ids) - 1),
        "decode_s": run_s,
        "reference_cached": cached,
    }
