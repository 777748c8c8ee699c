"""Registering the kvsieve attention with transformers — on request, never at import."""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from kvsieve.attention.forward import kvsieve_attention_forward
from kvsieve.attention.masks import passthrough_mask

ATTENTION_NAME = "kvsieve"


def register_attention() -> None:
    """Register ``"kvsieve"`` in transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, kvsieve_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, passthrough_mask)


def prepare_model(model: torch.nn.Module) -> torch.nn.Module:
    """Switch one model instance to the kvsieve attention (no class is patched).

    Without a kvsieve cache the function is plain SDPA, so the model's outputs do not change.
    """
    register_attention()
    if getattr(model.config, "_attn_implementation", None) != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)
    return model
