"""The one adapter between kvsieve and the internals of Hugging Face ``transformers``.

Every contact kvsieve has with what transformers does not promise as public API goes through this
module; the rest of kvsieve imports from here (``tests/test_transformers_adapter.py`` holds that: no
other module imports a ``transformers`` submodule or spells a cache keyword). Public top-level names
(``AutoModelForCausalLM``, ``AutoTokenizer``, ``DynamicCache``, ``PreTrainedTokenizerBase``...) are
imported where they are used.

Each contact below says what kvsieve relies on, and since which version. Versions checked:
:data:`CHECKED_VERSIONS` (CI runs the full suite on the locked set in ``requirements/constraints.txt``,
and ``scripts/compat_matrix.sh`` the compatibility-sensitive tests, ``pytest -m compat``, on the oldest
supported, ``requirements/constraints-oldest.txt``, and the newest available). A fix for one version range
belongs here, as a contact that names the versions and detects the feature (a parameter, an attribute), not
the version number.

1. **Cache keyword.** Models, their attention modules and ``generate`` take the cache as
   ``past_key_values=`` up to 5.23 and as ``cache=`` from 5.24.0, the first release whose
   ``LlamaModel.forward`` has a ``cache`` parameter (``past_key_values=`` is still accepted there: models
   rename it with a logged deprecation, ``generate`` with a ``FutureWarning`` announcing its removal in
   6.0). :func:`cache_keyword` reads the name from the model's own ``forward`` signature;
   :func:`cache_argument` reads whichever an attention module received; :func:`output_cache` reads a
   model output's cache without the deprecated alias.
2. **Cache base classes.** ``cache_utils.Cache(layers=[...])`` and ``cache_utils.CacheLayerMixin``
   (``lazy_initialization``, ``update``, ``get_seq_length``, ``get_mask_sizes``, ``is_sliding``,
   ``is_initialized``, ``reorder_cache``/``batch_*``/``crop``). 5.0–5.12 also declare
   ``get_max_cache_shape`` abstract; kvsieve's layer defines it on every version.
3. **Attention and mask registries.** ``AttentionInterface.register`` / ``AttentionMaskInterface.register``
   (registered on request, never at import), ``ALL_ATTENTION_FUNCTIONS[name]``,
   ``ALL_MASK_ATTENTION_FUNCTIONS[name]``, ``model.set_attn_implementation(name)`` and
   ``config._attn_implementation``.
4. **Mask-function arguments.** transformers calls a registered mask function with the arguments of
   ``sdpa_mask``/``eager_mask``, whose layout changed (5.0–5.3: ``(batch_size, cache_position, kv_length,
   kv_offset, mask_function, attention_mask, ...)``; from 5.4: ``(batch_size, q_length, kv_length,
   q_offset, kv_offset, mask_function, attention_mask, ...)``). :func:`bind_mask_arguments` binds them to
   the installed signature, so kvsieve reads ``attention_mask`` by name, and snapshots tensor offsets.
5. **Prepared masks.** A registered mask function may return any object; transformers hands it to the
   attention function untouched, except that ``generate`` with a compileable cache (``StaticCache``)
   prepares it ahead (up to 5.23 it calls ``.contiguous()`` on it; from 5.24 it passes it back into
   the forward, whose argument preprocessing reads ``.ndim`` and calls the mask function with it as
   ``attention_mask``) and accelerate's hooks call ``.to(device)``. ``KvsieveMask`` implements exactly
   these (see :mod:`kvsieve.attention.masks`).
6. **SDPA attention.** ``integrations.sdpa_attention.sdpa_attention_forward(module, q, k, v, mask,
   scaling=...)`` — returns ``(output (batch, q, heads, d), None)`` and handles GQA as transformers does.
7. **A modeling file's eager attention.** Each modeling file defines ``eager_attention_forward`` next
   to its attention module's ``forward`` (Gemma's soft-cap, GPT-OSS's sinks live there).
8. **Rotary tables.** ``modeling_rope_utils.ROPE_INIT_FUNCTIONS[rope_type](config, device, ...)`` →
   ``(inv_freq, attention_scaling)``; ``layer_type=`` for configs with one rope per layer type.
9. **Attention-module keyword arguments.** The attention module receives ``hidden_states`` (the normed
   layer input) and the cache keyword; the attention function receives ``scaling``,
   ``sliding_window``, ``softcap`` (Gemma2) and ``s_aux`` (GPT-OSS's learned sinks) as keywords.
   kvsieve reads them into one ``AttentionForm`` (:func:`kvsieve.attention.forward.attention_form`); with
   soft-capping or sinks its kernel computes attention explicitly, in the order of the modeling files'
   ``eager_attention_forward`` (scale, ``tanh(x / cap)·cap``, mask, softmax with the sink column, drop it).
10. **Model structure, read generically** (:mod:`kvsieve.models.architectures`, which reads attributes only,
    no transformers submodule): decoder layers at ``model.model.layers`` (else the one ``ModuleList`` of
    ``num_hidden_layers`` blocks holding an attention module); the attention module is the layer child with
    ``q_proj/k_proj/v_proj`` (or fused ``qkv_proj``) and ``o_proj``, carrying ``layer_idx`` and ``head_dim``;
    its ``sliding_window`` attribute (Qwen2/3, Qwen3-MoE, Gemma2/3, GPT-OSS, SmolLM3) is the window it passes
    to the attention function; Mistral/Phi3 have none and pass ``config.sliding_window`` for every layer.
    Config fields: ``layer_types`` (``full_attention``/``sliding_attention``; other values are linear or
    recurrent layers), ``no_rope_layers`` (SmolLM3: 0 marks a NoPE layer), ``kv_lora_rank``/``q_lora_rank``
    (multi-head latent attention), ``is_encoder_decoder``, ``use_bidirectional_attention``.
11. **Default attention at load time.** ``from_pretrained(attn_implementation=None)`` picks ``sdpa`` and
    falls back to ``eager`` for models that declare ``_supports_sdpa = False`` (Gemma2, GPT-OSS); asking for
    ``"sdpa"`` explicitly raises for them. ``AutoConfig.for_model(**config_json)`` builds a config (class
    defaults and attribute maps) from ``config.json`` without reading weights.
12. **GGUF loading** (the default model). ``from_pretrained(..., gguf_file=...)`` dequantizes every weight
    into a dense model up to 5.16; from 5.17 it keeps the GGUF blocks unless given
    ``quantization_config=GgufConfig(dequantize=True)`` (``GgufConfig`` is new in 5.17).
    :func:`gguf_dequantize_kwargs` returns what asks for dense weights on the installed version.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import transformers
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

__all__ = [
    "CHECKED_VERSIONS",
    "Cache",
    "CacheLayerMixin",
    "attention_function",
    "attention_implementation",
    "bind_mask_arguments",
    "cache_argument",
    "cache_keyword",
    "cache_kwargs",
    "gguf_dequantize_kwargs",
    "mask_function",
    "module_eager_attention",
    "output_cache",
    "register_attention",
    "rope_init",
    "sdpa_attention",
    "set_attention_implementation",
]

#: The transformers versions this adapter was checked against: the oldest supported (pyproject's lower bound,
#: the matrix's 'oldest' leg), the last with ``past_key_values=`` only, the first with ``cache=``, and the newest (the
#: lock's, the matrix's 'newest' leg). The compatibility-sensitive tests pass on each.
CHECKED_VERSIONS: tuple[str, ...] = ("5.0.0", "5.23.0", "5.24.0", "5.25.0")
#: The installed version, for result files and error messages.
VERSION: str = transformers.__version__

# -- 1. cache keyword ------------------------------------------------------------------------------------

#: The cache keyword names, newest first.
CACHE_KEYWORDS: tuple[str, ...] = ("cache", "past_key_values")


@functools.cache
def _forward_keyword(model_class: type) -> str:
    params = inspect.signature(model_class.forward).parameters
    return next((name for name in CACHE_KEYWORDS if name in params), "past_key_values")


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword ``model.forward`` and ``model.generate`` take the cache under (``cache`` from 5.24)."""
    return _forward_keyword(type(model))


