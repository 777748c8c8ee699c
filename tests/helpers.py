"""Shared helpers for the kvsieve tests (plain functions; fixtures live in conftest.py)."""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from conftest import PAD_ID, VOCAB
from transformers import DynamicCache

import kvsieve
from kvsieve.transformers_adapter import cache_kwargs


def prompt(batch: int = 1, length: int = 24, seed: int = 0) -> torch.Tensor:
    """Random token ids ``(batch, length)`` avoiding pad/bos/eos (0, 1, 2)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


def left_pad(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Left-pad 1-D prompts with ``PAD_ID``; returns ids, attention_mask and the pad count per row."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    pads = []
    for row, p in enumerate(prompts):
        pad = width - len(p)
        ids[row, pad:] = p
        mask[row, pad:] = 1
        pads.append(pad)
    return ids, mask, pads


def managed_layers(cache: kvsieve.KVCache) -> list[int]:
    """Layers the policy manages (full attention); sliding-window layers are left to their window."""
    return [i for i, w in enumerate(cache.info.sliding_windows) if w is None]


def sliding_layers(cache: kvsieve.KVCache) -> list[int]:
    return [i for i, w in enumerate(cache.info.sliding_windows) if w is not None]


def generate(model, ids, cache, steps: int = 6, attention_mask=None):
    """Greedy ``generate`` returning (sequences, per-step logits list)."""
    out = model.generate(
        ids,
        attention_mask=attention_mask,
        max_new_tokens=steps,
        do_sample=False,
        **cache_kwargs(model, cache),
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences, list(out.logits)


def decode_loop(
    model,
    cache,
    ids: torch.Tensor,
    steps: int,
    after_step: Callable[[int], None] | None = None,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Prefill ``ids`` then greedily decode ``steps`` tokens with explicit forward calls.

    ``after_step(i)`` runs after the prefill (i = 0) and after every decoding forward (i = 1..steps).
    Returns the generated tokens ``(batch, steps)`` and the logits of every forward's last position.
    """
    out = model(ids, attention_mask=attention_mask, **cache_kwargs(model, cache))
    logits = [out.logits[:, -1]]
    if after_step is not None:
        after_step(0)
    tokens = []
    mask = attention_mask
    for i in range(1, steps + 1):
        token = logits[-1].argmax(-1, keepdim=True)
        tokens.append(token)
        if mask is not None:
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        out = model(token, attention_mask=mask, **cache_kwargs(model, cache))
        logits.append(out.logits[:, -1])
        if after_step is not None:
            after_step(i)
    return torch.cat(tokens, dim=1), logits


def reference_cache(ref_model, ids: torch.Tensor, attention_mask=None) -> tuple[DynamicCache, torch.Tensor]:
    """Plain transformers prefill: the DynamicCache and the logits."""
    dyn = DynamicCache(config=ref_model.config)
    out = ref_model(ids, attention_mask=attention_mask, **cache_kwargs(ref_model, dyn))
    return dyn, out.logits


def all_kept_positions(cache) -> Iterator[tuple[int, int, int, torch.Tensor]]:
    lengths = cache.head_lengths()
    layers, batch, heads = lengths.shape
    for layer in range(layers):
        for b in range(batch):
            for h in range(heads):
                yield layer, b, h, cache.kept_positions(layer, b, h)


@contextmanager
def kvsieve_warnings() -> Iterator[list[str]]:
    """Collect the messages of every warning kvsieve emits inside the block."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        messages: list[str] = []
        yield messages
    messages.extend(str(w.message) for w in caught if "kvsieve" in str(w.message))


def random_gates(model: torch.nn.Module, tied: bool = True, seed: int = 0):
    """Random retention gates for a tiny model (no shipped gate fits it): β well inside (0, 1) and varied,
    so a trimkv/dbtrimkv ranking is non-trivial and free of ties."""
    from kvsieve.gates import GateConfig, RetentionGates

    gates = RetentionGates(GateConfig.for_model(model, gate_hidden=8, tied=tied), seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        # scaled so the gate logits are O(1): β spread over (0, 1) instead of saturating at 1, where every
        # entry's score is log(lookahead) and rankings are ties
        gates.w_in.copy_(torch.randn(gates.w_in.shape, generator=gen) / gates.w_in.shape[-2] ** 0.5)
        gates.w_out.copy_(torch.randn(gates.w_out.shape, generator=gen) / gates.w_out.shape[-1] ** 0.5)
        gates.b_out.fill_(1.0)
    return gates.requires_grad_(False)


def random_pattern(model: torch.nn.Module, seed: int = 0):
    """A DuoAttention head pattern for a tiny model (none is shipped for it): distinct random scores."""
    from kvsieve.gates.head_pattern import HeadPattern
    from kvsieve.models.architectures import model_info

    info = model_info(model)
    scores = torch.rand(info.num_layers, info.num_kv_heads, generator=torch.Generator().manual_seed(seed))
    return HeadPattern(scores.double(), 4, 12)


def with_test_gates(model: torch.nn.Module, policy, params: dict) -> dict:
    """``params`` plus random gates when ``policy`` names a learned-retention preset without ``gates=``, and a
    random head pattern for ``duo_attention`` without ``pattern=``."""
    from kvsieve.parts.scorers.duo_attention import HeadSplit
    from kvsieve.parts.scorers.retention import RetentionGate
    preset = kvsieve.list_policies().get(policy) if isinstance(policy, str) else None
    if preset is not None and isinstance(preset.scorer, HeadSplit) and "pattern" not in params:
        return {**params, "pattern": random_pattern(model)}
    if preset is None or not isinstance(preset.scorer, RetentionGate) or "gates" in params:
        return params
    return {**params, "gates": random_gates(model, tied=policy == "dbtrimkv", seed=0)}


#: How close a C helper's float32 attention is to a float64 reference, by output dtype (one unit of the last place).
NATIVE_TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2**-8, torch.float16: 2**-10}


def needs_native(kernel: Callable[[], object]) -> pytest.MarkDecorator:
    """Skip a C attention pass's tests where it does not run (no compiler, or a CPU without AVX2/FMA/F16C, where the
    pass always declines): the PyTorch path is all there."""
    from kvsieve.native import build

    compiler = any(shutil.which(name) for name in ("cc", "gcc", "clang"))
    return pytest.mark.skipif(not compiler or kernel() is None or not build.vector_code(),
                              reason="no C compiler or no AVX2/FMA/F16C build: the PyTorch path is the only one")


def decodes_alike(model, make_cache: Callable[[], kvsieve.KVCache], ids: torch.Tensor, dtype: torch.dtype,
                  with_pass: Callable[[bool], None], after_prefill: Callable[[kvsieve.KVCache], None] | None = None,
                  steps: int = 4) -> list[kvsieve.KVCache]:
    """Greedy decoding of ``ids`` with a C pass on, then off (``with_pass(on)`` switches it): the same tokens, and
    every step's logits within rounding (1e-5 of their scale in float32, 5% in bf16). Returns both caches."""
    runs, caches = [], []
    for on in (True, False):
        with_pass(on)
        cache = make_cache()
        hook = None if after_prefill is None else (lambda i, c=cache: after_prefill(c) if i == 0 else None)
        tokens, logits = decode_loop(model, cache, ids, steps, after_step=hook)
        runs.append((tokens, torch.stack([step.float() for step in logits[1:]])))
        caches.append(cache)
    assert torch.equal(runs[0][0], runs[1][0])
    scale = float(runs[1][1].abs().max()) * (1e-5 if dtype == torch.float32 else 0.05)
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=0, atol=scale)
    return caches
