"""Bad input raises the promised error before any work, and leaves the model and cache untouched."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import build_model
from helpers import prompt
from transformers import GPT2Config, GPT2LMHeadModel

import kvsieve
from kvsieve import PolicyConfigError, UnknownPolicyError, UnsupportedArchitectureError
from kvsieve.transformers_adapter import cache_kwargs

BAD_PARAMS = [
    pytest.param("snapkv", {"budget": 0, "window": 0}, "budget", id="budget-0"),
    pytest.param("snapkv", {"budget": -1, "window": 0}, "budget", id="budget-negative"),
    pytest.param("snapkv", {"budget": 2.5, "window": 0}, "budget", id="budget-float"),
    pytest.param("snapkv", {"budget": True, "window": 0}, "budget", id="budget-bool"),
    pytest.param("snapkv", {"budget": "8", "window": 0}, "budget", id="budget-str"),
    pytest.param("h2o", {"budget": 0}, "budget", id="h2o-budget-0"),
    pytest.param("h2o", {"ratio": -0.1}, "ratio", id="ratio-negative"),
    pytest.param("h2o", {"ratio": 1.0}, "ratio", id="ratio-1"),
    pytest.param("h2o", {"ratio": 1.5}, "ratio", id="ratio-1.5"),
    pytest.param("snapkv", {"ratio": float("nan")}, "ratio", id="ratio-nan"),
    pytest.param("snapkv", {"ratio": True}, "ratio", id="ratio-bool"),
    pytest.param("snapkv", {"budget": 8, "window": 9}, "window", id="window-gt-budget"),
    pytest.param("snapkv", {"budget": 8}, "window", id="default-window-gt-budget"),
    pytest.param("adakv", {"budget": 8, "window": 16}, "window", id="adakv-window-gt-budget"),
    pytest.param("snapkv", {"budget": 8, "window": 4, "schedule": "decode"}, "schedule", id="snapkv-decode"),
    pytest.param("adakv", {"budget": 8, "window": 4, "schedule": "decode"}, "schedule", id="adakv-decode"),
    pytest.param("h2o", {"ratio": 0.5, "schedule": "decode"}, "decode", id="decode-with-ratio"),
    pytest.param("h2o", {"budget": 8, "ratio": 0.5}, "either budget or ratio", id="budget-and-ratio"),
    pytest.param("h2o", {}, "budget", id="missing-budget"),
    pytest.param("h2o", {"budget": 8, "bogus": 1}, "bogus", id="unknown-param"),
    pytest.param("full", {"window": 4}, "window", id="full-unknown-param"),
    pytest.param("h2o", {"budget": 8, "schedule": "sometimes"}, "schedule", id="unknown-schedule"),
    pytest.param("h2o", {"budget": 8, "buffer": -1}, "buffer", id="buffer-negative"),
    pytest.param("h2o", {"budget": 8, "recent_ratio": 1.5}, "recent_ratio", id="recent-ratio"),
    pytest.param("streaming_llm", {"budget": 3}, "sinks", id="sinks-gt-budget"),
    pytest.param("snapkv", {"budget": 8, "window": 4, "kernel_size": 4}, "kernel_size", id="kernel-even"),
    pytest.param("snapkv", {"budget": 8, "window": 4, "pooling": "median"}, "pooling", id="pooling"),
    pytest.param("pyramidkv", {"ratio": 0.5, "window": 0}, "budget", id="pyramidkv-ratio"),
    pytest.param("exact_topk", {"ratio": 0.5}, "budget", id="exact-topk-ratio"),
    pytest.param("adakv", {"budget": 8, "window": 4, "alpha": 1.5}, "alpha", id="adakv-alpha"),
    pytest.param("adakv", {"budget": 8, "window": 4, "base": "full"}, "base", id="adakv-base-full"),
    pytest.param("adakv", {"budget": 8, "base": "quest"}, "base", id="adakv-base-without-a-scorer"),
    pytest.param("adakv", {"budget": 8, "base": "h2o", "window": 4}, "unexpected parameter 'window'",
                 id="adakv-window-over-a-base-without-one"),
    pytest.param("snapkv", {"budget": 8, "buffer": 4}, "buffer belongs to the .* schedules", id="buffer-on-prefill"),
    pytest.param("h2o", {"budget": 8, "action": "quantize", "bits": 3}, "bits must be one of",
                 id="quantize-bits-outside-the-set"),
    pytest.param("quest", {"budget": 8, "action": "quantize"}, "has no scorer|selector", id="quantize-a-selector"),
]


@pytest.mark.parametrize(("policy", "params", "mentions"), BAD_PARAMS)
def test_bad_parameters_raise_before_touching_the_model(fresh_model, policy, params, mentions):
    model = fresh_model("llama")
    with pytest.raises(PolicyConfigError, match=mentions):
        kvsieve.KVCache(model, policy, **params)
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(PolicyConfigError):
        kvsieve.make_policy(policy, **params)


def test_policy_config_error_is_a_value_error():
    assert issubclass(PolicyConfigError, ValueError)
    assert issubclass(UnknownPolicyError, ValueError)
    assert issubclass(UnsupportedArchitectureError, ValueError)


def test_unknown_parameter_lists_allowed_ones():
    with pytest.raises(PolicyConfigError) as info:
        kvsieve.make_policy("h2o", budget=8, bogus=1)
    for name in ("budget", "ratio", "schedule", "buffer", "recent_ratio"):
        assert name in str(info.value)


@pytest.mark.parametrize("name", ["nope", "SnapKV", "snap_kv", ""])
def test_unknown_policy_lists_known_ones(fresh_model, name):
    model = fresh_model("llama")
    with pytest.raises(UnknownPolicyError) as info:
        if name:
            kvsieve.KVCache(model, name, budget=8)
        else:
            kvsieve.make_policy(name)
    for known in kvsieve.list_policies():
        assert known in str(info.value)
    assert model.config._attn_implementation == "sdpa"


def test_unknown_adakv_base_raises_unknown_policy(fresh_model):
    model = fresh_model("llama")
    with pytest.raises(UnknownPolicyError):
        kvsieve.KVCache(model, "adakv", budget=8, window=4, base="nope")
    assert model.config._attn_implementation == "sdpa"


def test_list_policies_has_the_builtins():
    expected = {
        "full",
        "random",
        "streaming_llm",
        "h2o",
        "tova",
        "snapkv",
        "pyramidkv",
        "adakv",
        "exact_topk",
    }
    assert expected <= set(kvsieve.list_policies())


def test_unrecognised_architecture_says_why_and_lists_tested():
    """GPT-2's attention has Conv1D projections (no Linear ``W_O``): refused, naming it, before any change."""
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64)
    config._attn_implementation = "sdpa"
    gpt2 = GPT2LMHeadModel(config).eval()
    with pytest.raises(UnsupportedArchitectureError) as info:
        kvsieve.KVCache(gpt2, "snapkv", budget=8, window=4)
    for supported in ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text", "gemma2", "gpt_oss"):
        assert supported in str(info.value)
    assert "gpt2" in str(info.value) and "attention module" in str(info.value)
    assert gpt2.config._attn_implementation == "sdpa"


