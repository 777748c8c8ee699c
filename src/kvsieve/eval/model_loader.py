"""Models the evaluation runner and the benchmarks can load by name (picklable: a string and a dtype).

Every spec :func:`kvsieve.load_model` accepts works here (a folder, a ``.gguf`` file, a hub id, ...);
besides it:

* ``smollm2`` — the default model, SmolLM2-135M-Instruct (:func:`kvsieve.load_default_model`);
* ``tiny-llama`` — a randomly initialised 2-layer Llama (hidden size 64, 4 query / 2 KV heads, seed 0)
  with the SmolLM2 tokenizer, for smoke runs and tests: it runs every task in milliseconds, and scores
  nothing;
* ``package.module:function`` — any importable ``function(dtype=...) -> (model, tokenizer)``.
"""

from __future__ import annotations

from typing import Any

import torch

from kvsieve.models.loading import BUILTIN_MODELS, DEFAULT_MODEL, DTYPES, check_model_spec, parse_dtype

__all__ = ["BUILTIN_MODELS", "DEFAULT_MODEL", "DTYPES", "load_model", "load_tiny_llama", "parse_dtype",
           "validate_model_name"]


def validate_model_name(name: str) -> None:
    """Raise ``ValueError`` (or a subclass) unless ``name`` is a spec :func:`kvsieve.load_model` accepts.

    Local folders and GGUF files get their architecture checked too; hub ids only their form.
    """
    try:
        check_model_spec(name)
    except FileNotFoundError as err:  # ModelNotFoundError: report it as the bad setting it is
        raise ValueError(str(err)) from None


def load_tiny_llama(dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.nn.Module, Any]:
    """A random 2-layer Llama sized to the SmolLM2 tokenizer; same ``seed`` → same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvsieve.models.default_tokenizer import load_default_tokenizer

    tokenizer = load_default_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval().to(dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def load_model(
    name: str = DEFAULT_MODEL, dtype: str = "float32", device: str | None = None
) -> tuple[torch.nn.Module, Any]:
    """Load ``(model, tokenizer)`` by spec (see :func:`kvsieve.models.loading.load_model`) in ``dtype``."""
    from kvsieve.models.loading import load_model as _load

    return _load(name, dtype, device)  # type: ignore[no-any-return]
