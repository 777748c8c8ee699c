"""``kvsieve tune``'s settings and the per-trial summary both the search and its report read."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvsieve.tune.calibration import CalibrationSet
from kvsieve.tune.space import check_choices, default_choices

#: The equal-memory anchor: every trial's bytes are compared with this preset's at the same budget.
ANCHOR = "snapkv"
#: Seed methods and baselines evaluated on the calibration set for the report (``--baselines``).
DEFAULT_BASELINES = (
    "restkv", "h2o_caote", "snapkv_fastcaote", "ems", "rocketkv", "dbtrimkv", "snapkv", "pyramidkv", "adakv",
    "h2o", "tova", "streaming_llm", "random",
)


@dataclass
class TuneConfig:
    """Everything ``kvsieve tune`` needs (see the CLI's flags)."""

    budget: int
    calibration: CalibrationSet = field(default_factory=CalibrationSet)
    model: str = "smollm2"
    dtype: str = "bfloat16"
    device: str = "cpu"
    trials: int | None = 40
    time_limit: float | None = None
    batch: int = 4
    prune_after: int = 6
    workers: int = 1
    threads: int | None = None
    backend: str = "local"
    address: str | None = None
    output_dir: str = "results/tune"
    choices: dict[str, tuple[str, ...]] = field(default_factory=default_choices)
    baselines: tuple[str, ...] = DEFAULT_BASELINES
    seed: int = 0
    name: str | None = None
    byte_tolerance: float = 0.01

    def validate(self) -> None:
        for key, low in (("budget", 1), ("batch", 1), ("prune_after", 1), ("workers", 1)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"--{key.replace('_', '-')}: must be an int ≥ {low}; got {value!r}")
        if self.trials is not None and self.trials < 1:
            raise ValueError(f"--trials: must be ≥ 1; got {self.trials}")
        if self.time_limit is not None and self.time_limit <= 0:
            raise ValueError(f"--time-limit: must be > 0 seconds; got {self.time_limit}")
        if self.trials is None and self.time_limit is None:
            raise ValueError("give --trials or --time-limit (or both): the search needs an end")
        if not 0 <= self.byte_tolerance < 1:
            raise ValueError(f"byte_tolerance: must be in [0, 1); got {self.byte_tolerance}")
        check_choices(self.choices)
        from kvsieve.policies.presets import make_policy

        for name in (*self.baselines, ANCHOR):
            try:
                make_policy(name, budget=self.budget)
            except ValueError as err:
                raise ValueError(f"--baselines: {name}: {err}") from None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["calibration"] = self.calibration.to_dict()
        out["choices"] = {kind: list(names) for kind, names in self.choices.items()}
        out["baselines"] = list(self.baselines)
        return out


@dataclass
class TrialResult:
    """What one trial's cells give (means over the cells evaluated)."""

    kl: float
    logprob_gap: float
    score: float
    kv_bytes: float
    kv_bytes_full: float
    cells: int


def summarise(records: Sequence[dict[str, Any]]) -> TrialResult:
    """Means over a trial's records (``kl_full_compressed`` per answer token, bytes held, …)."""
    def mean(key: str) -> float:
        values = [float(r[key]) for r in records if r.get(key) is not None]
        return sum(values) / len(values) if values else float("nan")

    return TrialResult(mean("kl_full_compressed"), mean("logprob_gap"), mean("score"), mean("kv_bytes_held"),
                       mean("kv_bytes_full"), len(records))