def test_policy_object_with_extra_kwargs_is_rejected(fresh_model):
    model = fresh_model("llama")
    policy = kvsieve.make_policy("snapkv", budget=8, window=4)
    with pytest.raises(ValueError, match="inside the Policy"):
        kvsieve.KVCache(model, policy, budget=4)
    assert model.config._attn_implementation == "sdpa"


def test_policy_object_is_accepted(model):
    policy = kvsieve.make_policy("snapkv", budget=8, window=4)
    cache = kvsieve.KVCache(model, policy)
    assert cache.policy is policy
    model(prompt(length=16), **cache_kwargs(model, cache))
    assert int(cache.head_lengths().max()) <= 16


def test_policy_objects_validate_on_construction():
    from kvsieve.parts.scorers.snapkv import WindowAttention

    with pytest.raises(PolicyConfigError):
        kvsieve.make_policy("snapkv", budget=8, window=9)
    with pytest.raises(PolicyConfigError, match="window"):
        kvsieve.Policy(scorer=WindowAttention(window=9), budget=8, name="snapkv")
    with pytest.raises(PolicyConfigError, match="window"):
        WindowAttention(window=-1)
    assert str(kvsieve.make_policy("snapkv", budget=8, window=4)).startswith("snapkv(budget=8")
    assert str(kvsieve.Policy(scorer=WindowAttention(window=4), budget=8, name="snapkv")).startswith(
        "snapkv(budget=8"
    )


