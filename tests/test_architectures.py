"""Every architecture kvsieve detects generically, built from a tiny config, against plain transformers.

Architectures (``conftest.ALL_ARCHS``): Llama (and Llama with llama3 rope scaling), Mistral, Qwen2, Qwen3,
Qwen3-MoE, Phi3, Gemma2 (attention-logit soft-capping, sliding/full), Gemma3 (QK-norm, sliding/full, a rope
per layer type), OLMo2 (post-norm, QK-norm), Granite (attention/logit/residual/embedding multipliers),
SmolLM3 (a NoPE layer), GPT-OSS (learned sinks, sliding/full, MoE, yarn rope).

Tolerance: with ``full`` or an evicting policy whose budget covers the prompt, logits are **bitwise**
equal to plain transformers (``torch.equal``) for every architecture — Gemma2 and GPT-OSS included: their
kvsieve path computes attention explicitly with the operations of their eager attention, in the same
order (measured: 0.0 everywhere). Decoding steps of architectures with sliding layers are compared with
``atol=1e-5`` (as Gemma3 in ``test_equivalence``: kvsieve's sliding layers hold a differently sized key set
than transformers' sliding cache; measured 0.0 here). Scorer statistics (float32, grouped GQA matmul)
equal the model's eager attention weights within ``STATS_ATOL``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import ALL_ARCHS, ARCHS, EAGER_ARCHS, build_model, get_model
from helpers import generate, managed_layers, prompt, reference_cache, sliding_layers
from test_shared_prefill import _assert_same_state
from transformers import BartConfig, DeepseekV3Config, DynamicCache, Qwen3NextConfig, T5Config

import kvsieve
from kvsieve.attention.kernel import AttentionForm, attention_rows, visibility_mask
from kvsieve.engine.engine import Engine
from kvsieve.engine.shared_prefill import prefill_shared
from kvsieve.ops.rope import rotary_table, unrotate, uses_rope
from kvsieve.transformers_adapter import cache_kwargs

pytestmark = [  # runs in the transformers-version matrix (scripts/compat_matrix.sh)
    pytest.mark.compat, pytest.mark.filterwarnings("ignore:kvsieve.*nothing was compressed"),
]

PROMPT_LEN, STEPS = 24, 5
DECODE_ATOL = 1e-5
STATS_ATOL = 1e-6
HYBRID = ("gemma2", "gemma3", "gpt_oss")

#: policy name → params with nothing evicted (budget ≥ prompt + generated tokens)
NO_EVICTION = {
    "full": {},
    "snapkv": {"budget": PROMPT_LEN + 8, "window": 4},
    "h2o": {"budget": PROMPT_LEN + 8},
}


@pytest.fixture(params=ALL_ARCHS)
def any_arch(request: pytest.FixtureRequest) -> str:
    return request.param


def _assert_logits(arch: str, ours: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    assert len(ours) == len(ref)
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if arch in HYBRID and step > 0:
            torch.testing.assert_close(a, b, atol=DECODE_ATOL, rtol=0, msg=f"step {step}")
        else:
            assert torch.equal(a, b), f"{arch} step {step}: max diff {(a - b).abs().max().item():.3e}"


def test_detected_layout(any_arch):
    model = get_model(any_arch, "kv")
    info = kvsieve.KVCache(model, "full").info
    config = model.config
    assert (info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim) == (3, 4, 2, 16)
    assert info.spec.model_type == config.model_type
    hybrid = any_arch in HYBRID
    assert info.sliding_windows[1] is None
    assert (info.sliding_windows[0] is not None) == hybrid and info.managed_layers == ((1,) if hybrid else (0, 1, 2))
    impl = "kvsieve_eager" if any_arch in EAGER_ARCHS else "kvsieve"
    assert model.config._attn_implementation == impl


@pytest.mark.parametrize("policy", list(NO_EVICTION))
def test_generate_equals_plain_transformers(any_arch, policy):
    model, ref = get_model(any_arch, "kv"), get_model(any_arch, "ref")
    ids = prompt(batch=2, length=PROMPT_LEN, seed=2)
    ref_seq, ref_logits = generate(ref, ids, DynamicCache(config=ref.config), STEPS)
    cache = kvsieve.KVCache(model, policy, **NO_EVICTION[policy])
    seq, logits = generate(model, ids, cache, STEPS)
    assert torch.equal(seq, ref_seq)
    _assert_logits(any_arch, logits, ref_logits)
    lengths = cache.head_lengths()[managed_layers(cache)]
    assert (lengths == PROMPT_LEN + STEPS - 1).all()


def test_prefill_shared_equals_plain_transformers(any_arch):
    model, ref = get_model(any_arch, "kv"), get_model(any_arch, "ref")
    ids = prompt(length=PROMPT_LEN, seed=3)
    _, ref_logits = reference_cache(ref, ids)
    specs = [("full", {}), ("snapkv", NO_EVICTION["snapkv"]), ("snapkv", {"budget": 8, "window": 4}),
             ("h2o", {"budget": 8})]
    shared = [kvsieve.KVCache(model, name, **params) for name, params in specs]
    out = prefill_shared(model, ids, shared)
    assert torch.equal(out.logits, ref_logits)
    for (name, params), cache in zip(specs, shared, strict=True):
        alone = kvsieve.KVCache(model, name, **params)
        own = model(input_ids=ids, **cache_kwargs(model, alone)).logits
        assert torch.equal(own, ref_logits), name
        _assert_same_state(cache, alone)
        nxt = own[:, -1:].argmax(-1)
        for _ in range(2):
            la = model(input_ids=nxt, **cache_kwargs(model, cache)).logits
            lb = model(input_ids=nxt, **cache_kwargs(model, alone)).logits
            assert torch.equal(la, lb), name
            nxt = la[:, -1:].argmax(-1)


@pytest.mark.parametrize(("policy", "params"), [
    ("snapkv", {"budget": 8, "window": 4}),
    ("h2o", {"budget": 8, "schedule": "decode", "buffer": 1}),
    ("ems", {"budget": 8, "window": 4}),
], ids=["snapkv", "h2o-decode", "ems"])
def test_evicting_under_budget_keeps_budgets(any_arch, policy, params):
    model = get_model(any_arch, "kv")
    cache = kvsieve.KVCache(model, policy, **params)
    seq, logits = generate(model, prompt(batch=2, length=PROMPT_LEN, seed=4), cache, STEPS)
    assert seq.shape == (2, PROMPT_LEN + STEPS) and all(torch.isfinite(x).all() for x in logits)
    lengths = cache.head_lengths()
    held = lengths[managed_layers(cache)]
    if policy == "snapkv":  # compressed once at the prompt's end, then every decoded token appended
        assert (held == 8 + STEPS - 1).all()
    else:  # decoding-time eviction: budget ≤ held ≤ budget + buffer
        assert (held <= 8 + 1).all()
    for layer in sliding_layers(cache):
        assert (lengths[layer] < model.config.sliding_window).all()


# ------------------------------------------------------------------ statistics see the model's attention


def _record_statistics(monkeypatch: pytest.MonkeyPatch) -> dict[int, list]:
    """Every LayerStep the engine makes, per layer (rows of every query, the form, the mask inputs)."""
    seen: dict[int, list] = {}
    original = Engine._after_output

    def spy(self, call, step):
        sliding_window = call.sliding_window
        allowed, step.allowed = step.allowed, None
        try:
            rows = step.window_rows(step.q_len)
            colsum = step.all_column_sums()
        finally:
            step.allowed = allowed
        mask = visibility_mask(step.query_positions, step.view.positions, step.view.valid, sliding_window)
        seen.setdefault(call.layer.layer_idx, []).append((rows, colsum, step.query, step.view.keys, mask, step.form))
        return original(self, call, step)

    monkeypatch.setattr(Engine, "_after_output", spy)
    # ``full`` and prefill-schedule policies decode through the plain step, which describes nothing: off here
    monkeypatch.setattr(Engine, "_plain_decoding_step", lambda self, *args: None)
    return seen


@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss", "granite", "smollm3", "llama3"])
def test_scorer_statistics_equal_the_models_eager_attention(arch, monkeypatch):
    """Rows and column sums the scorers read are the weights the model attends with: soft-capping (Gemma2),
    sinks (GPT-OSS: rows sum to less than one), Granite's attention multiplier, NoPE layers, llama3 rope."""
    model = get_model(arch, "kv")
    eager = build_model(arch, "eager")  # same weights, plain eager: the reference attention weights
    ids = prompt(length=PROMPT_LEN, seed=5)
    seen = _record_statistics(monkeypatch)
    cache = kvsieve.KVCache(model, "full")
    model(ids, **cache_kwargs(model, cache))
    nxt = ids[:, -1:]
    model(nxt, **cache_kwargs(model, cache))
    dyn = DynamicCache(config=eager.config)
    expected = eager(ids, output_attentions=True, **cache_kwargs(eager, dyn)).attentions
    expected_step = eager(nxt, output_attentions=True, **cache_kwargs(eager, dyn)).attentions
    for layer in range(3):
        (rows, colsum, query, keys, mask, form), (step_rows, *_) = seen[layer]
        torch.testing.assert_close(rows, expected[layer], atol=STATS_ATOL, rtol=0)
        torch.testing.assert_close(colsum, expected[layer].sum(dim=2), atol=10 * STATS_ATOL, rtol=0)
        if cache.layers[layer].sliding_window is None:  # sliding layers hold another key set than transformers'
            torch.testing.assert_close(step_rows, expected_step[layer], atol=STATS_ATOL, rtol=0)
        if arch in EAGER_ARCHS:  # the trap is live: the same rows without soft-capping/sinks are far off
            assert form.explicit
            plain = attention_rows(query, keys, mask, AttentionForm(form.scaling))
            assert (plain - expected[layer]).abs().max() > 1e-2
    if arch == "gpt_oss":
        assert (seen[1][0][0].sum(-1) < 0.999).any()  # the sinks' share is dropped


