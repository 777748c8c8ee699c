"""What differs between the supported architectures, as data in one table.

Every supported model keeps its decoder layers at ``model.layers`` with the attention module at
``self_attn`` (holding ``o_proj``) and the pre-attention norm at ``input_layernorm``; what varies is
which layers use sliding-window attention. Sliding-window layers are left alone by every policy
(they keep the model's own window and are trimmed to it), as Gemma3's local layers need.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig


def _layer_types_sliding(config: PretrainedConfig) -> list[int | None]:
    """Sliding window per layer from ``config.layer_types`` (Gemma3, Qwen2/3), None for full attention."""
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if types is None:
        return [window] * config.num_hidden_layers if window is not None else [None] * config.num_hidden_layers
    return [window if t == "sliding_attention" else None for t in types]


def _global_window(config: PretrainedConfig) -> list[int | None]:
    """Mistral/Phi3: one optional ``sliding_window`` applying to every layer."""
    window = getattr(config, "sliding_window", None)
    return [window] * config.num_hidden_layers


@dataclass(frozen=True)
class ArchitectureSpec:
    """Where the pieces kvsieve reads live in one architecture."""

    model_type: str
    sliding_windows: Callable[[PretrainedConfig], list[int | None]]
    layers_attr: str = "layers"
    attention_attr: str = "self_attn"
    output_proj_attr: str = "o_proj"
    input_norm_attr: str = "input_layernorm"


ARCHITECTURES: dict[str, ArchitectureSpec] = {
    spec.model_type: spec
    for spec in (
        ArchitectureSpec("llama", _layer_types_sliding),
        ArchitectureSpec("mistral", _global_window),
        ArchitectureSpec("qwen2", _layer_types_sliding),
        ArchitectureSpec("qwen3", _layer_types_sliding),
        ArchitectureSpec("phi3", _global_window),
        ArchitectureSpec("gemma3_text", _layer_types_sliding),
    )
}


class UnsupportedArchitectureError(ValueError):
    """Raised for a model whose ``config.model_type`` is not in :data:`ARCHITECTURES`."""


@dataclass(frozen=True)
class ModelInfo:
    """Shapes and modules of one loaded model that the cache and policies need."""

    spec: ArchitectureSpec
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_windows: tuple[int | None, ...]

    @property
    def groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def left_alone(self) -> tuple[bool, ...]:
        """Layers no policy touches: the sliding-window layers of a hybrid model (Gemma3's local layers).

        When *every* layer has a window (Mistral or Phi3 configs with ``sliding_window`` set), the window
        is only a mask: the policy still manages every layer, and entries outside the window are dropped.
        """
        hybrid = any(w is None for w in self.sliding_windows)
        return tuple(hybrid and w is not None for w in self.sliding_windows)

    @property
    def managed_layers(self) -> tuple[int, ...]:
        return tuple(i for i, alone in enumerate(self.left_alone) if not alone)


def architecture_of(model: torch.nn.Module) -> ArchitectureSpec:
    """The table entry of ``model``; raises :class:`UnsupportedArchitectureError` listing supported ones."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"model_type {model_type!r} is not supported by kvsieve; supported: {sorted(ARCHITECTURES)}"
        )
    return ARCHITECTURES[model_type]


def model_info(model: torch.nn.Module) -> ModelInfo:
    """Read layer count, head counts, head size and sliding windows of a supported model."""
    spec = architecture_of(model)
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    windows = tuple(spec.sliding_windows(config))
    return ModelInfo(spec, config.num_hidden_layers, heads, kv_heads, head_dim, windows)


def decoder_layers(model: torch.nn.Module, spec: ArchitectureSpec) -> torch.nn.ModuleList:
    """The decoder layers of a causal LM (``model.model.layers`` for every supported architecture)."""
    base = getattr(model, "model", model)
    return getattr(base, spec.layers_attr)


def output_projection(model: torch.nn.Module, layer_idx: int) -> torch.nn.Linear:
    """The attention output projection ``W_O`` (``o_proj``) of layer ``layer_idx``."""
    spec = architecture_of(model)
    attention = getattr(decoder_layers(model, spec)[layer_idx], spec.attention_attr)
    return getattr(attention, spec.output_proj_attr)
