"""The attention functions kvsieve registers with ``transformers.AttentionInterface``.

One function per original implementation the model had (``"kvsieve"`` wraps ``sdpa``,
``"kvsieve_eager"`` wraps the model's ``eager``; see :mod:`kvsieve.attention.register`). With a
:class:`~kvsieve.cache.KVCache`, the layer's new keys/values arrive tagged with their cache layer; the
function appends them to the ragged store, computes the output against every held entry (causality
from stored absolute positions), and lets the policy observe, select or compact. Without one (any
other cache, or none) it calls the original implementation with the original implementation's mask
and the very arguments the model passed, so a prepared model behaves exactly as before, attention
weights (``output_attentions`` under ``eager``) included.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

from kvsieve.attention.backends import without_cudnn_attention
from kvsieve.attention.kernel import AttentionForm
from kvsieve.attention.masks import KvsieveMask
from kvsieve.transformers_adapter import attention_function, module_eager_attention

#: Attribute that ``KVCache`` layers set on the key tensor they return from ``update``.
LAYER_TAG = "_kvsieve_layer"


def original_attention(original: str, module: torch.nn.Module) -> Callable[..., Any]:
    """What the untouched model would call: ``ALL_ATTENTION_FUNCTIONS[original]``, or the module's eager."""
    if original == "eager":
        return module_eager_attention(module)
    return attention_function(original)


def attention_form(query: torch.Tensor, kwargs: dict[str, Any]) -> AttentionForm:
    """The form the model asked for: ``scaling`` (default ``d^-0.5``), ``softcap`` (Gemma2's soft-capping) and
    ``s_aux`` (GPT-OSS's learned sinks, one logit per query head), as the attention function receives them."""
    scaling = kwargs.get("scaling")
    scaling = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    sinks, softcap = kwargs.get("s_aux"), kwargs.get("softcap")
    if sinks is None and softcap is None:
        return scaled_form(scaling)
    return AttentionForm(scaling, softcap, None if sinks is None else sinks.detach())


@functools.lru_cache(maxsize=64)
def scaled_form(scaling: float) -> AttentionForm:
    """SDPA's form (a scaling, no soft-capping, no sinks), made once per scaling: every layer of a model asks for the
    same one at every call (the form is immutable)."""
    return AttentionForm(scaling)


def make_attention_forward(original: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    """The kvsieve attention function for a model whose own implementation was ``original``."""

    def kvsieve_attention_forward(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: KvsieveMask | torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention over the kvsieve cache, or ``original`` attention; returns ``(batch, q, q_heads, d)``, weights."""
        layer = getattr(key, LAYER_TAG, None)
        if layer is None:  # not a kvsieve cache: exactly what the untouched model computes
            mask = attention_mask.original() if isinstance(attention_mask, KvsieveMask) else attention_mask
            return original_attention(original, module)(module, query, key, value, mask, **kwargs)
        padding = attention_mask.padding if isinstance(attention_mask, KvsieveMask) else attention_mask
        if kwargs.get("output_attentions"):
            warnings.warn(
                "kvsieve: layers served by a KVCache return no attention weights (output_attentions=True "
                "gives none for them); use another cache to inspect attention weights",
                stacklevel=2,
            )
        form, window = attention_form(query, kwargs), kwargs.get("sliding_window")
        # cuDNN's kernel would build a plan for each new key length: every step, every ragged layer (backends.py)
        if form.serves_decoding(query.shape[2], window):
            if not query.is_cuda:  # what every CPU step takes: no closure, no device object
                return layer.attend_decoding(module, query, padding, form), None
            run = lambda: layer.attend_decoding(module, query, padding, form)  # noqa: E731
            return without_cudnn_attention(query.device, run), None
        return without_cudnn_attention(query.device, lambda: layer.attend(module, query, padding, form, window)), None

    kvsieve_attention_forward.__qualname__ = f"kvsieve_attention_forward[{original}]"
    return kvsieve_attention_forward


#: The function registered as ``"kvsieve"`` (models loaded with ``sdpa``).
kvsieve_attention_forward = make_attention_forward("sdpa")