# ------------------------------------------------------------------ rotary tables: llama3, yarn, NoPE


@pytest.mark.parametrize("arch", ["llama3", "smollm3", "gpt_oss", "gemma2", "granite"])
def test_unrotated_keys_are_the_raw_keys(arch):
    """EMS un-rotates stored keys with the table read from the config: they equal ``k_proj``'s output
    (identity on SmolLM3's NoPE layer)."""
    model = get_model(arch, "kv")
    raw: dict[int, torch.Tensor] = {}
    handles = [
        layer.self_attn.k_proj.register_forward_hook(lambda m, a, out, i=i: raw.__setitem__(i, out))
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        cache = kvsieve.KVCache(model, "full")
        model(prompt(length=PROMPT_LEN, seed=6), **cache_kwargs(model, cache))
    finally:
        for handle in handles:
            handle.remove()
    for layer in managed_layers(cache):
        table = rotary_table(model.config, layer)
        assert (table.rotary_dim == 0) == (not uses_rope(model.config, layer))
        expected = raw[layer].view(1, PROMPT_LEN, 2, 16)
        for head in range(2):
            keys, _ = cache.kept_entries(layer, 0, head)
            got = unrotate(keys, cache.kept_positions(layer, 0, head), table)
            torch.testing.assert_close(got, expected[0, :, head], atol=1e-5, rtol=1e-5)
    if arch == "smollm3":
        assert rotary_table(model.config, 1).rotary_dim == 0 and rotary_table(model.config, 0).rotary_dim == 16


# ------------------------------------------------------------------ refused before any weight is read

_TINY = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
         "num_key_value_heads": 2, "intermediate_size": 32}

