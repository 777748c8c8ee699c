"""The padded ``(batch, heads, L, ...)`` view of a layer store's ragged entries."""

from __future__ import annotations

from collections.abc import Callable

import torch


class DenseView:
    """Padded ``(batch, heads, L, ...)`` view of a layer store; ``valid`` is None when nothing is padded.

    Positions and side data are made only when read, and so are keys and values given as None with a ``fetch``
    (a ragged layout's gathered view: a plan that reads only side data and positions — the retention gates' —
    gathers neither of the two big buffers; a ragged decoding step that needs no side data gathers only them).
    """

    def __init__(
        self,
        keys: torch.Tensor | None,
        values: torch.Tensor | None,
        positions: torch.Tensor | None,
        valid: torch.Tensor | None,
        extras: dict[str, torch.Tensor] | None = None,
        fetch: Callable[[str], torch.Tensor] | None = None,
        side_names: tuple[str, ...] = (),
        length: int | None = None,
    ):
        """``keys``/``values`` None: fetched as ``fetch("keys")``/``fetch("values")`` when read (``length``, the
        view's ``L``, is then given)."""
        self._keys, self._values, self.valid = keys, values, valid
        self._positions = positions
        self._extras = extras
        self._fetch = fetch
        self._side_names = side_names
        self._length = length

    def _fetched(self, attribute: str, name: str) -> torch.Tensor:
        """The field held in ``attribute``, fetched as ``name`` the first time it is read."""
        value: torch.Tensor | None = getattr(self, attribute)
        if value is None:
            assert self._fetch is not None
            value = self._fetch(name)
            setattr(self, attribute, value)
        return value

    @property
    def keys(self) -> torch.Tensor:
        return self._fetched("_keys", "keys")

    @property
    def values(self) -> torch.Tensor:
        return self._fetched("_values", "values")

    @property
    def length(self) -> int:
        return self._length if self._length is not None else self.keys.shape[2]

    def built(self) -> tuple[torch.Tensor, ...]:
        """The keys, values and validity this view holds so far (nothing is fetched)."""
        return tuple(t for t in (self._keys, self._values, self.valid) if t is not None)

    @property
    def positions(self) -> torch.Tensor:
        return self._fetched("_positions", "positions")

    @property
    def extras(self) -> dict[str, torch.Tensor]:
        if self._extras is None:
            assert self._fetch is not None
            self._extras = {name: self._fetch(name) for name in self._side_names}
        return self._extras
