"""The padded ``(batch, heads, L, ...)`` view of a layer store's ragged entries."""

from __future__ import annotations

from collections.abc import Callable

import torch


class DenseView:
    """Padded ``(batch, heads, L, ...)`` view of a layer store; ``valid`` is None when nothing is padded.

    Keys and values are materialised at once; positions and side data only when read (a ragged decoding
    step that needs neither gathers two buffers, not all of them).
    """

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor | None,
        valid: torch.Tensor | None,
        extras: dict[str, torch.Tensor] | None = None,
        fetch: Callable[[str], torch.Tensor] | None = None,
        side_names: tuple[str, ...] = (),
    ):
        self.keys, self.values, self.valid = keys, values, valid
        self._positions = positions
        self._extras = extras
        self._fetch = fetch
        self._side_names = side_names

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    @property
    def positions(self) -> torch.Tensor:
        if self._positions is None:
            assert self._fetch is not None
            self._positions = self._fetch("positions")
        return self._positions

    @property
    def extras(self) -> dict[str, torch.Tensor]:
        if self._extras is None:
            assert self._fetch is not None
            self._extras = {name: self._fetch(name) for name in self._side_names}
        return self._extras
