"""Low-bit KV quantization: asymmetric integer codes, real bit packing, KIVI's key and value groupings.

The recipe is KIVI's (Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache",
arXiv:2402.02750, Sec. 3–4): each group of ``G`` numbers gets its own minimum ``z`` and step
``s = (max − min) / (2^b − 1)``; a number ``x`` is stored as ``q = round((x − z) / s)`` clamped to
``[0, 2^b − 1]`` and read back as ``q·s + z``. **Keys are quantized per channel** — a group is one channel
over ``G`` consecutive tokens, because key outliers live in a few fixed channels — and **values per
token** — a group is ``G`` consecutive channels of one token. A constant group (``max = min``) reads back
exactly. Codes of ``b ∈ {2, 4, 8}`` bits are packed ``8 / b`` to a byte (low bits first), so a 2-bit
entry really takes a quarter of a byte per number; scales and minimums are kept in float16 (what KIVI's
kernels store) and count towards the bytes held.

Everything here is a pure tensor function on the input's device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Bit widths with real packing (``8 / bits`` codes per byte).
SUPPORTED_BITS = (2, 4, 8)
#: The dtype scales and minimums are kept in.
PARAM_DTYPE = torch.float16


def check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}; got {bits!r}")


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``uint8`` codes ``(..., n)`` below ``2^bits`` → ``(..., ⌈n·bits/8⌉)`` bytes, low bits first."""
    check_bits(bits)
    per_byte = 8 // bits
    n = codes.shape[-1]
    padded = -n % per_byte
    if padded:
        codes = torch.nn.functional.pad(codes, (0, padded))
    grouped = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, per_byte)
    shifts = torch.arange(0, 8, bits, device=codes.device, dtype=torch.uint8)
    return (grouped << shifts).sum(dim=-1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The inverse of :func:`pack`: ``(..., bytes)`` → ``uint8`` codes ``(..., n)``."""
    check_bits(bits)
    shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.uint8)
    mask = (1 << bits) - 1
    codes = (packed.unsqueeze(-1) >> shifts) & mask
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * (8 // bits))[..., :n]


def code_table(bits: int, device: torch.device) -> torch.Tensor:
    """``(256, 8 / bits)`` float32: the codes a packed byte holds, low bits first (:func:`unpack` as a lookup)."""
    check_bits(bits)
    byte = torch.arange(256, device=device)[:, None]
    shifts = torch.arange(0, 8, bits, device=device)[None, :]
    return ((byte >> shifts) & ((1 << bits) - 1)).float()


def unpack_float(packed: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`unpack` straight to float32 (decoding dequantizes every quantized entry at every step).

    On the CPU through :func:`code_table`'s ``table`` (one lookup per byte instead of a shift, a mask and a
    conversion per code: 41 vs 57 µs for a 2-bit tier of 960 entries on one core), each table row read as one
    or two machine words (the ``8 / bits`` float32 codes of a byte are 4, 8 or 16 bytes): a gather of words
    instead of rows of floats (491k codes, 2 threads: 8-bit 480 → 365 µs, 4-bit 247 → 207 µs, 2-bit level). On other
    devices with shifts and masks, which are elementwise there (on an H200: 44 µs against 400 µs for the lookup,
    655k bytes).
    """
    if packed.device.type != "cpu":
        return unpack(packed, 8 // table.shape[1], n).float()
    per_byte = table.shape[1]
    words = table.view(torch.int64) if per_byte % 2 == 0 else table.view(torch.int32)  # (256, 1 or 2)
    if words.shape[1] == 1:
        words = words.view(256)
    codes = words.index_select(0, packed.reshape(-1).int()).view(torch.float32)
    return codes.view(*packed.shape[:-1], packed.shape[-1] * per_byte)[..., :n]


@dataclass
class Quantized:
    """Packed codes with per-group step and minimum.

    ``codes`` ``(rows, ⌈cols·bits/8⌉)`` uint8 for a ``(rows, cols)`` input; ``scale`` and ``minimum``
    float16, ``(rows, cols / group)`` for per-row groups (values: a row is a token) or
    ``(rows / group, cols)`` for per-column groups (keys: a column is a channel).
    """

    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor
    bits: int
    group: int
    per_channel: bool
    shape: tuple[int, int]

    def nbytes(self) -> int:
        """Bytes held: packed codes plus the float16 steps and minimums."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.minimum))


def asymmetric_codes(
    x: torch.Tensor, low: torch.Tensor, high: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes of ``x`` for groups with bounds ``low``/``high`` (broadcast to ``x``): ``(codes uint8, step,
    minimum)``, the step and minimum float16-exact (returned as float32) — the codes are made for exactly
    the values that are kept."""
    levels = (1 << bits) - 1
    low16 = low.to(PARAM_DTYPE).float()
    high16 = torch.maximum(high.to(PARAM_DTYPE).float(), low16)
    step = ((high16 - low16) / levels).to(PARAM_DTYPE).float()
    safe = torch.where(step > 0, step, torch.ones_like(step))
    q = torch.round((x - low16) / safe).clamp_(0, levels)
    return q.to(torch.uint8), step, low16


def quantize(x: torch.Tensor, bits: int, group: int, per_channel: bool) -> Quantized:
    """Quantize a ``(rows, cols)`` tensor in groups of ``group`` (see the module docstring).

    ``per_channel=False`` (values, per token): groups of ``group`` consecutive columns of each row;
    ``cols`` must be a multiple of ``group``. ``per_channel=True`` (keys, per channel): groups of ``group``
    consecutive rows of each column; ``rows`` must be a multiple of ``group``.
    """
    check_bits(bits)
    rows, cols = x.shape
    span = rows if per_channel else cols
    if group < 1 or span % group:
        axis = "rows (tokens)" if per_channel else "columns (channels)"
        raise ValueError(f"group must divide the {axis}: {span} is not a multiple of group={group}")
    xf = x.float()
    if per_channel:
        grouped = xf.reshape(rows // group, group, cols)
        low, high = grouped.amin(dim=1, keepdim=True), grouped.amax(dim=1, keepdim=True)
    else:
        grouped = xf.reshape(rows, cols // group, group)
        low, high = grouped.amin(dim=2, keepdim=True), grouped.amax(dim=2, keepdim=True)
    codes, step, low16 = asymmetric_codes(grouped, low, high, bits)
    axis = 1 if per_channel else 2
    packed = pack(codes.reshape(rows, cols), bits)
    return Quantized(packed, step.to(PARAM_DTYPE).squeeze(axis), low16.to(PARAM_DTYPE).squeeze(axis), bits, group,
                     per_channel, (rows, cols))


def dequantize(q: Quantized, dtype: torch.dtype) -> torch.Tensor:
    """The ``(rows, cols)`` tensor ``codes·step + minimum`` in ``dtype`` (computed in float32)."""
    rows, cols = q.shape
    codes = unpack(q.codes, q.bits, cols).float()
    if q.per_channel:
        grouped = codes.reshape(rows // q.group, q.group, cols)
        out = grouped * q.scale.float().unsqueeze(1) + q.minimum.float().unsqueeze(1)
    else:
        grouped = codes.reshape(rows, cols // q.group, q.group)
        out = grouped * q.scale.float().unsqueeze(2) + q.minimum.float().unsqueeze(2)
    return out.reshape(rows, cols).to(dtype)


def bytes_per_entry(head_dim: int, bits: int, group: int, key_group_tokens: int) -> float:
    """Average bytes one key + value entry takes at ``bits``: packed codes plus float16 parameters (values:
    per token, ``head_dim / group`` groups; keys: per channel, one step and minimum per channel shared by
    ``key_group_tokens`` tokens)."""
    check_bits(bits)
    codes = 2 * head_dim * bits / 8
    value_params = 2 * 2 * (head_dim // group)
    key_params = 2 * 2 * head_dim / key_group_tokens
    return codes + value_params + key_params


def full_entries_for_bytes(budget_bytes: int, head_dim: int, element: int) -> int:
    """Full-precision entries (key + value of ``element``-byte numbers) that ``budget_bytes`` per head buys."""
    return max(1, budget_bytes // (2 * head_dim * element))
