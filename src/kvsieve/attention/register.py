"""Registering the kvsieve attention with transformers — on request, never at import.

A model keeps its own attention for everything that does not use a kvsieve cache, so the name it is
switched to records which one it was: ``"kvsieve"`` for ``sdpa`` (the default), ``"kvsieve_eager"`` for
``eager``. Nothing is stored anywhere else (no registry, nothing on modules): a copy or a reloaded
config carries the name and so its original implementation.
"""

from __future__ import annotations

import warnings

import torch

from kvsieve.attention.forward import kvsieve_attention_forward, make_attention_forward
from kvsieve.attention.masks import lazy_mask_function
from kvsieve.transformers_adapter import (
    attention_implementation,
    set_attention_implementation,
)
from kvsieve.transformers_adapter import (
    register_attention as register_with_transformers,
)

ATTENTION_NAME = "kvsieve"

#: The kvsieve attention name for each original implementation it keeps for other caches.
VARIANTS: dict[str, str] = {"sdpa": ATTENTION_NAME, "eager": "kvsieve_eager"}
#: The original implementation behind each kvsieve attention name.
ORIGINALS: dict[str, str] = {name: original for original, name in VARIANTS.items()}

_FORWARDS = {
    name: kvsieve_attention_forward if original == "sdpa" else make_attention_forward(original)
    for original, name in VARIANTS.items()
}
_MASKS = {name: lazy_mask_function(original) for original, name in VARIANTS.items()}


def register_attention() -> None:
    """Register the kvsieve names in transformers' attention and mask interfaces (idempotent)."""
    for name in VARIANTS.values():
        register_with_transformers(name, _FORWARDS[name], _MASKS[name])


def prepare_model(model: torch.nn.Module) -> torch.nn.Module:
    """Switch one model instance to the kvsieve attention (no class is patched).

    Without a kvsieve cache the model's own implementation (``sdpa`` or ``eager``) runs with the mask it
    would have built, so its outputs (and ``eager``'s attention weights) do not change. Another
    implementation (flash, flex, paged...) cannot be kept: the model is switched to ``"kvsieve"`` (SDPA
    without a kvsieve cache) and a warning says so.
    """
    register_attention()
    current = attention_implementation(model)
    if current in ORIGINALS:
        return model
    name = VARIANTS.get(current or "sdpa")
    if name is None:
        warnings.warn(
            f"kvsieve: {type(model).__name__} was loaded with attn_implementation={current!r}, which kvsieve "
            f"cannot keep for caches other than KVCache; the model now uses {ATTENTION_NAME!r}, i.e. PyTorch SDPA "
            "for every forward without a KVCache. Load it with attn_implementation='sdpa' or 'eager' to keep its "
            "own attention outside KVCache",
            stacklevel=2,
        )
        name = ATTENTION_NAME
    set_attention_implementation(model, name)
    return model
