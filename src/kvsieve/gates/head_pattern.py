"""Head patterns for DuoAttention (Xiao et al. 2024, arXiv:2410.10819): one score per (layer, KV head), higher
meaning the head needs the whole context (a *retrieval* head); the rest are *streaming* heads that keep only
attention sinks and recent tokens.

A pattern is a small human-readable JSON file (``format: kvsieve-head-pattern/1``): the scores, the streaming
window they were measured for (``sinks``, ``recent``), the model they belong to (its weights' fingerprint,
checked on load) and how they were obtained (``calibration``). ``kvsieve calibrate-duo`` writes one
(:mod:`kvsieve.train.duo`); patterns shipped with kvsieve live in ``gates/patterns/<model>-duo.json`` and are
found by the model's fingerprint, as the shipped retention gates are.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvsieve.models.architectures import model_info
from kvsieve.models.fingerprint import model_fingerprint

FORMAT = "kvsieve-head-pattern/1"
#: Patterns shipped with kvsieve (``<model>-duo.json``).
PATTERN_DIR = Path(__file__).parent / "patterns"


@dataclass(frozen=True)
class HeadPattern:
    """Retrieval scores ``(layers, kv_heads)`` of one model and the streaming window they were measured for."""

    scores: torch.Tensor
    sinks: int
    recent: int
    model_fingerprint: str = ""
    model_name: str = ""
    calibration: dict[str, Any] = field(default_factory=dict)

    def check_model(self, model: torch.nn.Module, source: str = "pattern") -> None:
        """Refuse a pattern measured on another model (shape, then the weights' fingerprint when recorded)."""
        info = model_info(model)
        want = (info.num_layers, info.num_kv_heads)
        if tuple(self.scores.shape) != want:
            raise ValueError(f"{source}: scores for {tuple(self.scores.shape)} (layers, KV heads); "
                             f"this model has {want}")
        if self.model_fingerprint and self.model_fingerprint != model_fingerprint(model):
            raise ValueError(f"{source}: measured on weights {self.model_fingerprint}, this model's are "
                             f"{model_fingerprint(model)}; calibrate one with `kvsieve calibrate-duo`")

    def streaming_mask(self, streaming_share: float) -> torch.Tensor:
        """``(layers, kv_heads)`` True for the ``round(share · L·H)`` lowest-scored heads (ties: lower index first)."""
        count = round(float(streaming_share) * self.scores.numel())
        mask = torch.zeros(self.scores.numel(), dtype=torch.bool)
        if count:
            order = torch.sort(self.scores.flatten().double(), stable=True).indices
            mask[order[:count]] = True
        return mask.view(self.scores.shape)

    def save(self, path: str | Path) -> Path:
        """Write the pattern as JSON (``.json`` added when missing); returns the path."""
        target = Path(path)
        if target.suffix != ".json":
            target = target.with_suffix(".json")
        target.parent.mkdir(parents=True, exist_ok=True)
        payload = {"format": FORMAT, "model_name": self.model_name, "model_fingerprint": self.model_fingerprint,
                   "sinks": self.sinks, "recent": self.recent, "calibration": self.calibration,
                   "scores": [[float(x) for x in row] for row in self.scores.tolist()]}
        target.write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
        return target


def load_pattern(path: str | Path) -> HeadPattern:
    """A pattern saved by :meth:`HeadPattern.save` (``.json`` optional)."""
    target = Path(path)
    if not target.exists() and target.suffix != ".json":
        target = target.with_suffix(".json")
    data = json.loads(target.read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{target}: not a head pattern (format {data.get('format')!r}, expected {FORMAT!r})")
    scores = torch.tensor(data["scores"], dtype=torch.float64)
    if scores.dim() != 2:
        raise ValueError(f"{target}: scores must be a (layers, KV heads) table")
    return HeadPattern(scores, int(data["sinks"]), int(data["recent"]), data.get("model_fingerprint", ""),
                       data.get("model_name", ""), dict(data.get("calibration", {})))


def pretrained_pattern(model: torch.nn.Module) -> HeadPattern:
    """The shipped pattern of ``model`` (matched by its weights' fingerprint); ``FileNotFoundError`` otherwise."""
    want = model_fingerprint(model)
    for path in sorted(PATTERN_DIR.glob("*-duo.json")):
        pattern = load_pattern(path)
        if pattern.model_fingerprint == want:
            return pattern
    shipped = [p.stem for p in sorted(PATTERN_DIR.glob("*-duo.json"))]
    raise FileNotFoundError(
        f"no shipped DuoAttention head pattern for this model (weights {want}); shipped: {shipped}. Measure one "
        "with `kvsieve calibrate-duo --model PATH --output runs/duo.json` and pass pattern='runs/duo.json'"
    )
