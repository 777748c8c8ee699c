"""Models the evaluation runner and the benchmarks can load by name (picklable: a string and a dtype).

Every spec :func:`kvsieve.load_model` accepts works here (a folder, a ``.gguf`` file, a hub id, ...);
besides it:

* ``smollm2`` — the default model, SmolLM2-135M-Instruct (:func:`kvsieve.load_default_model`);
* ``tiny-llama`` — a randomly initialised 2-layer Llama (hidden size 64, 4 query / 2 KV heads, seed 0)
  with the SmolLM2 tokenizer, for smoke runs and tests: it runs every task in milliseconds, and scores
  nothing;
* ``package.module:function`` — any importable ``function(dtype=...) -> (model, tokenizer)``.
"""

from __future__ import annotations

from typing import Any

import torch

from kvsieve.models.loading import BUILTIN_MODELS, DEFAULT_MODEL, DTYPES, check_model_spec, parse_dtype

__all__ = ["BUILTIN_MODELS", "DEFAULT_MODEL", "DTYPES", "load_model", "parse_dtype",
           "validate_model_name"]


def validate_model_name(name: str) -> None:
    """Raise ``ValueError`` (or a subclass) unless ``name`` is a spec :func:`kvsieve.load_model` accepts.

    Local folders and GGUF files get their architecture checked too; hub ids only their form.
    """
    try:
        check_model_spec(name)
    except FileNotFoundError as err:  # ModelNotFoundError: report it as the bad setting it is
        raise ValueError(str(err)) from None


def load_model(
    name: str = DEFAULT_MODEL, dtype: str = "float32", device: str | None = None
) -> tuple[torch.nn.Module, Any]:
    """Load ``(model, tokenizer)`` by spec (see :func:`kvsieve.models.loading.load_model`) in ``dtype``."""
    from kvsieve.models.loading import load_model as _load

    return _load(name, dtype, device)  # type: ignore[no-any-return]