def test_wrong_batch_size_raises_and_leaves_cache_unchanged(arch, model):
    ids = prompt(batch=2, length=20, seed=60)
    cache = kvsieve.KVCache(model, "snapkv", budget=8, window=4)
    out = model(ids, **cache_kwargs(model, cache))
    before, seen = cache.head_lengths(), cache.get_seq_length()
    kept = cache.kept_positions(0, 1, 1)
    for bad in (ids[:1, -1:], torch.cat([ids, ids])[:, -1:]):
        with pytest.raises(ValueError, match="batch size"):
            model(bad, **cache_kwargs(model, cache))
        assert torch.equal(cache.head_lengths(), before)
        assert cache.get_seq_length() == seen
        assert torch.equal(cache.kept_positions(0, 1, 1), kept)
    # and it still works with the right batch afterwards
    model(out.logits[:, -1:].argmax(-1), **cache_kwargs(model, cache))
    assert cache.get_seq_length() == seen + 1


def test_inspection_before_any_forward_raises(model):
    cache = kvsieve.KVCache(model, "full")
    assert cache.get_seq_length() == 0
    assert cache.nbytes == cache.used_nbytes == cache.kv_nbytes() == 0
    with pytest.raises(ValueError, match="empty"):
        cache.head_lengths()
    with pytest.raises(ValueError, match="empty"):
        cache.kept_positions(0)


def test_reset_makes_the_cache_reusable(model):
    ids = prompt(batch=2, length=20, seed=61)
    cache = kvsieve.KVCache(model, "snapkv", budget=8, window=4)
    first = model(ids, **cache_kwargs(model, cache)).logits
    cache.reset()
    assert cache.get_seq_length() == 0
    one = prompt(batch=1, length=12, seed=62)  # another batch size is fine after a reset
    model(one, **cache_kwargs(model, cache))
    assert cache.head_lengths().shape[1] == 1
    cache.reset()
    assert torch.equal(model(ids, **cache_kwargs(model, cache)).logits, first)


def test_evicting_caches_refuse_to_crop_and_say_what_to_do(model):
    cache = kvsieve.KVCache(model, "snapkv", budget=8, window=4)
    model(prompt(length=16), **cache_kwargs(model, cache))
    assert not cache.is_croppable
    with pytest.raises(NotImplementedError, match="assistant"):
        cache.crop(4)


def test_full_cache_crops_exactly(model):
    """Rollback (assisted generation) of a cache that never evicts: equal to never having seen the tokens."""
    ids = prompt(length=12)
    cropped = kvsieve.KVCache(model, "full")
    model(ids, **cache_kwargs(model, cropped))
    model(prompt(length=3, seed=4), **cache_kwargs(model, cropped))
    assert cropped.is_croppable
    cropped.crop(-3)
    assert cropped.get_seq_length() == 12
    fresh = kvsieve.KVCache(model, "full")
    model(ids, **cache_kwargs(model, fresh))
    token = prompt(length=1, seed=9)
    cropped_logits = model(token, **cache_kwargs(model, cropped)).logits
    assert torch.equal(cropped_logits, model(token, **cache_kwargs(model, fresh)).logits)


def test_full_takes_no_budget_and_empty_name_is_unknown(fresh_model):
    model = fresh_model("llama")
    with pytest.raises(PolicyConfigError, match="no budget"):
        kvsieve.KVCache(model, "full", budget=8)
    with pytest.raises(UnknownPolicyError):
        kvsieve.KVCache(model, "")
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize(("params", "mentions"), [
    ({"recent_ratio": "0.5"}, "recent_ratio"),
    ({"recent_ratio": True}, "recent_ratio"),
    ({"buffer": 1.5, "schedule": "decode"}, "buffer"),
])
def test_type_errors_name_the_parameter(fresh_model, params, mentions):
    model = fresh_model("llama")
    with pytest.raises(PolicyConfigError, match=mentions):
        kvsieve.KVCache(model, "h2o", budget=8, **params)
    assert model.config._attn_implementation == "sdpa"


def test_base_policy_parts_are_validated_at_construction(fresh_model):
    model = fresh_model("llama")
    with pytest.raises(PolicyConfigError, match="sinks"):
        kvsieve.KVCache(model, "adakv", budget=2, window=0, base="streaming_llm")
    assert model.config._attn_implementation == "sdpa"


def test_grad_enabled_is_refused_before_anything_is_stored(fresh_model):
    model = fresh_model("llama")
    cache = kvsieve.KVCache(model, "snapkv", budget=8, window=4)
    with torch.enable_grad(), pytest.raises(RuntimeError, match="no_grad"):
        model(prompt(length=12), **cache_kwargs(model, cache))
    assert cache.get_seq_length() == 0
    model(prompt(length=12), **cache_kwargs(model, cache))  # and it works without grad
    assert cache.get_seq_length() == 12


