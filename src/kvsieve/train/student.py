"""The student: the frozen model with retention-gated attention, for training only.

A full-sequence, teacher-forced forward — no KV cache at all (``KVCache`` refuses autograd; training needs
none). Inside :func:`student_mode` the model instance uses the attention function registered as
``"kvsieve_retention_train"`` and has a forward pre-hook on each attention module; both read a
:class:`GateContext` passed as the ``gate_context`` keyword of the model call (transformers forwards
extra keywords to the attention modules). The hook computes each layer's ``log β`` from the layer's
attention input (after its norm); the attention function applies :func:`gated_attention` and records the
retention masses for the capacity loss. Without a ``gate_context`` the function is plain SDPA. On exit the
hooks are removed and the model's attention implementation is restored.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kvsieve.gates.retention import RetentionGates
from kvsieve.models.architectures import architecture_of, attention_modules, decoder_layers, model_info
from kvsieve.train.gated_attention import gated_attention
from kvsieve.transformers_adapter import (
    attention_implementation,
    register_attention,
    sdpa_attention,
    set_attention_implementation,
)

ATTENTION_NAME = "kvsieve_retention_train"


class GateContext:
    """One student forward: the gates, the per-layer ``log β`` and the retention masses ``(B, Hkv, N)``."""

    def __init__(self, gates: RetentionGates, block_size: int = 256):
        self.gates, self.block_size = gates, block_size
        self.log_beta: dict[int, torch.Tensor] = {}
        self.masses: dict[int, torch.Tensor] = {}


def _hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    ctx = kwargs.get("gate_context")
    if isinstance(ctx, GateContext):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        ctx.log_beta[module.layer_idx] = ctx.gates.log_beta(module.layer_idx, hidden)


def _attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0, **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    ctx = kwargs.pop("gate_context", None)
    if not isinstance(ctx, GateContext):
        return sdpa_attention(module, query, key, value, attention_mask, scaling, dropout=dropout, **kwargs), None
    log_beta = ctx.log_beta.pop(module.layer_idx)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    out, mass = gated_attention(query, key, value, log_beta, scale, ctx.block_size)
    ctx.masses[module.layer_idx] = mass
    return out.transpose(1, 2).contiguous(), None


@contextmanager
def student_mode(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Switch ``model`` to the gated attention while inside; restored (hooks removed) on exit."""
    info = model_info(model)
    if any(w is not None for w in info.sliding_windows):
        raise ValueError("kvsieve train: models with sliding-window layers are not supported for gate training")
    if getattr(model.config, "attn_logit_softcapping", None):
        raise ValueError("kvsieve train: models with attention logit soft-capping are not supported")
    spec = architecture_of(model)
    if any(getattr(m, "sinks", None) is not None for m in attention_modules(model, spec)):
        raise ValueError("kvsieve train: models with learned attention sinks (GPT-OSS) are not supported")
    register_attention(ATTENTION_NAME, _attention)
    previous = attention_implementation(model)
    handles = [
        getattr(layer, spec.attention_attr).register_forward_pre_hook(_hook, with_kwargs=True)
        for layer in decoder_layers(model, spec)
    ]
    set_attention_implementation(model, ATTENTION_NAME)
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()
        set_attention_implementation(model, previous)
