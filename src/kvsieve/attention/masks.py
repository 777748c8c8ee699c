"""Masks for the kvsieve attention path.

The registered mask functions return a :class:`KvsieveMask`: the model's 2-D padding mask for the
kvsieve path, whose attention function builds causal visibility itself from each entry's stored
absolute position (right after eviction, unlike transformers' slot-indexed masks), and — built only if
asked for — the mask the model's original implementation (``sdpa`` or ``eager``) would have built from
the very same arguments, for every forward that does not use a kvsieve cache. A kvsieve-cache forward
therefore never materialises an N×N mask, and any other cache (``DynamicCache``, ``StaticCache``, none)
gets exactly the mask, and so exactly the outputs, of the untouched model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvsieve.transformers_adapter import bind_mask_arguments, mask_function


class KvsieveMask:
    """What the kvsieve mask functions hand the model in place of a mask (the same object to every layer).

    * :attr:`padding` — the 2-D ``(batch, seen + q)`` boolean padding mask transformers prepared (or None),
      read by the kvsieve path; the engine memoises it by identity, once per forward.
    * :meth:`original` — the original implementation's mask (a 4-D tensor, or None where it relies on
      ``is_causal``), built on first use from the arguments transformers passed, then kept.

    transformers never inspects a prepared mask: models hand it to the attention function as is. The
    places that touch it are mirrored (adapter contact 5): ``generate`` with a compileable cache
    (``StaticCache``) prepares the masks ahead — up to 5.23 it calls ``.contiguous()`` on them, which
    here returns what the original implementation returns there (its mask made contiguous, or None);
    from 5.24 it passes the object back into the forward, whose mask preprocessing reads ``.ndim`` (4:
    a prepared mask, not a 2-D padding mask to convert) and calls the mask function with it, which
    returns it unchanged. accelerate's device hooks call ``.to(device)``, which moves both masks.
    """

    #: Stands for a prepared 4-D mask (transformers' mask preprocessing converts only 2-D masks).
    ndim = 4

    __slots__ = ("_build", "_mask", "_source", "_to", "padding")

    def __init__(
        self,
        padding: torch.Tensor | None,
        build: Callable[[], Any] | None,
        source: KvsieveMask | None = None,
        to: tuple[tuple[Any, ...], dict[str, Any]] | None = None,
    ):
        self.padding = padding
        self._build, self._source, self._to = build, source, to
        self._mask: Any = None

    def original(self) -> Any:
        """The mask the model's original attention implementation would receive (built once)."""
        if self._source is not None:
            mask = self._source.original()
            if mask is not None and self._to is not None:
                mask = mask.to(*self._to[0], **self._to[1])
            self._mask, self._source, self._to = mask, None, None
        elif self._build is not None:
            self._mask, self._build = self._build(), None
        return self._mask

    def contiguous(self) -> Any:
        """``generate``'s ahead-of-time masks (compileable caches): the original mask, contiguous, or None."""
        mask = self.original()
        return None if mask is None else mask.contiguous()

    def to(self, *args: Any, **kwargs: Any) -> KvsieveMask:
        """Both masks moved (accelerate's device hooks); the original is still built once, by the source."""
        padding = None if self.padding is None else self.padding.to(*args, **kwargs)
        return KvsieveMask(padding, None, source=self, to=(args, kwargs))

    def __repr__(self) -> str:
        shape = None if self.padding is None else tuple(self.padding.shape)
        return f"KvsieveMask(padding={shape})"


def lazy_mask_function(original: str) -> Callable[..., KvsieveMask]:
    """The mask-interface entry of the kvsieve variant of ``original`` (``"sdpa"`` or ``"eager"``).

    It receives exactly the arguments transformers gives ``original``'s mask function (their layout
    depends on the version: the adapter binds them by name) and keeps them for
    :meth:`KvsieveMask.original`; the 2-D ``attention_mask`` among them is the kvsieve path's padding.
    """

    def kvsieve_mask(*args: Any, **kwargs: Any) -> KvsieveMask:
        arguments = bind_mask_arguments(original, args, kwargs)
        padding = arguments.get("attention_mask")
        if isinstance(padding, KvsieveMask):  # prepared ahead by ``generate`` (5.24+): already this step's mask
            return padding
        # Built after layer 0 updated the cache: a static cache's offset is its length tensor, advanced in
        # place by that update, so the bound arguments hold copies of tensor offsets (the 2-D mask is never
        # written to).
        return KvsieveMask(padding, lambda: _build_original(original, arguments))

    kvsieve_mask.__name__ = kvsieve_mask.__qualname__ = f"kvsieve_{original}_mask"
    return kvsieve_mask


def _build_original(original: str, arguments: dict[str, Any]) -> Any:
    # looked up when built, as the untouched model looks it up when it builds its mask
    return mask_function(original)(**arguments)


def padding_from_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The boolean ``(batch, seen + q)`` padding mask, or None when every token is real."""
    if attention_mask is None:
        return None
    if attention_mask.ndim != 2:
        raise ValueError(
            "kvsieve attention expects a 2-D padding attention_mask of shape (batch, past + new tokens); "
            f"got a {attention_mask.ndim}-D mask. Pass the tokenizer's attention_mask, not a prepared 4-D mask."
        )
    pad = attention_mask.bool()
    return None if bool(pad.all()) else pad


def dense_causal_mask(
    q_len: int,
    kv_len: int,
    pad: torch.Tensor | None,
    sliding_window: int | None,
    device: torch.device,
) -> torch.Tensor | None:
    """Boolean ``(batch|1, 1, q, kv)`` mask for queries that are the last ``q_len`` of ``kv_len`` slots.

    Used for a kvsieve cache's first forward (the queries are all the keys). A query that would see
    nothing (a padding query) sees itself, so no row is empty (its output is discarded). None when plain
    causal attention suffices.
    """
    if pad is None and sliding_window is None and q_len in (1, kv_len):
        return None  # plain causal: SDPA's is_causal (or no mask for one query) is exact
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask = mask & (q_pos - k_pos < sliding_window)
    mask = mask[None, None]
    if pad is not None:
        mask = mask & pad[:, None, None, -kv_len:].to(device)
        mask = mask | (k_pos == q_pos)[None, None]
    return mask
