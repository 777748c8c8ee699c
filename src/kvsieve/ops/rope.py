"""Rotary position embedding of one layer as data: un-rotate stored keys to their raw (pre-RoPE) form and
rotate raw keys to any position (EMS, Li et al., 2024, arXiv:2412.08521, Sec. 4.1: redundancy is measured
on *raw* keys, "the superimposed positional encoding can attenuate the similarity").

The table is read from the model's config exactly as transformers builds it (``rope_parameters``: the
base ``rope_theta``, ``partial_rotary_factor`` — Phi3-style partial rotary, only the first ``rotary_dim``
dimensions turn — and the static scaled types ``linear``, ``llama3``, ``yarn``, ``proportional`` through
transformers' own ``ROPE_INIT_FUNCTIONS``). Models with one rope per layer type (Gemma3: a local base
for sliding layers, a global one for full layers) get the table of the layer's type. Layers without
rotary embedding (NoPE: SmolLM3's ``no_rope_layers`` entries equal to 0) get the identity table
(``rotary_dim = 0``): their stored keys are already raw. Rope types whose
frequencies depend on the sequence length (``dynamic``, ``longrope``) are refused: a stored key cannot
be un-rotated without knowing the table it was rotated with.

Rotation is transformers' ``x·cos + rotate_half(x)·sin`` with ``cos, sin`` scaled by the attention
factor ``s``; it is ``s`` times an orthogonal map, so its inverse is ``(x·cos − rotate_half(x)·sin)/s²``
with the same (scaled) ``cos, sin``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from kvsieve.transformers_adapter import rope_init

#: Rope types whose table does not depend on the sequence length (transformers' names).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


class UnsupportedRotaryError(ValueError):
    """A model's rotary embedding cannot be inverted from stored positions."""


@dataclass(frozen=True)
class RotaryTable:
    """Inverse frequencies ``(rotary_dim / 2,)``, attention scaling and how many leading dims rotate."""

    inv_freq: torch.Tensor
    scaling: float
    rotary_dim: int


def _layer_params(config: Any, layer_idx: int) -> tuple[dict[str, Any], str | None]:
    params = getattr(config, "rope_parameters", None)
    if params is None:
        theta = getattr(config, "rope_theta", None)
        if theta is None:
            raise UnsupportedRotaryError(
                f"model_type {getattr(config, 'model_type', None)!r}: no rope_parameters/rope_theta in the config"
            )
        params = {"rope_type": "default", "rope_theta": theta}
    types = getattr(config, "layer_types", None)
    if types is not None and isinstance(params, dict) and types[layer_idx] in params \
            and isinstance(params[types[layer_idx]], dict):
        return params[types[layer_idx]], types[layer_idx]
    return params, None


