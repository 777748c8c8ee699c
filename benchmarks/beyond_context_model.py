"""The default model with its position limit doubled, for timing prompts past its 8k context.

``kvsieve bench --model beyond_context_model:smollm2_16k`` (with ``benchmarks/`` on ``PYTHONPATH``) times
16k-token prompts on SmolLM2-135M, whose config allows 8192 positions. The weights and RoPE are the
model's own; past 8k its outputs are not meaningful text, but prefill and decoding cost depend on the shapes
and the entries held, not on what the tokens say. Retention gates (``dbtrimkv``) refuse it: their model
fingerprint includes the position limit.
"""

from __future__ import annotations

from typing import Any

import torch


def smollm2_16k(dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, Any]:
    """SmolLM2-135M-Instruct (the default model) with ``max_position_embeddings`` = 16384 + 64."""
    from kvsieve import load_default_model

    model, tokenizer = load_default_model(dtype=dtype)
    model.config.max_position_embeddings = 16384 + 64
    return model, tokenizer
