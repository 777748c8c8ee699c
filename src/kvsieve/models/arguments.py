"""The ``--model/--dtype/--device`` flags every ``kvsieve`` command shares, and loading from them.

A command adds the flags with :func:`add_model_arguments` and loads with :func:`load_model_from_args`
(or passes ``args.model``/``args.dtype``/``args.device`` on to worker processes as strings), so every
command accepts the same model specs as :func:`kvsieve.load_model`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from kvsieve.models.loading import BUILTIN_MODELS, DEFAULT_MODEL, DTYPES

MODEL_HELP = (
    f"a local Hugging Face folder, a .gguf file, a hub id (org/name), {' or '.join(BUILTIN_MODELS)}, "
    "or package.module:function"
)


def add_model_arguments(
    parser: argparse.ArgumentParser, *, with_defaults: bool = True, with_tokenizer: bool = True
) -> None:
    """Add ``--model``, ``--dtype``, ``--device`` (and ``--tokenizer``) to ``parser``.

    Args:
        with_defaults: False leaves every default None (``kvsieve eval``, whose YAML file may supply them).
        with_tokenizer: add ``--tokenizer`` (commands that load the model in this process; ``eval`` and
            ``bench`` hand the model spec to worker processes, which load the folder's own tokenizer).
    """
    parser.add_argument("--model", default=DEFAULT_MODEL if with_defaults else None,
                        help=f"{MODEL_HELP} (default {DEFAULT_MODEL})")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32" if with_defaults else None,
                        help="weights and cache dtype (default float32: on CPUs without native bf16, "
                             "bfloat16 is several times slower)")
    parser.add_argument("--device", default="cpu" if with_defaults else None,
                        help="cpu (default), cuda, cuda:N, mps, or auto (cuda when available)")
    if with_tokenizer:
        parser.add_argument("--tokenizer", default=None,
                            help="tokenizer folder or hub id, when the model folder has no tokenizer files")


def model_settings(args: argparse.Namespace) -> dict[str, Any]:
    """``{"model", "dtype", "device", "tokenizer"}`` from parsed flags, defaults filled in."""
    return {
        "model": getattr(args, "model", None) or DEFAULT_MODEL,
        "dtype": getattr(args, "dtype", None) or "float32",
        "device": getattr(args, "device", None) or "cpu",
        "tokenizer": getattr(args, "tokenizer", None),
    }


def check_model_args(args: argparse.Namespace) -> None:
    """Check the flags without loading weights (architecture of local models included)."""
    from kvsieve.models.loading import check_model_spec, parse_dtype, resolve_device, spec_kind, tokenizer_source

    settings = model_settings(args)
    parse_dtype(settings["dtype"])
    resolve_device(settings["device"])
    check_model_spec(settings["model"])
    folder = spec_kind(settings["model"]) == "folder"
    if settings["tokenizer"] is not None or folder:
        tokenizer_source(str(Path(settings["model"]).expanduser()), settings["tokenizer"], folder)


def load_model_from_args(args: argparse.Namespace, quiet: bool = False) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` as the flags say; prints the load time to stderr unless ``quiet``."""
    from kvsieve.models.loading import load_model

    settings = model_settings(args)
    started = time.perf_counter()
    loaded = load_model(settings["model"], settings["dtype"], settings["device"], settings["tokenizer"])
    if not quiet:
        print(f"loaded {settings['model']} ({settings['dtype']}, {settings['device']}) in "
              f"{time.perf_counter() - started:.1f}s", file=sys.stderr)
    return loaded