def cache_kwargs(model: torch.nn.Module, cache: Any) -> dict[str, Any]:
    """``{keyword: cache}`` for ``model(...)`` / ``model.generate(...)``, in the spelling the model prefers."""
    return {cache_keyword(model): cache}


def cache_argument(kwargs: dict[str, Any]) -> Any:
    """The cache an attention module (or a forward) received, under either keyword; None if none."""
    for name in CACHE_KEYWORDS:
        value = kwargs.get(name)
        if value is not None:
            return value
    return None


def output_cache(outputs: Any) -> Any:
    """The cache of a model output (``outputs.cache`` from 5.24, ``outputs.past_key_values`` before),
    read without touching the deprecated alias."""
    for name in CACHE_KEYWORDS:
        if isinstance(outputs, dict) and name in dict.keys(outputs):
            return dict.__getitem__(outputs, name)
    return None


# -- 3. registries ---------------------------------------------------------------------------------------


def register_attention(name: str, forward: Callable[..., Any], mask: Callable[..., Any] | None = None) -> None:
    """Register an attention function (and its mask function) under ``name`` (idempotent)."""
    AttentionInterface.register(name, forward)
    if mask is not None:
        AttentionMaskInterface.register(name, mask)


def attention_function(name: str) -> Callable[..., Any]:
    """``ALL_ATTENTION_FUNCTIONS[name]``, looked up when called, as the model looks it up."""
    return ALL_ATTENTION_FUNCTIONS[name]


