"""Tiny randomly initialised models of every supported architecture, built from configs (no download).

Each architecture has two instances with identical weights:

* ``model`` — the one handed to ``kvsieve.KVCache`` (which switches it to the ``"kvsieve"`` attention);
* ``ref_model`` — plain transformers with ``attn_implementation="sdpa"`` (``"eager"`` for the
  architectures SDPA cannot run: Gemma2's soft-capping, GPT-OSS's sinks), used with ``DynamicCache``.

``ARCHS`` (six architectures) parametrises the broad test modules; ``ALL_ARCHS`` adds one tiny config
per further architecture (and Llama with llama3 rope scaling), checked in ``test_architectures.py``.

Both are built once per session (cheap: ~20 ms each) and never trained; tests only read them.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

# With 2 cores, intra-op threading makes every tiny op ~10 ms slower (thread hand-off dominates);
# one thread is ~100x faster for these model sizes and keeps the suite well under a minute.
torch.set_num_threads(1)

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3")
#: Every architecture with a tiny config: ARCHS plus the ones only ``test_architectures.py`` runs.
ALL_ARCHS = (*ARCHS, "llama3", "qwen3_moe", "gemma2", "olmo2", "granite", "smollm3", "gpt_oss")
#: Architectures that cannot run SDPA (soft-capping, sinks): built with ``eager``, served by "kvsieve_eager".
EAGER_ARCHS = ("gemma2", "gpt_oss")
#: Gemma3's sliding-window layers (0 and 2 of 3); layer 1 is full attention.
GEMMA3_SLIDING_WINDOW = 16
#: Gemma2's and GPT-OSS's sliding layers (0 and 2 of 3), shorter than the test prompts.
HYBRID_SLIDING_WINDOW = 8
#: Gemma2's soft-cap, small enough for the tiny model's logits to be capped (its default, 50, would not bite).
GEMMA2_SOFTCAP = 0.5
_HYBRID_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
VOCAB = 128
PAD_ID = 0

_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "pad_token_id": PAD_ID,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def default_implementation(arch: str) -> str:
    """``eager`` for the architectures SDPA cannot run, else ``sdpa``."""
    return "eager" if arch in EAGER_ARCHS else "sdpa"


def build_model(arch: str, attn_implementation: str | None = None, seed: int = 0) -> torch.nn.Module:
    """A tiny fp32 causal LM in eval mode; same ``seed`` → same weights."""
    attn_implementation = attn_implementation or default_implementation(arch)
    if arch == "llama":
        config, cls = LlamaConfig(**_COMMON), LlamaForCausalLM
    elif arch == "qwen2":
        config, cls = Qwen2Config(**_COMMON), Qwen2ForCausalLM
    elif arch == "qwen3":
        config, cls = Qwen3Config(**_COMMON, head_dim=16), Qwen3ForCausalLM
    elif arch == "mistral":
        config, cls = MistralConfig(**_COMMON, sliding_window=None), MistralForCausalLM
    elif arch == "gemma3":
        config = Gemma3TextConfig(
            **_COMMON,
            head_dim=16,
            sliding_window=GEMMA3_SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        )
        cls = Gemma3ForCausalLM
    elif arch == "phi3":
        config, cls = Phi3Config(**_COMMON, sliding_window=None), Phi3ForCausalLM
    elif arch == "llama3":  # llama3 rope scaling (frequency-dependent), original context shorter than the prompts
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
        config, cls = LlamaConfig(**_COMMON, rope_parameters=rope), LlamaForCausalLM
    elif arch == "qwen3_moe":
        config = Qwen3MoeConfig(**_COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
        cls = Qwen3MoeForCausalLM
    elif arch == "gemma2":
        config = Gemma2Config(**_COMMON, head_dim=16, sliding_window=HYBRID_SLIDING_WINDOW, layer_types=_HYBRID_TYPES,
                              attn_logit_softcapping=GEMMA2_SOFTCAP, initializer_range=0.2)
        cls = Gemma2ForCausalLM
    elif arch == "olmo2":  # post-norm, QK-norm over the whole projection
        config, cls = Olmo2Config(**_COMMON), Olmo2ForCausalLM
    elif arch == "granite":  # every multiplier away from 1 (attention_multiplier is the attention scaling)
        config = GraniteConfig(**_COMMON, attention_multiplier=0.5, logits_scaling=2.0, residual_multiplier=0.5,
                               embedding_multiplier=3.0, initializer_range=0.1)
        cls = GraniteForCausalLM
    elif arch == "smollm3":  # layer 1 has no rotary embedding (NoPE)
        config, cls = SmolLM3Config(**_COMMON, no_rope_layers=[1, 0, 1]), SmolLM3ForCausalLM
    elif arch == "gpt_oss":  # learned sinks, alternating sliding/full layers, MoE
        rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 16.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 16}
        config = GptOssConfig(**_COMMON, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                              sliding_window=HYBRID_SLIDING_WINDOW, layer_types=_HYBRID_TYPES, rope_parameters=rope)
        cls = GptOssForCausalLM
    else:
        raise ValueError(arch)
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = cls(config).eval().to(torch.float32)
    if arch == "gpt_oss":  # sinks that take a real share of every softmax row (init std is 0.02)
        generator = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=generator) * 2.0)
    # Never stop early on a random EOS: batch rows and single prompts must run the same steps.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD_ID
    return model


_MODELS: dict[tuple[str, str], torch.nn.Module] = {}


def get_model(arch: str, role: str) -> torch.nn.Module:
    """Session-cached model; ``role`` is ``"kv"`` (for KVCache) or ``"ref"`` (sdpa reference)."""
    key = (arch, role)
    if key not in _MODELS:
        _MODELS[key] = build_model(arch)
    model = _MODELS[key]
    if role == "ref":
        assert model.config._attn_implementation == default_implementation(arch), "reference must stay plain"
    return model


@pytest.fixture(params=ARCHS)
def arch(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def model(arch: str) -> torch.nn.Module:
    return get_model(arch, "kv")


@pytest.fixture
def ref_model(arch: str) -> torch.nn.Module:
    return get_model(arch, "ref")


@pytest.fixture
def fresh_model():
    """Factory for a brand-new sdpa model (for tests that check the model is left untouched)."""
    return build_model


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture
def pytorch_ragged_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ragged decoding steps take their PyTorch routes (length groups, strided runs, the padded view), as on a GPU or
    without a C compiler, instead of the CPU's pass over each segment's rows (``kvsieve.native.segment_attention``)."""
    from kvsieve.native import segment_attention

    monkeypatch.setattr(segment_attention, "attend", lambda *args, **kwargs: None)
