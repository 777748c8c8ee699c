"""Models the evaluation runner and the benchmarks can load by name (picklable: a name and a dtype).

* ``smollm2`` — the default model, SmolLM2-135M-Instruct (:func:`kvsieve.load_default_model`);
* ``tiny-llama`` — a randomly initialised 2-layer Llama (hidden size 64, 4 query / 2 KV heads, seed 0)
  with the SmolLM2 tokenizer, for smoke runs and tests: it runs every task in milliseconds, and scores
  nothing;
* ``package.module:function`` — any importable ``function(dtype=...) -> (model, tokenizer)``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

DEFAULT_MODEL = "smollm2"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BUILTIN_MODELS = ("smollm2", "tiny-llama")


def parse_dtype(name: str) -> torch.dtype:
    """``"float32"`` → ``torch.float32``; unknown names raise ``ValueError`` listing the known ones."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def validate_model_name(name: str) -> None:
    """Raise ``ValueError`` unless ``name`` is a built-in model or a ``module:function`` path."""
    if name in BUILTIN_MODELS:
        return
    if ":" not in name:
        raise ValueError(f"unknown model {name!r}; use one of {list(BUILTIN_MODELS)} or 'package.module:function'")


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


def _import_function(path: str) -> Callable[..., Any]:
    module_name, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)  # type: ignore[no-any-return]
    except (ImportError, AttributeError) as err:
        raise ValueError(f"cannot import {path!r}: {err}") from None


def load_model(name: str = DEFAULT_MODEL, dtype: str = "float32") -> tuple[torch.nn.Module, Any]:
    """Load ``(model, tokenizer)`` by name (see the module docstring) in ``dtype``."""
    validate_model_name(name)
    torch_dtype = parse_dtype(dtype)
    if name == "smollm2":
        from kvsieve.models.default_model import load_default_model

        return load_default_model(dtype=torch_dtype)
    if name == "tiny-llama":
        return load_tiny_llama(torch_dtype)
    return _import_function(name)(dtype=torch_dtype)  # type: ignore[no-any-return]
