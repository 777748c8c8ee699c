"""Full-cache references saved as safetensors and reused across the cells of a sweep.

A reference holds what a compressed cell is compared with: the full cache's log-probability rows over
the answer span (``rows``, ``(n, vocab)`` float32, ~200 KB per answer token for a 49k vocabulary)
or, for perplexity, its per-position NLL and top-k log-probabilities. One file per sample:
``<task>-L<length>-s<seed>-i<index>.safetensors``. Its metadata carries a fingerprint of the model
and of the sample's tokens; a file whose fingerprint differs is recomputed and overwritten. Files
are written to a temporary name and renamed, so concurrent workers never read half a file.
Nothing is pickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, safe_open, save_file

from kvsieve.eval.tasks.base import TaskSample

_FINGERPRINT = "kvsieve_fingerprint"


def reference_path(reference_dir: str | Path, sample: TaskSample) -> Path:
    """Where the reference of ``sample`` lives inside ``reference_dir``."""
    name = f"{sample.task}-L{sample.context_tokens}-s{sample.seed}-i{sample.index}.safetensors"
    return Path(reference_dir) / name


def model_id(model: torch.nn.Module) -> str:
    """What identifies the model's predictions: config essentials, dtype and an embedding checksum."""
    config = model.config
    weight = model.get_input_embeddings().weight
    checksum = float(weight.detach().double().sum())
    parts = (
        config.model_type, getattr(config, "_name_or_path", ""), config.vocab_size,
        config.num_hidden_layers, config.hidden_size, str(weight.dtype), repr(checksum),
    )
    return ":".join(str(p) for p in parts)


def fingerprint(model: torch.nn.Module, sample: TaskSample, extra: str = "") -> str:
    """SHA-256 of the model id, the sample's prompt/answer tokens (all turns) and ``extra``."""
    payload = {
        "model": model_id(model),
        "prompt": sample.prompt_ids,
        "answer": sample.answer_ids,
        "turn_questions": sample.meta.get("turn_question_ids"),
        "turn_answers": sample.meta.get("turn_answer_ids"),
        "extra": extra,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def load_reference(path: Path, expected: str) -> dict[str, torch.Tensor] | None:
    """The tensors stored at ``path`` if it exists and its fingerprint is ``expected``, else None."""
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as handle:
            if (handle.metadata() or {}).get(_FINGERPRINT) != expected:
                return None
        return load_file(str(path))
    except (OSError, ValueError, RuntimeError):  # a corrupt file is recomputed
        return None


def save_reference(path: Path, tensors: dict[str, torch.Tensor], fp: str) -> None:
    """Write ``tensors`` to ``path`` atomically with fingerprint ``fp``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
    try:
        contiguous = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        save_file(contiguous, tmp, metadata={_FINGERPRINT: fp})
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