def test_cache_of_another_model_is_refused(fresh_model):
    a, b = fresh_model("llama"), fresh_model("llama", seed=1)
    cache = kvsieve.KVCache(a, "snapkv", budget=8, window=4)
    kvsieve.prepare_model(b)
    with pytest.raises(ValueError, match="another model"):
        b(prompt(length=12), **cache_kwargs(b, cache))
    assert cache.get_seq_length() == 0
    qwen3 = fresh_model("qwen3")
    kvsieve.prepare_model(qwen3)
    with pytest.raises(ValueError, match="one KVCache per model"):
        qwen3(prompt(length=12), **cache_kwargs(qwen3, cache))


def test_cache_with_a_model_not_prepared_raises(fresh_model):
    """Switching the model back to sdpa after building the cache is caught at the next call (the
    first forward only attends to its own tokens, which sdpa does right), not silently wrong."""
    model = fresh_model("llama")
    cache = kvsieve.KVCache(model, "full")
    model.set_attn_implementation("sdpa")
    out = model(prompt(length=8), **cache_kwargs(model, cache))
    with pytest.raises(RuntimeError, match="kvsieve"):
        model(out.logits[:, -1:].argmax(-1), **cache_kwargs(model, cache))


# --------------------------------------------------------------------------- validation gaps (src bugs)


@pytest.mark.parametrize("seed", [2.5, "1", None])
def test_random_seed_is_validated_up_front(fresh_model, seed):
    """``random``'s seed must be checked at construction, like every other parameter; today a bad
    seed passes validation and fails inside the first compaction, after layer 0 was already updated."""
    model = fresh_model("llama")
    with pytest.raises(PolicyConfigError, match="seed"):
        kvsieve.KVCache(model, "random", budget=8, seed=seed)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize(
    ("policy", "params"),
    [
        ("streaming_llm", {"budget": 8, "sinks": True}),
        ("snapkv", {"budget": 8, "window": 4, "kernel_size": True}),
        ("pyramidkv", {"budget": 8, "window": 4, "beta": True}),
    ],
    ids=["sinks", "kernel_size", "beta"],
)
def test_integer_parameters_reject_bools(policy, params):
    """``budget=True`` is rejected; the other integer parameters must follow the same rule."""
    with pytest.raises(PolicyConfigError):
        kvsieve.make_policy(policy, **params)


@pytest.mark.parametrize(("batch_idx", "head"), [(0, 2), (0, -1), (2, 0), (-3, 0)])
def test_inspection_rejects_out_of_range_indices(batch_idx, head):
    """With 2 KV heads, ``kept_positions(layer, 0, 2)`` must not return batch item 1's head 0 (and a
    negative index must mean what it means in Python, or be rejected)."""
    from conftest import get_model

    model = get_model("llama", "kv")
    cache = kvsieve.KVCache(model, "snapkv", budget=6, window=2)
    model(prompt(batch=2, length=16, seed=63), **cache_kwargs(model, cache))
    batch, heads = 2, cache.info.num_kv_heads
    in_range = -batch <= batch_idx < batch and -heads <= head < heads
    if in_range:
        expected = cache.kept_positions(0, batch_idx % batch, head % heads)
        assert not torch.equal(cache.kept_positions(0, 1, 0), cache.kept_positions(0, 0, 1))  # distinguishable
        try:
            got = cache.kept_positions(0, batch_idx, head)
        except (IndexError, ValueError):
            return
        assert torch.equal(got, expected)
        return
    with pytest.raises((IndexError, ValueError)):
        cache.kept_positions(0, batch_idx, head)
    with pytest.raises((IndexError, ValueError)):
        cache.kept_entries(0, batch_idx, head)


