"""A model that served a ``KVCache`` gives, with any other cache (or none), exactly what it gave before.

``KVCache(model, ...)`` switches the model to a kvsieve attention; for every forward whose keys are not
a kvsieve cache's, that attention must call the model's own implementation (``sdpa`` or ``eager``)
with the mask that implementation would build. Each check compares, with ``torch.equal``, a model
that built a ``KVCache`` and ran it against an untouched copy with the same weights: ``DynamicCache``,
``StaticCache`` (by hand and through ``generate``), right padding (no cache and ``DynamicCache``), left
padding, sliding-window models, and ``eager`` with its attention weights.
"""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS, PAD_ID, build_model
from helpers import kvsieve_warnings, left_pad, prompt
from transformers import DynamicCache, StaticCache

import kvsieve
from kvsieve.attention import masks
from kvsieve.attention.masks import KvsieveMask
from kvsieve.attention.register import VARIANTS
from kvsieve.transformers_adapter import cache_kwargs

pytestmark = pytest.mark.compat  # runs in the transformers-version matrix (scripts/compat_matrix.sh)

STEPS = 3
#: (architecture, sliding window forced on every layer or None): Mistral/Phi3 with ``sliding_window`` set too.
MODELS = [(arch, None) for arch in ARCHS] + [("mistral", 8), ("phi3", 8)]

_PAIRS: dict[tuple[str, str, int | None], tuple[torch.nn.Module, torch.nn.Module]] = {}


def _build(arch: str, impl: str, window: int | None) -> torch.nn.Module:
    model = build_model(arch, impl)
    if window is not None:  # read at every forward (Mistral/Phi3), so this is a sliding-window model
        model.config.sliding_window = window
    return model


