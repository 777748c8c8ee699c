"""The default model's tokenizer alone (SmolLM2-135M-Instruct), without loading any weights.

Task generators and tests only need the tokenizer; loading it from the exported safetensors folder
takes well under a second, while the model takes several. If the folder has not been exported yet,
:func:`kvsieve.models.default_model.default_model_dir` exports it once (dequantizing the GGUF).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kvsieve.models.default_model import default_model_dir


@lru_cache(maxsize=4)
def _load(folder: str) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_default_tokenizer(cache_dir: str | Path | None = None) -> PreTrainedTokenizerBase:
    """SmolLM2-135M-Instruct's tokenizer, set up exactly as :func:`load_default_model` returns it.

    Left padding, pad token ``<|im_end|>`` (eos), no BOS token added. The result is cached per folder,
    so repeated calls are free; do not mutate it.

    Args:
        cache_dir: root cache folder, as for :func:`kvsieve.models.default_model.load_default_model`.
    """
    return _load(str(default_model_dir(cache_dir)))
