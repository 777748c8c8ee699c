"""The search space of ``kvsieve tune``: which parts, and which of their hyperparameters, a trial may choose.

A trial picks a scorer, an allocator, an action and a schedule (define-by-run: each part's own fields are
only suggested when that part is chosen), and becomes a *composition*: a base preset (the scorer's) plus
``kind`` / ``kind.field`` parameters (:func:`kvsieve.make_policy`'s rules), so every trial is an ordinary
policy spec that any command, any worker and a preset file can rebuild.

Ranges are the ones the papers sweep or report (SnapKV's window 8–64 and kernel 1–9, ReST-KV's α and β,
PyramidKV's β, AdaKV's α, EMS's γ and τ, CAKE's τ₁/τ₂ and γ, KIVI-style 2/4-bit tiers) and a little around
them. Selectors are not searched: they keep every entry in memory (their savings are compute, not bytes),
so under a byte budget they are never feasible. Scorers that need a model-specific artefact or an extra pass
(``retention``: learned gates; ``kvzip``: a reconstruction pass of several prefills) are opt-in
(``--scorers``). Some combinations are refused by the policy itself (a layer-budget allocator under a
ratio, a blockwise schedule for a prefill-only scorer): such a trial fails at once, before any model work,
and the sampler moves on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

_WINDOW = ("cat", (8, 16, 32, 64))
_KERNEL = ("cat", (1, 3, 5, 7, 9))

#: scorer (a part or scoring preset name) → tuned fields: ("cat", choices) | ("float"/"int", low, high, log scale)
SCORERS: dict[str, dict[str, tuple[Any, ...]]] = {
    "snapkv": {"window": _WINDOW, "kernel_size": _KERNEL, "pooling": ("cat", ("avgpool", "maxpool"))},
    "snapkv_plus": {"window": _WINDOW, "kernel_size": ("cat", (7, 15, 31, 63))},
    "restkv": {"window": _WINDOW, "kernel_size": _KERNEL, "alpha": ("float", 0.05, 0.95, False),
               "beta": ("float", 100.0, 20000.0, True)},
    "h2o": {"recent_ratio": ("float", 0.1, 0.9, False)},
    "tova": {},
    "ems": {"window": _WINDOW, "kernel_size": _KERNEL},
    "keydiff": {"window": ("cat", (0, 8, 16, 32))},
    "expected_attention": {"n_future_positions": ("int", 64, 2048, True), "window": ("cat", (0, 8, 16, 32))},
    "cake": {"window": _WINDOW, "kernel_size": _KERNEL, "gamma": ("float", 10.0, 1000.0, True)},
    "snapkv_caote": {"window": _WINDOW, "kernel_size": _KERNEL},
    "tova_fastcaote": {},
    "streaming_llm": {"sinks": ("cat", (1, 4, 16))},
    "kvzip": {"window": ("cat", (0, 8, 32))},
    "retention": {"window": ("cat", (0, 8, 32))},
}
#: The preset a scorer's compositions are named after, where the scorer is not itself a preset.
BASES = {"retention": "dbtrimkv"}
#: Scorers searched unless ``--scorers`` says otherwise (``kvzip`` and ``retention`` are opt-in, see above).
DEFAULT_SCORERS = tuple(name for name in SCORERS if name not in ("kvzip", "retention"))

ALLOCATORS: dict[str, dict[str, tuple[Any, ...]]] = {
    "uniform": {},
    "pyramid": {"beta": ("int", 2, 40, True)},
    "adaptive": {"alpha": ("float", 0.0, 0.5, False)},
    "cake": {"tau1": ("float", 0.25, 4.0, True), "tau2": ("float", 0.25, 4.0, True)},
    "global": {"floor": ("cat", (0, 4, 16))},
}
ACTIONS: dict[str, dict[str, tuple[Any, ...]]] = {
    "evict": {},
    "evict_merge": {"gamma": ("float", 1.0, 8.0, False), "tau": ("float", 0.3, 1.0, False)},
    "quantize": {"bits": ("cat", (2, 4)), "low_share": ("float", 0.2, 0.8, False)},
}
SCHEDULES: dict[str, dict[str, tuple[Any, ...]]] = {
    "prefill": {},
    "blockwise": {"block_size": ("cat", (128, 256, 512))},
    "decode": {"buffer": ("cat", (0, 16, 64))},
}
SPACES = {"scorer": SCORERS, "allocator": ALLOCATORS, "action": ACTIONS, "schedule": SCHEDULES}


class Suggester(Protocol):
    """What a trial offers (Optuna's ``Trial``; tests pass a stand-in)."""

    def suggest_categorical(self, name: str, choices: Sequence[Any]) -> Any: ...
    def suggest_float(self, name: str, low: float, high: float, *, log: bool = False) -> float: ...
    def suggest_int(self, name: str, low: int, high: int, *, log: bool = False) -> int: ...


@dataclass(frozen=True)
class Composition:
    """A trial's policy: the base preset and the parameters over it (hashable, as an eval cell keys it)."""

    base: str
    params: tuple[tuple[str, Any], ...]

    @property
    def params_dict(self) -> dict[str, Any]:
        return dict(self.params)

    def label(self) -> str:
        """``restkv(window=16) + pyramid(beta=12.5) + evict_merge(tau=0.8) @ blockwise(block_size=256)``."""
        params = self.params_dict
        pieces = []
        for kind in ("scorer", "allocator", "action", "schedule"):
            name = params.get(kind, self.base if kind == "scorer" else "")
            fields = ", ".join(f"{key.split('.', 1)[1]}={_short(value)}" for key, value in sorted(params.items())
                               if key.startswith(kind + "."))
            pieces.append(f"{name}({fields})" if fields else str(name))
        scorer, allocator, action, schedule = pieces
        return f"{scorer} + {allocator} + {action} @ {schedule}"


def _short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _suggest(trial: Suggester, name: str, spec: tuple[Any, ...]) -> Any:
    kind = spec[0]
    if kind == "cat":
        return trial.suggest_categorical(name, list(spec[1]))
    if kind == "float":
        return trial.suggest_float(name, spec[1], spec[2], log=spec[3])
    if kind == "int":
        return trial.suggest_int(name, spec[1], spec[2], log=spec[3])
    raise ValueError(f"unknown distribution {spec!r}")


def check_choices(choices: Mapping[str, Sequence[str]]) -> None:
    """Refuse unknown part names in ``--scorers``/``--allocators``/``--actions``/``--schedules`` up front."""
    for kind, names in choices.items():
        known = SPACES[kind]
        unknown = [name for name in names if name not in known]
        if unknown or not names:
            raise ValueError(f"--{kind}s: choose one or more of {sorted(known)}; got {list(names)}")


def _fits(spec: tuple[Any, ...], field_name: str, budget: int) -> tuple[Any, ...]:
    """Ranges fitted to the budget, so every draw builds: a protected window of at most half the budget and a
    global allocator's per-head floor of at most a quarter (a policy refuses a window, or window + floor, that
    exceeds the budget)."""
    if spec[0] != "cat" or field_name not in ("window", "floor"):
        return spec
    limit = budget // 2 if field_name == "window" else budget // 4
    fitted = tuple(v for v in spec[1] if v <= limit)
    return ("cat", fitted or (min(v for v in spec[1]) if min(spec[1]) <= budget else 0,))


def part_fields(kind: str, name: str, budget: int) -> dict[str, tuple[Any, ...]]:
    """The tuned fields of part ``name`` of ``kind``, their ranges fitted to ``budget``."""
    return {field_name: _fits(spec, field_name, budget) for field_name, spec in SPACES[kind][name].items()}


def _typical(spec: tuple[Any, ...]) -> Any:
    """A value a trial may draw for a field (its first choice, or its low end): the validity check builds the
    policy with these, so a field that changes the regime (quantize's ``low_share``) is checked as drawn."""
    return spec[1][0] if spec[0] == "cat" else spec[1]


@dataclass(frozen=True)
class Space:
    """The parts a search may choose and which combinations the policy accepts (checked once, no model needed).

    ``valid`` holds every (scorer, allocator, action, schedule) that :func:`kvsieve.make_policy` builds at the
    budget with each tuned field at a value a trial may draw (windows fitted to the budget), so a trial only draws
    compositions that
    can run: the allocator among those valid with its scorer, and so on. A parameter's name carries its set of
    choices when that set is narrowed (``action[evict,evict_merge]``), so the sampler learns one distribution
    per distinct set.
    """

    choices: Mapping[str, tuple[str, ...]]
    budget: int
    valid: frozenset[tuple[str, str, str, str]]

    @classmethod
    def build(cls, choices: Mapping[str, Sequence[str]], budget: int) -> Space:
        from kvsieve.policies.presets import make_policy

        check_choices(choices)
        valid = set()
        for scorer in choices["scorer"]:
            for allocator in choices["allocator"]:
                for action in choices["action"]:
                    for schedule in choices["schedule"]:
                        picked = {"scorer": scorer, "allocator": allocator, "action": action, "schedule": schedule}
                        fields = {f"{kind}.{k}": _typical(spec) for kind, name in picked.items()
                                  for k, spec in part_fields(kind, name, budget).items()}
                        try:
                            make_policy(BASES.get(scorer, scorer), budget=budget, **picked, **fields)
                        except ValueError:
                            continue
                        valid.add((scorer, allocator, action, schedule))
        if not valid:
            raise ValueError(f"no combination of the chosen parts works at budget {budget}: {dict(choices)}")
        return cls({k: tuple(v) for k, v in choices.items()}, budget, frozenset(valid))

    def suggest(self, trial: Suggester) -> Composition:
        """A composition drawn by ``trial`` among the valid combinations."""
        picked: list[str] = []
        params: dict[str, Any] = {}
        for position, kind in enumerate(("scorer", "allocator", "action", "schedule")):
            names = sorted({combo[position] for combo in self.valid if list(combo[:position]) == picked},
                           key=list(self.choices[kind]).index)
            everything = [n for n in self.choices[kind] if any(c[position] == n for c in self.valid)]
            label = kind if names == everything else f"{kind}[{','.join(names)}]"
            name = trial.suggest_categorical(label, names) if len(names) > 1 else names[0]
            picked.append(name)
            params[kind] = name
            for field_name, spec in part_fields(kind, name, self.budget).items():
                params[f"{kind}.{field_name}"] = _suggest(trial, f"{kind}:{name}.{field_name}", spec)
        return Composition(BASES.get(picked[0], picked[0]), tuple(sorted(params.items())))


def default_choices(scorers: Sequence[str] | None = None) -> dict[str, tuple[str, ...]]:
    """Every part of the space (scorers: :data:`DEFAULT_SCORERS` unless given)."""
    return {"scorer": tuple(scorers or DEFAULT_SCORERS), "allocator": tuple(ALLOCATORS), "action": tuple(ACTIONS),
            "schedule": tuple(SCHEDULES)}
