"""Model specs as plain strings, checked without loading weights: what sweep and benchmark workers get.

A worker process receives the model as a string (picklable, printable) and loads it itself with
:func:`kvsieve.models.loading.load_model`; every spec that accepts works (a folder, a ``.gguf`` file, a
hub id, ``smollm2``, ``tiny-llama``, ``package.module:function``). :func:`validate_model_name` refuses a bad
one before any worker starts.
"""

from __future__ import annotations

from kvsieve.models.loading import check_model_spec


def validate_model_name(name: str) -> None:
    """Raise ``ValueError`` (or a subclass) unless ``name`` is a spec :func:`kvsieve.load_model` accepts.

    Local folders and GGUF files get their architecture checked too; hub ids only their form. A missing
    path is reported as the bad setting it is (``ValueError``, not ``FileNotFoundError``).
    """
    try:
        check_model_spec(name)
    except FileNotFoundError as err:  # ModelNotFoundError: report it as the bad setting it is
        raise ValueError(str(err)) from None