def mask_function(name: str) -> Callable[..., Any]:
    """``ALL_MASK_ATTENTION_FUNCTIONS[name]``, looked up when called."""
    return ALL_MASK_ATTENTION_FUNCTIONS[name]


def attention_implementation(model: torch.nn.Module) -> str | None:
    """The attention implementation a model (or config) runs: ``config._attn_implementation``."""
    config = getattr(model, "config", model)
    return getattr(config, "_attn_implementation", None)


def set_attention_implementation(model: torch.nn.Module, name: str) -> None:
    """Switch one model instance (and its sub-configs) to the registered implementation ``name``."""
    model.set_attn_implementation(name)


# -- 4. mask-function arguments --------------------------------------------------------------------------

#: Mask-function arguments that may be tensors a static cache advances in place: copied when bound.
_OFFSET_ARGUMENTS = ("q_offset", "kv_offset", "cache_position")


@functools.cache
def _mask_signature(original: str) -> inspect.Signature:
    return inspect.signature(ALL_MASK_ATTENTION_FUNCTIONS[original])


def bind_mask_arguments(original: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments transformers passed to ``original``'s mask function, by name (offsets copied)."""
    signature = _mask_signature(original)
    arguments = dict(signature.bind_partial(*args, **kwargs).arguments)
    for parameter in signature.parameters.values():
        if parameter.kind is parameter.VAR_KEYWORD:  # ``**kwargs`` arrive bound as one dict: spread them
            arguments.update(arguments.pop(parameter.name, {}))
    for name in _OFFSET_ARGUMENTS:
        value = arguments.get(name)
        if isinstance(value, torch.Tensor):
            arguments[name] = value.clone()
    return arguments


# -- 6. SDPA ---------------------------------------------------------------------------------------------


def sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
    **kwargs: Any,
) -> torch.Tensor:
    """transformers' SDPA attention: output ``(batch, q, heads, d)``."""
    output, _ = sdpa_attention_forward(module, query, keys, values, mask, scaling=scaling, **kwargs)
    return output


# -- 7. eager attention of a modeling file ---------------------------------------------------------------


def module_eager_attention(module: torch.nn.Module) -> Callable[..., Any]:
    """The ``eager_attention_forward`` the module's own ``forward`` falls back to (its modeling file's).

    Each modeling file has its own (Gemma's soft-caps, GPT-OSS's sinks), and the model resolves the
    name in the globals of the function that defines ``forward``: so does this.
    """
    forward = inspect.unwrap(type(module).forward)
    eager = getattr(forward, "__globals__", {}).get("eager_attention_forward")
    if eager is None:
        raise RuntimeError(
            f"kvsieve: cannot find the eager attention of {type(module).__name__} (no eager_attention_forward "
            "next to its forward); load the model with attn_implementation='sdpa'"
        )
    return eager


# -- 8. rotary tables ------------------------------------------------------------------------------------


def rope_init(rope_type: str, config: Any, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """``(inv_freq, attention_scaling)`` as transformers' ``ROPE_INIT_FUNCTIONS[rope_type]`` builds them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, **kwargs)
    return inv_freq, float(scaling)


# -- 10. GGUF loading ------------------------------------------------------------------------------------


def gguf_dequantize_kwargs() -> dict[str, Any]:
    """``from_pretrained`` keywords that load a ``gguf_file`` as a dense model (dequantized weights).

    From 5.17 that takes ``quantization_config=GgufConfig(dequantize=True)``; before, ``GgufConfig`` does
    not exist and a ``gguf_file`` is always dequantized, so nothing is needed.
    """
    gguf_config = getattr(transformers, "GgufConfig", None)
    return {} if gguf_config is None else {"quantization_config": gguf_config(dequantize=True)}
