"""A tiny random Llama with the default model's tokenizer: the quick model of ``--model tiny`` and the tests."""

from __future__ import annotations

from typing import Any

import torch


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
