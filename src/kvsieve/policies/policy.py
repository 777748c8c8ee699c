"""``Policy``: a KV-cache method as a composition of parts.

A policy is a *scorer* (which entries matter), an *allocator* (how many each layer/head keeps), an
*action* (evict or merge the rest), an optional *selector* (decoding-time subset attention, deleting
nothing) and a *schedule* (when compaction fires), plus the budget: ``budget`` entries per KV head or a
``ratio`` of held entries removed. Named methods are presets of parts (:mod:`kvsieve.policies.presets`);
any combination works without new code::

    Policy(scorer=WindowAttention(window=32), allocator=Adaptive(alpha=0.2), budget=256)
    make_policy("restkv", budget=256, allocator="adaptive")

Everything is validated on construction, before any model or cache is touched.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from kvsieve.cache.store import SideSpec, StoreHook
from kvsieve.core.budget import BudgetSpec
from kvsieve.core.part import Part, PolicyConfigError, is_int, is_number
from kvsieve.parts.actions.base import Action, Evict
from kvsieve.parts.allocators.base import Allocator, Uniform
from kvsieve.parts.schedules import Prefill, Schedule
from kvsieve.parts.scorers.base import ALL_SCHEDULES, Scorer
from kvsieve.parts.selectors.base import Selector
from kvsieve.policies.catalog import part_named


def _resolve(kind: str, value: object, base: type[Part]) -> Any:
    if isinstance(value, base):
        return value
    if isinstance(value, str):
        return part_named(kind, value)
    raise PolicyConfigError(f"{kind} must be a registered name or a {base.__name__} object; got {value!r}")


@dataclass(frozen=True)
class Policy:
    """A KV-cache policy: parts plus a budget (see the module docstring)."""

    scorer: Scorer | None = None
    allocator: Allocator = Uniform()  # noqa: RUF009 - frozen, hashable value objects
    action: Action = Evict()  # noqa: RUF009
    selector: Selector | None = None
    schedule: Schedule = Prefill()  # noqa: RUF009
    budget: int | None = None
    ratio: float | None = None
    #: Store keys/values per *query* head (``g×`` the memory) so each query head selects its own entries.
    expand_gqa: bool = False
    #: Compute a prompt's attention output and the column sums its scorer needs in one pass (CPU only; the
    #: output then differs from SDPA's, and so from plain transformers', by float rounding).
    fuse_statistics: bool = False
    name: str = "custom"

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedule", _resolve("schedule", self.schedule, Schedule))
        object.__setattr__(self, "allocator", _resolve("allocator", self.allocator, Allocator))
        object.__setattr__(self, "action", _resolve("action", self.action, Action))
        self.validate()

    # ------------------------------------------------------------------ properties
    @property
    def evicts(self) -> bool:
        """Whether the policy ever deletes (or merges) entries (``rocketkv_mt``'s ``mark`` action deletes nothing)."""
        return self.scorer is not None and self.action.deletes

    @property
    def needs_budget(self) -> bool:
        return self.scorer is not None or self.selector is not None

    @property
    def block_size(self) -> int | None:
        return self.schedule.block_length()

    @property
    def budget_spec(self) -> BudgetSpec:
        """What the parts see of this policy: name, budget or ratio, and the scorer's protected window."""
        window = self.scorer.protected_window() if self.scorer is not None else 0
        return BudgetSpec(self.name, self.budget, self.ratio, window)

    def schedules(self) -> tuple[str, ...]:
        """Schedules this combination of parts can run under."""
        if self.scorer is None:
            return ALL_SCHEDULES if self.selector is None else ("prefill",)
        allowed = set(self.scorer.schedules()) & set(self.allocator.schedules())
        return tuple(s for s in ALL_SCHEDULES if s in allowed)

    def side(self) -> tuple[SideSpec, ...]:
        """Per-entry side data every store of this policy keeps."""
        specs = list(self.scorer.side()) if self.scorer is not None else []
        specs += [*self.action.side(), *(self.selector.side() if self.selector is not None else ())]
        unique: dict[str, SideSpec] = {}
        for spec in specs:  # a datum two parts read (the mark action writes what hsa_mt reads) is kept once
            unique.setdefault(spec.name, spec)
        return tuple(unique.values())

    def hooks(self) -> list[StoreHook]:
        return self.selector.hooks() if self.selector is not None else []

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise :class:`PolicyConfigError` naming the parameter and its allowed range."""
        name, budget, ratio = self.name, self.budget, self.ratio
        if self.scorer is not None and not isinstance(self.scorer, Scorer):
            raise PolicyConfigError(f"{name}: scorer must be a Scorer; got {self.scorer!r}")
        if self.selector is not None and not isinstance(self.selector, Selector):
            raise PolicyConfigError(f"{name}: selector must be a Selector; got {self.selector!r}")
        if self.needs_budget:
            if budget is None and ratio is None:
                raise PolicyConfigError(f"{name}: give budget (int ≥ 1, entries per head) or ratio in [0, 1)")
            if budget is not None and ratio is not None:
                raise PolicyConfigError(f"{name}: give either budget or ratio, not both")
        if not self.needs_budget and (budget is not None or ratio is not None):
            raise PolicyConfigError(
                f"{name}: keeps every entry and takes no budget or ratio (got budget={budget!r}, ratio={ratio!r})"
            )
        if budget is not None and (not is_int(budget) or budget <= 0):
            raise PolicyConfigError(f"{name}: budget must be an int ≥ 1 (entries per head); got {budget!r}")
        if ratio is not None and (not is_number(ratio) or not 0.0 <= ratio < 1.0):
            raise PolicyConfigError(f"{name}: ratio must be a float in [0, 1); got {ratio!r}")
        if not isinstance(self.expand_gqa, bool):
            raise PolicyConfigError(f"{name}: expand_gqa must be True or False; got {self.expand_gqa!r}")
        if not isinstance(self.fuse_statistics, bool):
            raise PolicyConfigError(f"{name}: fuse_statistics must be True or False; got {self.fuse_statistics!r}")
        kind = self.schedule.name
        if kind not in self.schedules():
            raise PolicyConfigError(
                f"{name}: schedule {kind!r} cannot work with this policy; supported schedules: {self.schedules()}"
            )
        if self.needs_budget and budget is None and not self.schedule.accepts_ratio:
            raise PolicyConfigError(
                f"{name}: schedule {kind!r} needs an absolute budget (a ratio of a growing cache is undefined)"
            )
        if ratio is not None and not self.allocator.accepts_ratio:
            raise PolicyConfigError(f"{name}: the {self.allocator.name} allocator needs an absolute budget (int ≥ 1), "
                                    "not a ratio")
        if self.scorer is None and type(self.action) is not Evict:
            raise PolicyConfigError(f"{name}: the {self.action.name} action acts on a scorer's plan, and this policy "
                                    "has no scorer (give scorer=..., e.g. 'snapkv')")
        if self.selector is not None and budget is None:
            raise PolicyConfigError(f"{name}: needs budget (int ≥ 1): the number of entries each query attends to")
        for part in (self.scorer, self.allocator, self.action, self.selector, self.schedule):
            if part is not None:
                part.check(self.budget_spec)

    def bind(self, model: Any) -> Policy:
        """This policy with its scorer bound to ``model`` (learned scorers load weights; most return themselves)."""
        if self.scorer is None:
            return self
        bound = self.scorer.bind(model)
        return self if bound is self.scorer else replace(self, scorer=bound)

    # ------------------------------------------------------------------ description
    def flat_params(self) -> dict[str, Any]:
        """Every parameter as a flat mapping (budget, schedule, then the parts' fields)."""
        out: dict[str, Any] = {"budget": self.budget, "ratio": self.ratio, "schedule": self.schedule.name}
        out.update(self.schedule.params())
        if self.scorer is not None:
            out.update({k: v for k, v in self.scorer.params().items() if not isinstance(v, Part)})
            base = getattr(self.scorer, "base", None)
            if isinstance(base, Part):
                out.update(base.params())
        if type(self.allocator) is not Uniform:
            out["allocator"] = self.allocator.name
            out.update(self.allocator.params())
        if type(self.action) is not Evict:
            out["action"] = self.action.name
            out.update(self.action.params())
        if self.selector is not None:
            out.update(self.selector.params())
        if self.expand_gqa:
            out["expand_gqa"] = True
        if self.fuse_statistics:
            out["fuse_statistics"] = True
        return out

    def describe(self) -> dict[str, Any]:
        """The policy's name and parameters (``kvsieve list``, result files)."""
        return {"name": self.name, **self.flat_params()}

    def __str__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self.flat_params().items())
        return f"{self.name}({inner})"