REFUSED = {
    "mla": (lambda: DeepseekV3Config(**_TINY, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                                     qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=2, num_experts_per_tok=1,
                                     moe_intermediate_size=16, first_k_dense_replace=2),
            "multi-head latent attention"),
    "hybrid": (lambda: Qwen3NextConfig(**_TINY, layer_types=["linear_attention", "full_attention"],
                                       num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16),
               "linear_attention"),
    "t5": (lambda: T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=32, num_layers=1, num_heads=2),
           "encoder-decoder"),
    "bart": (lambda: BartConfig(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1,
                                encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                decoder_ffn_dim=32), "encoder-decoder"),
}


@pytest.mark.parametrize("kind", list(REFUSED))
def test_refused_by_kvcache_before_touching_the_model(kind):
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    make, reason = REFUSED[kind]
    config = make()
    auto = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    model = auto.from_config(config)
    before = model.config._attn_implementation
    with pytest.raises(kvsieve.UnsupportedArchitectureError, match=reason):
        kvsieve.KVCache(model, "snapkv", budget=8, window=4)
    assert model.config._attn_implementation == before


@pytest.mark.parametrize("kind", list(REFUSED))
def test_refused_by_load_model_from_config_alone(kind, tmp_path: Path):
    make, reason = REFUSED[kind]
    make().save_pretrained(tmp_path)  # config.json only: no weights, no tokenizer
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]
    with pytest.raises(kvsieve.UnsupportedArchitectureError, match=reason):
        kvsieve.load_model(str(tmp_path))
    # the bare mapping as written (no transformers class defaults) is refused too
    with pytest.raises(kvsieve.UnsupportedArchitectureError, match=reason):
        kvsieve.check_config(json.loads((tmp_path / "config.json").read_text()))


def test_unrecognised_attention_module_is_refused():
    model = build_model("llama")
    for layer in model.model.layers:
        layer.self_attn.o_proj_renamed = layer.self_attn.o_proj
        del layer.self_attn.o_proj
    with pytest.raises(kvsieve.UnsupportedArchitectureError, match="attention module"):
        kvsieve.KVCache(model, "full")
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("scenario", ["dynamic", "static", "left_pad_generate"])
@pytest.mark.parametrize("arch", [a for a in ALL_ARCHS if a not in ARCHS])
def test_other_caches_still_get_the_untouched_model(arch, scenario):
    """After serving a KVCache, the model's own attention (eager for Gemma2/GPT-OSS) runs for other caches."""
    from test_foreign_caches import SCENARIOS, _assert_equal

    served, untouched = build_model(arch), build_model(arch)
    served(prompt(length=12, seed=9), **cache_kwargs(served, kvsieve.KVCache(served, "snapkv", budget=8, window=4)))
    _assert_equal(SCENARIOS[scenario](served), SCENARIOS[scenario](untouched))