@pytest.mark.parametrize(("policy", "params"), [("snapkv", {"window": 4}), ("h2o", {}), ("restkv", {"window": 4})])
def test_a_chunked_prompt_is_one_prompt(model, policy, params):
    """``generate(..., prefill_chunk_size=m)`` under ``prefill``: compressed once, after the last chunk, exactly
    like the same prompt in one forward (the last chunk holds the observation window here)."""
    ids = prompt(length=40)
    whole = kvsieve.KVCache(model, policy, budget=12, **params)
    chunked = kvsieve.KVCache(model, policy, budget=12, **params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out_whole = model.generate(ids, **cache_kwargs(model, whole), max_new_tokens=3, do_sample=False)
        out_chunked = model.generate(ids, **cache_kwargs(model, chunked), max_new_tokens=3, do_sample=False,
                                     prefill_chunk_size=16)
    assert torch.equal(out_whole, out_chunked)
    assert chunked.compactions == whole.compactions
    for layer in chunked.info.managed_layers:
        for head in range(chunked.info.num_kv_heads):
            assert torch.equal(chunked.kept_positions(layer, 0, head), whole.kept_positions(layer, 0, head))


def test_the_no_compression_warning_speaks_of_the_forward(model):
    cache = kvsieve.KVCache(model, "snapkv", budget=16, window=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(prompt(length=12), **cache_kwargs(model, cache))
    messages = [str(w.message) for w in caught if "kvsieve" in str(w.message)]
    assert len(messages) == 1 and "in this prompt forward" in messages[0] and "keeps every entry" not in messages[0]


def test_global_floor_above_budget_is_refused_before_any_work():
    """A per-head floor above the per-head budget would make the global total exceed L·H·budget."""
    with pytest.raises(PolicyConfigError, match=r"window \(0\) \+ floor \(3\) must not exceed budget \(2\)"):
        kvsieve.make_policy("snapkv", budget=2, window=0, allocator="global", floor=3)
    kvsieve.make_policy("snapkv", budget=2, window=0, allocator="global", floor=2)  # equal is allowed


@pytest.mark.parametrize("floor", [0, 2, 4, 8, 12])
def test_global_floor_never_breaks_the_global_budget(floor):
    """Each head keeps its window *and* its floor: window + floor > budget would exceed L·H·budget per row."""
    model = build_model("llama")  # 3 layers × 2 KV heads: 72 entries per row at budget 12
    if floor + 8 > 12:
        with pytest.raises(PolicyConfigError, match=rf"window \(8\) \+ floor \({floor}\).*budget \(12\)"):
            kvsieve.KVCache(model, "restkv", budget=12, window=8, allocator="global", floor=floor)
        return
    cache = kvsieve.KVCache(model, "restkv", budget=12, window=8, allocator="global", floor=floor)
    model(prompt(length=40), **cache_kwargs(model, cache))
    held = cache.head_lengths()  # (layers, batch, heads), after the prompt's compaction
    assert int(held.sum()) == 3 * 2 * 12  # was 72 / 96 / 120 for floor 0 / 8 / 12 (window + floor per head)
    assert int(held.min()) >= 8 + floor


def test_a_part_objects_settings_survive_other_parameters_of_that_part():
    """Parameters of a part given as an object apply to that object (was: the object was rebuilt from
    defaults, so ``alpha=0.5`` became 0.2 and ``gamma=2.0`` became 4.0)."""
    from kvsieve.parts.actions.evict_merge import EvictThenMerge
    from kvsieve.parts.allocators.adaptive import Adaptive

    policy = kvsieve.make_policy("snapkv", budget=64, allocator=Adaptive(alpha=0.5), floor="budget")
    assert policy.allocator == Adaptive(alpha=0.5, floor="budget")
    policy = kvsieve.make_policy("ems", budget=64, action=EvictThenMerge(gamma=2.0), tau=0.9)
    assert policy.action == EvictThenMerge(gamma=2.0, tau=0.9)
    with pytest.raises(PolicyConfigError, match="alpha"):  # the object's values are still validated
        kvsieve.make_policy("snapkv", budget=64, allocator=Adaptive(alpha=0.5), alpha=2.0)


def test_a_decoding_step_of_another_model_is_refused_and_changes_nothing(fresh_model):
    """The decoding route (one query: ``KVLayer.attend_decoding``) refuses another model's attention module as the
    prompt's does, before anything is appended; the cache then decodes with its own model as before."""
    a, b = fresh_model("llama"), fresh_model("llama", seed=1)
    cache = kvsieve.KVCache(a, "snapkv", budget=8, window=4)
    kvsieve.prepare_model(b)
    out = a(prompt(length=12), **cache_kwargs(a, cache))
    token = out.logits[:, -1:].argmax(-1)
    lengths, seen = cache.head_lengths(), cache.get_seq_length()
    with pytest.raises(ValueError, match="another model"):
        b(token, **cache_kwargs(b, cache))
    assert torch.equal(cache.head_lengths(), lengths)
    assert cache.get_seq_length() == seen
    a(token, **cache_kwargs(a, cache))
    assert cache.get_seq_length() == seen + 1
    assert torch.equal(cache.head_lengths(), lengths + 1)
