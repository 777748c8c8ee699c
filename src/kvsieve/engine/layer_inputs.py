"""Layer inputs for learned scorers: each layer's attention-input hidden states (what the attention
module receives: after the layer's input norm for pre-norm models; the residual stream itself for
post-norm ones such as OLMo2, which have no input norm).

Learned retention gates (TrimKV/DBTrimKV) score a token from the hidden state its layer's attention
reads. kvsieve captures it without patching any class and without request state on modules: one
*stateless* forward pre-hook per attention module (registered on that model instance, once, only when
a policy asks for layer inputs) reads the ``hidden_states`` and cache keyword arguments (``cache=`` or
``past_key_values=``, whichever the installed transformers passes to the attention module), and hands
the hidden states to that request's cache —
whatever lives on the module is the same for every request.
"""

from __future__ import annotations

from typing import Any

import torch

from kvsieve.models.architectures import attention_modules
from kvsieve.transformers_adapter import cache_argument

#: Attribute marking an attention module that already has the kvsieve input hook.
HOOK_MARK = "_kvsieve_input_hook"


def _capture(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    cache = cache_argument(kwargs)
    receive = getattr(cache, "receive_layer_inputs", None)
    if receive is None:
        return
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    if hidden is not None:
        receive(getattr(module, "layer_idx", None), hidden)


def install_layer_input_hooks(model: torch.nn.Module) -> None:
    """Register the stateless capture hook on every attention module of ``model`` (idempotent)."""
    for attention in attention_modules(model):
        if not getattr(attention, HOOK_MARK, False):
            attention.register_forward_pre_hook(_capture, with_kwargs=True)
            setattr(attention, HOOK_MARK, True)
