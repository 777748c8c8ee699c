"""Compress once, keep for later: the on-disk form of a compressed context (``CompressedContext.save`` and
:func:`kvsieve.load_context` in :mod:`kvsieve.generation.context` call the two functions here), loaded in
another process to answer more questions.

Two files per saved context (no pickle): ``<stem>.safetensors`` holds every cache layer's held entries
(keys, values, absolute positions and the policy's per-entry side data, compact: a head that keeps 100
entries stores 100), and ``<stem>.json`` holds what rebuilds the rest — the policy (preset name, budget and
parameters), the prompt format (the context's token ids and the question wrapper), each layer's logical
length, the statistics, the model's fingerprint (:func:`kvsieve.models.fingerprint.model_fingerprint`)
and dtype. :func:`load_context` refuses another model or dtype, naming both, before it builds anything.

What is restored: exactly the entries, positions and side data the cache held after compressing the
context (bitwise), its logical length and its compaction count; store hooks (Quest/HSA page min/max,
SparQ's value sums) are rebuilt from the entries. So a question asked after loading gets the same answer
and log-probabilities as one asked before saving (tested). The first step toward serving engines that
store and reload KV.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

from kvsieve.engine.kv_cache import KVCache
from kvsieve.generation.prompt import PromptFormat
from kvsieve.models.fingerprint import model_fingerprint
from kvsieve.policies.presets import make_policy

FORMAT = "kvsieve-compressed-context/1"
#: The policy name of an uncompressed context (a ``DynamicCache``).
FULL = "full"


class SavedContextError(ValueError):
    """A saved context that cannot be used with this model (another model or dtype, a damaged file)."""


def context_files(stem: str | Path) -> tuple[Path, Path]:
    """``(<stem>.safetensors, <stem>.json)``; a path ending in either suffix names the same pair."""
    stem = Path(stem)
    if stem.suffix in (".safetensors", ".json"):
        stem = stem.with_suffix("")
    return stem.with_suffix(".safetensors"), stem.with_suffix(".json")


def _json_ready(value: Any, what: str) -> Any:
    try:
        json.dumps(value)
    except TypeError:
        raise SavedContextError(
            f"save: {what} {value!r} cannot be written as JSON; compress with a preset name and plain "
            "parameters (numbers, strings, booleans) to save the context"
        ) from None
    return value


def save_context(
    stem: str | Path, model: Any, cache: Any, spec: dict[str, Any] | None, prompt: PromptFormat, stats: dict[str, Any]
) -> tuple[Path, Path]:
    """Write a compressed context (its model, cache, policy spec, prompt format and statistics) to
    ``<stem>.safetensors`` + ``<stem>.json`` (see the module docstring)."""
    if spec is None:
        raise SavedContextError(
            "save: this context was compressed with a Policy object; compress with a preset name "
            "(compress_context(model, tokenizer, text, 'snapkv', budget=256, ...)) to save it"
        )
    _json_ready(spec["params"], "policy parameters")
    tensors: dict[str, torch.Tensor] = {}
    layers: list[dict[str, Any]] = []
    if isinstance(cache, KVCache):
        cache.flush()
        for index, layer in enumerate(cache.layers):
            layers.append({"seen": layer.seen, "forwards": layer.forwards, "held": layer.store is not None})
            if layer.store is not None:
                try:
                    held = layer.store.entries()
                except ValueError as err:
                    raise SavedContextError(f"save: {err}") from None
                for name, tensor in held.items():
                    tensors[f"layer.{index}.{name}"] = tensor.detach().contiguous().cpu()
        compactions = cache.engine.compactions
    else:
        for index, layer in enumerate(cache.layers):
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            layers.append({"held": keys is not None and keys.numel() > 0})
            if layers[-1]["held"]:
                tensors[f"layer.{index}.keys"] = keys.detach().contiguous().cpu()
                tensors[f"layer.{index}.values"] = values.detach().contiguous().cpu()
        compactions = 0
    weights, meta = context_files(stem)
    weights.parent.mkdir(parents=True, exist_ok=True)
    info = {
        "format": FORMAT,
        "model_fingerprint": model_fingerprint(model),
        "model_name": str(getattr(model.config, "_name_or_path", "")),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "policy": spec,
        "prompt": {"context_ids": prompt.context_ids, "question_prefix": prompt.question_prefix,
                   "question_suffix": prompt.question_suffix, "chat": prompt.chat},
        "stats": dict(stats),
        "layers": layers,
        "compactions": compactions,
    }
    save_file(tensors, str(weights), metadata={"format": FORMAT})
    meta.write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
    return weights, meta


def _read(stem: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    weights, meta = context_files(stem)
    for path in (weights, meta):
        if not path.is_file():
            raise FileNotFoundError(f"load_context: no file {path} (a saved context is a .safetensors and a .json)")
    try:
        info = json.loads(meta.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise SavedContextError(f"load_context: cannot read {meta} as JSON ({err})") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise SavedContextError(f"load_context: {meta} is not a {FORMAT} file")
    try:
        tensors = load_file(str(weights))
    except Exception as err:  # safetensors' own error type for truncated or foreign files
        raise SavedContextError(f"load_context: {weights} is not a readable safetensors file: {err}") from None
    return info, tensors


def load_saved(stem: str | Path, model: Any) -> tuple[Any, PromptFormat, dict[str, Any], dict[str, Any]]:
    """``(cache, prompt format, statistics, policy spec)`` of a context saved by :func:`save_context`, on
    ``model`` (the same weights and dtype, checked before anything is built)."""
    info, tensors = _read(stem)
    fingerprint = model_fingerprint(model)
    if info["model_fingerprint"] != fingerprint:
        raise SavedContextError(
            f"load_context: {stem} was saved with model {info['model_name']!r} (fingerprint "
            f"{info['model_fingerprint']}); this model's fingerprint is {fingerprint}: load it with the same weights"
        )
    dtype = next(model.parameters()).dtype
    if str(dtype).removeprefix("torch.") != info["dtype"]:
        raise SavedContextError(f"load_context: {stem} holds {info['dtype']} entries; the model runs in {dtype}: "
                                "load the model in the saved dtype")
    spec, device = info["policy"], next(model.parameters()).device
    layers = info["layers"]

    def tensor(index: int, name: str) -> torch.Tensor:
        key = f"layer.{index}.{name}"
        if key not in tensors:
            raise SavedContextError(f"load_context: {stem} lacks {key}")
        return tensors[key].to(device)

    if spec["name"] == FULL:
        cache: Any = DynamicCache(config=model.config)
        for index, layer in enumerate(layers):
            if layer["held"]:
                cache.update(tensor(index, "keys").to(dtype), tensor(index, "values").to(dtype), index)
    else:
        cache = KVCache(model, make_policy(spec["name"], budget=spec["budget"], **spec["params"]))
        if len(layers) != len(cache.layers):
            raise SavedContextError(f"load_context: {stem} has {len(layers)} layers; the model has {len(cache.layers)}")
        heads = cache.info.num_heads if cache.policy.expand_gqa else cache.info.num_kv_heads
        for index, (layer, saved) in enumerate(zip(cache.layers, layers, strict=True)):
            if saved["held"]:
                empty = torch.empty(1, heads, 0, cache.info.head_dim, dtype=dtype, device=device)
                layer.lazy_initialization(empty, empty)
                names = [k.removeprefix(f"layer.{index}.") for k in tensors if k.startswith(f"layer.{index}.")]
                assert layer.store is not None
                try:
                    layer.store.restore({name: tensor(index, name) for name in names})
                except ValueError as err:
                    raise SavedContextError(f"load_context: {stem}, layer {index}: {err}") from None
            layer.seen, layer.forwards = saved["seen"], saved["forwards"]
        cache.engine.compactions = info["compactions"]
    prompt = info["prompt"]
    fmt = PromptFormat(list(prompt["context_ids"]), prompt["question_prefix"], prompt["question_suffix"],
                       bool(prompt["chat"]))
    return cache, fmt, dict(info["stats"]), spec