def uses_rope(config: Any, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` rotates its keys: False for NoPE layers (``config.no_rope_layers[i] == 0``,
    SmolLM3's convention, 1 meaning the layer uses RoPE)."""
    flags = getattr(config, "no_rope_layers", None)
    return flags is None or bool(flags[layer_idx])


#: Tables already built, per config object (dropped with it) and (layer, device): EMS plans every layer at every
#: decoding step under ``schedule="decode"``, and reading the config and building the frequencies each time cost
#: ~60 µs per layer and step.
_TABLES: weakref.WeakKeyDictionary[Any, dict[tuple[int, str], RotaryTable]] = weakref.WeakKeyDictionary()


def rotary_table(config: Any, layer_idx: int, device: torch.device | str = "cpu") -> RotaryTable:
    """The rotary table layer ``layer_idx`` of a model with ``config`` rotates its keys with (identity for NoPE);
    built once per config, layer and device (:data:`_TABLES`)."""
    try:
        known = _TABLES.setdefault(config, {})
    except TypeError:  # a config that cannot be weakly referenced: built every time
        return _build_rotary_table(config, layer_idx, device)
    key = (layer_idx, str(torch.device(device)))
    table = known.get(key)
    if table is None:
        table = known[key] = _build_rotary_table(config, layer_idx, device)
    return table


def _build_rotary_table(config: Any, layer_idx: int, device: torch.device | str) -> RotaryTable:
    config = getattr(config, "text_config", None) or config
    if not uses_rope(config, layer_idx):
        return RotaryTable(torch.zeros(0, device=device, dtype=torch.float32), 1.0, 0)
    params, layer_type = _layer_params(config, layer_idx)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in STATIC_ROPE_TYPES:
        raise UnsupportedRotaryError(
            f"rope_type {rope_type!r} changes with the sequence length, so stored keys cannot be un-rotated "
            f"(EMS needs raw keys); supported rope types: {STATIC_ROPE_TYPES}"
        )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
    if rope_type == "default":
        dim = int(head_dim * partial)
        base = float(params["rope_theta"])
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        scaling = 1.0
    else:
        inv_freq, scaling = rope_init(rope_type, config, layer_type)
    rotary_dim = 2 * inv_freq.shape[0]
    if rotary_dim > head_dim or rotary_dim % 2:
        raise UnsupportedRotaryError(f"rotary dim {rotary_dim} does not fit head_dim {head_dim}")
    return RotaryTable(inv_freq.to(device=device, dtype=torch.float32), float(scaling), rotary_dim)


def half_cos_sin(table: RotaryTable, positions: torch.Tensor, factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` ``(..., rotary_dim / 2)`` of ``positions`` ``(...)`` times ``factor`` (float32): one half of
    :func:`cos_sin` (both halves are equal)."""
    freqs = positions.to(torch.float32)[..., None] * table.inv_freq.to(positions.device)
    cos, sin = freqs.cos(), freqs.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos, sin


def half_cos_sin64(table: RotaryTable, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`half_cos_sin`'s angles (the float32 products ``position · inv_freq``) with their ``cos, sin`` taken in
    float64, unscaled: the tables of :func:`unrotate_exact`, equal wherever they are computed (a float64 ``cos`` is
    within an ulp of the exact one, where a float32 table's vector and scalar paths may differ in the last bit)."""
    freqs = positions.to(torch.float32)[..., None] * table.inv_freq.to(positions.device)
    wide = freqs.double()
    return wide.cos(), wide.sin()


def cos_sin(table: RotaryTable, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` ``(..., rotary_dim)`` of ``positions`` ``(...)``, scaled by the attention factor (float32)."""
    cos, sin = half_cos_sin(table, positions, table.scaling)  # each half once (transformers: ``cat(freqs, freqs)``)
    return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``rotate_half``: ``(x₁, x₂) → (−x₂, x₁)`` over the two halves of the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate(keys: torch.Tensor, positions: torch.Tensor, table: RotaryTable) -> torch.Tensor:
    """Raw keys ``(..., d)`` at ``positions`` ``(...)`` → rotated keys (float32), as the model rotates them."""
    if table.rotary_dim == 0:  # NoPE layer
        return keys.float()
    cos, sin = cos_sin(table, positions)
    x = keys.float()
    r = table.rotary_dim
    turned = x[..., :r] * cos + rotate_half(x[..., :r]) * sin
    return torch.cat((turned, x[..., r:]), dim=-1) if r < x.shape[-1] else turned


def unrotate(keys: torch.Tensor, positions: torch.Tensor, table: RotaryTable) -> torch.Tensor:
    """Stored (rotated) keys ``(..., d)`` at ``positions`` → raw pre-RoPE keys (float32); inverse of :func:`rotate`.

    Computed half by half into one float32 buffer — ``x₁ = (y₁·cos + y₂·sin) / a``, ``x₂ = (y₂·cos − y₁·sin) / a``
    (``a`` the attention scaling, folded into the small cos/sin tables) — reading the stored dtype directly: no
    float copy of the keys, no rotated half, no concatenation (a prompt's queries are un-rotated per layer by
    Expected Attention: 12.8 → ~4 ms per layer at 4k tokens × 9 heads on the CPU)."""
    if table.rotary_dim == 0:  # NoPE layer
        return keys.float()
    half = table.rotary_dim // 2
    cos, sin = half_cos_sin(table, positions, 1.0 / table.scaling)
    raw = torch.empty(keys.shape, dtype=torch.float32, device=keys.device)
    first, second = keys[..., :half], keys[..., half : 2 * half]
    out_first, out_second = raw[..., :half], raw[..., half : 2 * half]
    torch.mul(first, cos, out=out_first)
    out_first.addcmul_(second, sin)
    torch.mul(second, cos, out=out_second)
    out_second.addcmul_(first, sin, value=-1.0)
    if 2 * half < keys.shape[-1]:  # partial rotary: the rest as stored
        raw[..., 2 * half :] = keys[..., 2 * half :]
    return raw


def unrotate_exact(keys: torch.Tensor, positions: torch.Tensor, table: RotaryTable) -> torch.Tensor:
    """Stored keys ``(..., d)`` at ``positions`` → their raw directions in float64: :func:`unrotate` without the
    attention factor (a cosine does not see it), ``x₁ = y₁·cos + y₂·sin``, ``x₂ = y₂·cos − y₁·sin`` over
    :func:`half_cos_sin64`. For decisions on cosines that must come out the same in another implementation
    (``native/merge.c``'s ``unrotate64``): two float64 computations agree to ~1e-15, float32 ones differ by ~1e-6."""
    wide = keys.double()
    if table.rotary_dim == 0:
        return wide
    half = table.rotary_dim // 2
    cos, sin = half_cos_sin64(table, positions)
    first, second = wide[..., :half], wide[..., half : 2 * half]
    turned = (first * cos + second * sin, second * cos - first * sin)
    return torch.cat((*turned, wide[..., 2 * half :]), dim=-1)
