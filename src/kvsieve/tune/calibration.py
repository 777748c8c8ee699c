"""The calibration set ``kvsieve tune`` scores compositions on, and the cells that evaluate them.

A calibration set is task samples built by kvsieve's own task generators with a *calibration seed*
(:data:`~kvsieve.eval.tasks.text.CALIBRATION_SEEDS`): their haystacks come from the calibration essays only,
their needles, keys and values from the seed's own random streams. ``kvsieve eval`` refuses those seeds, and
the held-out seeds (:data:`~kvsieve.eval.tasks.text.HELDOUT_SEEDS`) take haystacks from the other essays only,
so what a tuned preset is reported on never shares a seed or a haystack text with what it was tuned on.

Tasks that read essays through another route (``passkey``, ``perplexity``'s fixed text, …) are not calibration
tasks; the RULER tasks and ``multiturn`` are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvsieve.eval.backends import Cell
from kvsieve.eval.sweep_config import FULL
from kvsieve.eval.tasks.text import CALIBRATION_SEEDS
from kvsieve.tune.space import Composition

#: Tasks whose samples follow the calibration / held-out split of their seed.
CALIBRATION_TASKS = (
    "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
    "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "multiturn",
)
#: The calibration set's tasks unless ``--tasks`` says otherwise (the six the studies report, at 2k).
DEFAULT_TASKS = ("niah_single_1", "niah_single_2", "niah_multikey_1", "niah_multivalue", "vt", "fwe")


@dataclass(frozen=True)
class CalibrationSet:
    """Task samples: every task × length, ``samples`` of each, built with sweep seed ``seed``."""

    tasks: tuple[str, ...] = DEFAULT_TASKS
    lengths: tuple[int, ...] = (2048,)
    samples: int = 2
    seed: int = CALIBRATION_SEEDS.start

    def __post_init__(self) -> None:
        unknown = [task for task in self.tasks if task not in CALIBRATION_TASKS]
        if unknown or not self.tasks:
            raise ValueError(f"--tasks: calibration tasks are {list(CALIBRATION_TASKS)} (their samples follow the "
                             f"calibration/held-out split of the seed); got {list(self.tasks)}")
        if not self.lengths or any(n < 64 for n in self.lengths):
            raise ValueError(f"--lengths: give context lengths ≥ 64 tokens; got {list(self.lengths)}")
        from kvsieve.eval.tasks import get_task

        for task in self.tasks:
            for length in self.lengths:
                get_task(task).check_length(length)  # "vt: length must be ≥ 512 tokens" before any work
        if self.samples < 1:
            raise ValueError(f"--samples: must be ≥ 1; got {self.samples}")
        if self.seed not in CALIBRATION_SEEDS:
            raise ValueError(f"calibration seed must be in {CALIBRATION_SEEDS.start}–{CALIBRATION_SEEDS.stop - 1} "
                             f"(got {self.seed}): only those build samples from the calibration essays")

    def samples_in_order(self) -> list[tuple[str, int, int]]:
        """``(task, length, index)`` sample-major: the first samples of every task come first, so the samples
        a trial is pruned after already cover every task."""
        return [(task, length, index) for index in range(self.samples) for length in self.lengths
                for task in self.tasks]

    def size(self) -> int:
        return len(self.tasks) * len(self.lengths) * self.samples

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tasks": list(self.tasks), "lengths": list(self.lengths)}


def groups_for(
    calibration: CalibrationSet, compositions: Sequence[Composition | tuple[str, tuple[tuple[str, Any], ...]]],
    budget: int, first: int, last: int, with_full: bool = False,
) -> list[list[Cell]]:
    """Cells of samples ``first … last − 1`` (in :meth:`CalibrationSet.samples_in_order`) under every composition
    (or ``(preset, params)``), one group per sample, so a worker builds each sample and its shared prompt
    forward once for all of them; ``with_full`` puts the full cache (the reference) first in each group."""
    groups = []
    for task, length, index in calibration.samples_in_order()[first:last]:
        cells = [Cell(task, FULL, (), None, length, index, calibration.seed)] if with_full else []
        for item in compositions:
            base, params = (item.base, item.params) if isinstance(item, Composition) else item
            cells.append(Cell(task, base, params, budget, length, index, calibration.seed))
        groups.append(cells)
    return groups
