"""One evaluation cell: a (task, policy, budget, length, sample) → a flat, JSON-serialisable record.

The one pipeline of ``kvsieve eval`` and ``kvsieve niah``: :func:`evaluate_cells` is what a sweep worker
calls (:mod:`kvsieve.eval.backends`) and what ``kvsieve niah`` calls per sample (:mod:`kvsieve.eval.niah`);
the per-kind work is in :mod:`kvsieve.eval.cells` (one module per task kind). Per cell of the
``generate`` kind (the others differ in steps 3 and 4, see their modules):

1. build sample ``sample_index`` of the task (deterministic in task, length, seed, index);
2. prefill the prompt once on ``KVCache(model, policy, budget=budget, **policy_params)`` (``"full"``:
   the full cache; transformers' ``DynamicCache`` for the ``needle`` kind) with ``logits_to_keep=1``;
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
``kv_bytes_held`` is measured after the last token. The ``needle`` kind (``kvsieve niah``) records
:func:`kvsieve.eval.cells.needle.score_sample`'s fields instead of the comparison with the full cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import Cache, DynamicCache

from kvsieve.attention.backends import cudnn_attention_off
from kvsieve.engine.kv_cache import KVCache
from kvsieve.engine.shared_prefill import prefill_shared
from kvsieve.eval.cells import KINDS, CellContext
from kvsieve.eval.passes import needs_stepwise
from kvsieve.eval.tasks import Task, get_task
from kvsieve.generation.reconstruction import reads_reconstruction

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


def _cache_factory(model: torch.nn.Module, policy: str, budget: int | None, policy_params: dict[str, Any] | None,
                   plain_full: bool) -> Callable[[], Cache]:
    """What builds a fresh cache of one cell (``plain_full``: the full cache is a ``DynamicCache``)."""
    if policy == "full" and plain_full:
        return lambda: DynamicCache(config=model.config)
    params = dict(policy_params or {})
    if policy != "full" and budget is not None:
        params["budget"] = budget
    return lambda: KVCache(model, policy, **params)


def _shareable(cache: Cache) -> bool:
    """Whether one shared prompt forward fills ``cache`` exactly as its own prefill would."""
    return (isinstance(cache, KVCache) and cache.policy.schedule.name != "blockwise"
            and not cache.policy.fuse_statistics and not reads_reconstruction(cache))


def evaluate_cells(
    model: torch.nn.Module,
    tokenizer: Any,
    task: str | Task,
    cells: list[CellSpec],
    length: int,
    sample_index: int,
    seed: int,
    reference_dir: str | Path | None = None,
) -> list[dict[str, Any]]:
    """Evaluate one sample of ``task`` (a registered name or a :class:`Task`) under several caches,
    sharing what can be shared.

    Every policy is validated before any model work. Returns one record per entry of ``cells``, in
    order (see the module docstring).
    """
    started = time.perf_counter()
    spec = task if isinstance(task, Task) else get_task(task)
    kind = KINDS[spec.kind]
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and length > limit:
        raise ValueError(f"length: {length} tokens exceed the model's {limit} positions (max_position_embeddings); "
                         "beyond them its rotary positions were never trained and the scores mean nothing")
    probes: list[tuple[str, int | None, Callable[[], Cache], Cache]] = []
    for policy, budget, policy_params in cells:
        make_cache = _cache_factory(model, policy, budget, policy_params, kind.plain_full)
        probes.append((policy, budget, make_cache, make_cache()))  # validates before any model work
    sample = spec.make_sample(tokenizer, length, sample_index, seed)
    ref_dir = Path(reference_dir) if reference_dir is not None else None
    memory: dict[str, dict[str, torch.Tensor]] = {}
    prepared: list[tuple[CellContext, Cache, dict[str, Any]]] = []
    for policy, budget, make_cache, probe in probes:
        stepwise = isinstance(probe, KVCache) and needs_stepwise(probe.policy)
        cell = CellContext(model, tokenizer, spec, sample, make_cache, policy == "full", stepwise, budget, ref_dir,
                           memory=memory)
        prepared.append((cell, probe, {"task": spec.name, "policy": policy, "budget": budget}))
    setup_s = time.perf_counter() - started
    records: list[dict[str, Any] | None] = [None] * len(prepared)
    # every cell on the same attention kernels: a DynamicCache (the needle kind's full cell) too (attention/backends.py)
    with torch.inference_mode(), cudnn_attention_off(model.device):
        shared = [i for i, (_, probe, _) in enumerate(prepared) if _shareable(probe)]
        if kind.shares_prefill and len(shared) > 1:
            t0 = time.perf_counter()
            ids = torch.tensor([list(sample.prompt_ids)], dtype=torch.long, device=model.device)
            out = prefill_shared(model, ids, [prepared[i][1] for i in shared], logits_to_keep=1)
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
            body = kind.run(cell)
            cell.prefilled = None
            record: dict[str, Any] = {
                **head, "length": length, "sample": sample_index, "seed": seed,
                "prompt_tokens": sample.prompt_tokens, **body, "policy_desc": _describe(probe),
                "prefill_shared": share,
            }
            for key, value in sample.meta.items():
                if isinstance(value, int | float | str | bool) and key not in record:
                    record[key] = value
            record["elapsed_s"] = time.perf_counter() - t0 + prefill_part + setup_s / len(prepared)
            records[i] = record
    return [r for r in records if r is not None]


def _describe(cache: Cache) -> str:
    """The policy a cache runs, with every parameter (``DynamicCache`` for transformers' own)."""
    return str(cache.policy) if isinstance(cache, KVCache) else type(cache).__name__
