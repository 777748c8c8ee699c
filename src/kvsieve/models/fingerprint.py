"""A loaded model's fingerprint: which weights these are, independent of where they were loaded from.

Files made for one model (retention gates, training checkpoints, saved compressed contexts) record the
fingerprint of the model they were made with and refuse another: a folder name says nothing (the same
weights load from any folder, and any random Llama of the same shapes has the same config).

The fingerprint hashes the architecture (the config's shape fields) and a fixed sample of the weights:
the first and last :data:`SAMPLE` values of every parameter tensor, rounded to bfloat16 so that the same
weights loaded in float32, bfloat16 or float16 from a bfloat16 checkpoint agree. It reads a few KiB per
tensor (one device-to-host copy per tensor, once per file written or read), never the whole model.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

#: Values sampled from each end of every parameter tensor.
SAMPLE = 256
#: Config fields that define the architecture and shapes (the rest — names, dtype, attention kernel — do not).
SHAPE_FIELDS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters",
    "sliding_window", "layer_types", "tie_word_embeddings",
)


def _config_fields(model: torch.nn.Module) -> dict[str, Any]:
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return {name: getattr(text, name, None) for name in SHAPE_FIELDS}


def model_fingerprint(model: torch.nn.Module) -> str:
    """``sha256:<16 hex>`` of the model's shape fields and a bfloat16-rounded sample of every weight tensor."""
    digest = hashlib.sha256(json.dumps(_config_fields(model), sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if not tensor.is_floating_point():
                continue
            flat = tensor.detach().reshape(-1)
            sample = torch.cat([flat[:SAMPLE], flat[-SAMPLE:]]) if flat.numel() > 2 * SAMPLE else flat
            digest.update(name.encode())
            digest.update(sample.to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes())
    return f"sha256:{digest.hexdigest()[:16]}"
