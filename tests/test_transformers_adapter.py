"""The transformers adapter: the only contact with transformers internals, and both cache keywords work.

transformers 5.24 renamed the cache keyword of models, attention modules and ``generate`` from
``past_key_values=`` to ``cache=`` (the old name still works there, with a ``FutureWarning``). kvsieve's
own calls use the name the installed version prefers, and every kvsieve path accepts either.
"""

from __future__ import annotations

import ast
import inspect
import warnings
from pathlib import Path

import pytest
import torch
from conftest import build_model
from helpers import prompt
from transformers import DynamicCache

import kvsieve
from kvsieve import transformers_adapter as adapter

pytestmark = pytest.mark.compat  # runs in the transformers-version matrix (scripts/compat_matrix.sh)

SRC = Path(kvsieve.__file__).parent
ADAPTER = Path(adapter.__file__)


def _python_files() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if p != ADAPTER)


def test_only_the_adapter_imports_transformers_internals():
    offenders = []
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("transformers."):
                offenders.append(f"{path.relative_to(SRC)}: from {node.module} import ...")
            elif isinstance(node, ast.Import):
                offenders += [f"{path.relative_to(SRC)}: import {a.name}" for a in node.names
                              if a.name.startswith("transformers.")]
    assert offenders == []


def test_no_module_spells_a_cache_keyword():
    """Calls pass the cache through ``cache_kwargs``; reading one goes through ``cache_argument``."""
    offenders = []
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.keyword) and node.arg in adapter.CACHE_KEYWORDS:
                offenders.append(f"{path.relative_to(SRC)}:{node.lineno} {node.arg}=")
            if isinstance(node, ast.Constant) and node.value == "past_key_values":
                offenders.append(f"{path.relative_to(SRC)}:{node.lineno} {node.value!r}")
    assert offenders == []


def test_cache_keyword_is_what_the_installed_forward_takes():
    """(Both keywords through forwards, hooks, prefill_shared, compress_context and generate:
    ``test_cache_keywords.py``.)"""
    model = build_model("llama")
    keyword = adapter.cache_keyword(model)
    params = inspect.signature(type(model).forward).parameters
    assert keyword in params and keyword in adapter.CACHE_KEYWORDS
    assert adapter.cache_kwargs(model, "x") == {keyword: "x"}
    assert adapter.cache_argument({"past_key_values": 1}) == 1 and adapter.cache_argument({"cache": 2}) == 2
    assert adapter.cache_argument({}) is None


def test_kvsieve_calls_raise_no_deprecation_warning():
    """``prefill_shared``, ``compress_context``/``ask`` and a cache through ``cache_kwargs``: no FutureWarning."""
    from kvsieve.models.tiny import load_tiny_llama

    model, tokenizer = load_tiny_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        caches = [kvsieve.KVCache(model, "snapkv", budget=8, window=4), kvsieve.KVCache(model, "h2o", budget=8)]
        kvsieve.prefill_shared(model, prompt(length=20), caches)
        ctx = kvsieve.compress_context(model, tokenizer, "A short text about cats. " * 4, "snapkv", budget=8, window=4)
        assert ctx.ask("What?", max_new_tokens=2).text is not None
        model.generate(prompt(length=12), max_new_tokens=2, do_sample=False,
                       **kvsieve.cache_kwargs(model, DynamicCache(config=model.config)))


def test_output_cache_reads_either_field_without_the_deprecated_alias():
    model = build_model("llama")
    cache = DynamicCache(config=model.config)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = model(prompt(length=6), **adapter.cache_kwargs(model, cache), use_cache=True)
        assert adapter.output_cache(out) is cache
    assert adapter.output_cache({"past_key_values": 3}) == 3 and adapter.output_cache(object()) is None


def test_mask_arguments_are_bound_by_name_and_offsets_copied():
    names = list(inspect.signature(adapter.mask_function("sdpa")).parameters)
    offset = torch.tensor(5)
    args = {"batch_size": 1, "kv_length": 8, "attention_mask": torch.ones(1, 8, dtype=torch.bool)}
    args[names[1]] = offset if names[1] != "q_length" else 3  # 5.0–5.x: cache_position; 5.24: q_length
    positional = [args.get(n) for n in names[:3]]
    bound = adapter.bind_mask_arguments("sdpa", tuple(positional), {"attention_mask": args["attention_mask"]})
    assert bound["attention_mask"] is args["attention_mask"] and bound["batch_size"] == 1
    if isinstance(bound.get(names[1]), torch.Tensor):
        assert bound[names[1]] is not offset and torch.equal(bound[names[1]], offset)


def test_checked_versions_name_the_installed_range():
    def key(version: str) -> tuple[int, ...]:
        return tuple(map(int, version.split(".")))

    assert tuple(sorted(adapter.CHECKED_VERSIONS, key=key)) == adapter.CHECKED_VERSIONS
    assert adapter.VERSION