def pair(arch: str, impl: str = "sdpa", window: int | None = None) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(model that built and ran a KVCache, untouched copy with the same weights), built once per module."""
    key = (arch, impl, window)
    if key not in _PAIRS:
        served, untouched = _build(arch, impl, window), _build(arch, impl, window)
        policy = "full" if window is not None else "snapkv"  # every layer sliding: nothing to compress
        params = {} if window is not None else {"budget": 8, "window": 4}
        cache = kvsieve.KVCache(served, policy, **params)
        with torch.no_grad():
            served(prompt(length=12, seed=9), **cache_kwargs(served, cache))
        assert served.config._attn_implementation == VARIANTS[impl]
        assert untouched.config._attn_implementation == impl
        _PAIRS[key] = served, untouched
    return _PAIRS[key]


def _loop(model, cache, ids, mask=None) -> list[torch.Tensor]:
    """Prefill (all logits) then ``STEPS`` greedy decoding forwards (their logits)."""
    out = model(ids, attention_mask=mask, **cache_kwargs(model, cache))
    logits = [out.logits]
    for _ in range(STEPS):
        token = logits[-1][:, -1].argmax(-1, keepdim=True)
        if mask is not None:
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        logits.append(model(token, attention_mask=mask, **cache_kwargs(model, cache)).logits)
    return logits


def _generate(model, ids, mask=None, **kwargs) -> list[torch.Tensor]:
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=STEPS + 1,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        **kwargs,
    )
    return [out.sequences, *out.logits]


def _right_padded() -> tuple[torch.Tensor, torch.Tensor]:
    ids = prompt(batch=2, length=12, seed=5)
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0
    ids[1, -4:] = PAD_ID
    return ids, mask


def _left_padded() -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask, _ = left_pad([prompt(length=12, seed=6)[0], prompt(length=7, seed=7)[0]])
    return ids, mask


SCENARIOS = {
    "dynamic": lambda m: _loop(m, DynamicCache(config=m.config), prompt(batch=2, length=12, seed=3)),
    "static": lambda m: _loop(m, StaticCache(config=m.config, max_cache_len=64), prompt(batch=2, length=12, seed=3)),
    "generate_static": lambda m: _generate(m, prompt(batch=2, length=12, seed=4), cache_implementation="static"),
    "right_pad_no_cache": lambda m: [m(_right_padded()[0], attention_mask=_right_padded()[1]).logits],
    "right_pad_dynamic": lambda m: _loop(m, DynamicCache(config=m.config), *_right_padded()),
    "left_pad_generate": lambda m: _generate(m, *_left_padded()),
    "left_pad_generate_static": lambda m: _generate(m, *_left_padded(), cache_implementation="static"),
}


def _assert_equal(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    assert len(ours) == len(ref)
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert a.shape == b.shape, i
        assert torch.equal(a, b), f"step {i}: max |diff| {(a.float() - b.float()).abs().max().item():.3g}"


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize(("arch", "window"), MODELS, ids=[f"{a}-sw{w}" if w else a for a, w in MODELS])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_other_caches_give_the_untouched_outputs(impl, arch, window, scenario):
    """``eager`` models keep eager (not SDPA) outside KVCache: compared with an untouched eager copy."""
    served, untouched = pair(arch, impl, window)
    _assert_equal(SCENARIOS[scenario](served), SCENARIOS[scenario](untouched))


@pytest.mark.parametrize("arch", ARCHS)
def test_eager_attention_weights(arch):
    served, untouched = pair(arch, "eager")
    ids, mask = _right_padded()
    ours = served(ids, attention_mask=mask, output_attentions=True)
    ref = untouched(ids, attention_mask=mask, output_attentions=True)
    assert len(ours.attentions) == len(ref.attentions) == served.config.num_hidden_layers
    _assert_equal([ours.logits, *ours.attentions], [ref.logits, *ref.attentions])
    cache = DynamicCache(config=served.config)  # and through a cache, at decoding
    served(ids, attention_mask=mask, **cache_kwargs(served, cache))
    ref_cache = DynamicCache(config=untouched.config)
    untouched(ids, attention_mask=mask, **cache_kwargs(untouched, ref_cache))
    step, step_mask = ids[:, -1:], torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    ours = served(step, attention_mask=step_mask, **cache_kwargs(served, cache), output_attentions=True)
    ref = untouched(step, attention_mask=step_mask, **cache_kwargs(untouched, ref_cache), output_attentions=True)
    _assert_equal([ours.logits, *ours.attentions], [ref.logits, *ref.attentions])


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_kvsieve_cache_unchanged_by_other_caches(impl):
    """The kvsieve path still works on the same model in between, and gives what it gave before."""
    served, _ = pair("gemma3", impl)
    ids, mask = _left_padded()
    first = _generate(served, ids, mask, **cache_kwargs(served, kvsieve.KVCache(served, "snapkv", budget=8, window=4)))
    SCENARIOS["generate_static"](served)
    SCENARIOS["right_pad_dynamic"](served)
    again = _generate(served, ids, mask, **cache_kwargs(served, kvsieve.KVCache(served, "snapkv", budget=8, window=4)))
    _assert_equal(again, first)


def test_kvsieve_forward_never_builds_the_original_mask(monkeypatch):
    served, _ = pair("gemma3")
    built: list[str] = []
    original = masks._build_original
    monkeypatch.setattr(masks, "_build_original", lambda name, *a: built.append(name) or original(name, *a))
    ids, mask = _left_padded()
    _loop(served, kvsieve.KVCache(served, "snapkv", budget=8, window=4), ids, mask)
    assert built == []
    _loop(served, DynamicCache(config=served.config), ids, mask)
    assert built and set(built) == {"sdpa"}
    assert len(built) == 2 * (STEPS + 1)  # one full and one sliding mask per forward, not one per layer


def test_kvsieve_mask_contiguous_and_to():
    padding = torch.tensor([[True, True, False]])
    calls = []

    def build():
        calls.append(1)
        return torch.ones(1, 1, 3, 3, dtype=torch.bool).expand(2, 1, 3, 3)

    lazy = KvsieveMask(padding, build)
    moved = lazy.to("cpu")
    assert isinstance(moved, KvsieveMask) and moved.padding is padding  # same device: same object (engine memo)
    assert calls == []
    assert torch.equal(moved.original(), build()) and len(calls) == 2  # built once by the source (+ the check)
    assert lazy.original() is moved.original() and len(calls) == 2
    assert lazy.contiguous().is_contiguous()
    assert KvsieveMask(None, lambda: None).contiguous() is None


def test_other_implementation_is_replaced_with_a_warning():
    model = build_model("llama")
    model.config._attn_implementation_internal = "flex_attention"  # as if loaded so (no kernel needed here)
    with kvsieve_warnings() as messages:
        kvsieve.prepare_model(model)
    assert model.config._attn_implementation == "kvsieve"
    assert len(messages) == 1 and "'flex_attention'" in messages[0] and "SDPA" in messages[0]


def test_output_attentions_with_a_kvsieve_cache_says_so():
    served, _ = pair("llama", "eager")
    cache = kvsieve.KVCache(served, "snapkv", budget=8, window=4)
    with kvsieve_warnings() as messages:
        out = served(prompt(length=12), **cache_kwargs(served, cache), output_attentions=True)
    assert not out.attentions  # no weights: () on recent transformers (5.23, 5.24), None on 5.0
    assert any("no attention weights" in m for m in messages)
