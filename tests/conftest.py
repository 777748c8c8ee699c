"""Tiny randomly initialised models of every supported architecture, built from configs (no download).

Each architecture has two instances with identical weights:

* ``model`` — the one handed to ``kvsieve.KVCache`` (which switches it to the ``"kvsieve"`` attention);
* ``ref_model`` — plain transformers with ``attn_implementation="sdpa"``, used with ``DynamicCache``.

Both are built once per session (cheap: ~20 ms each) and never trained; tests only read them.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

# With 2 cores, intra-op threading makes every tiny op ~10 ms slower (thread hand-off dominates);
# one thread is ~100x faster for these model sizes and keeps the suite well under a minute.
torch.set_num_threads(1)

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3")
#: Gemma3's sliding-window layers (0 and 2 of 3); layer 1 is full attention.
GEMMA3_SLIDING_WINDOW = 16
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


def build_model(arch: str, attn_implementation: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    """A tiny fp32 causal LM in eval mode; same ``seed`` → same weights."""
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
    else:
        raise ValueError(arch)
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = cls(config).eval().to(torch.float32)
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
        assert model.config._attn_implementation == "sdpa", "reference model must stay plain sdpa"
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
