"""Named methods as presets of parts: ``make_policy("adakv", budget=256)``, ``list_policies()``.

Each preset names a scorer, an allocator, an action and a selector; keyword parameters are routed to
the part that owns them (a field of that part, or one of its aliases such as ``floor_alpha`` for the
adaptive allocator's ``alpha``), so every method keeps its paper's parameter names and any part can be
swapped by name or object: ``make_policy("restkv", budget=256, allocator="adaptive")``,
``make_policy("tova", budget=128, allocator="pyramid")``. Unknown names and parameters raise before any
work, listing what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from kvsieve.core.part import Part, PolicyConfigError
from kvsieve.parts.actions import ACTIONS, Action, EvictThenMerge, EvictThenMergePos
from kvsieve.parts.allocators import ALLOCATORS, Adaptive, Allocator, GlobalBudget, Pyramid, Uniform
from kvsieve.parts.allocators.two_stage import TwoStageSplit
from kvsieve.parts.scorers import (
    AccumulatedAttention,
    Caote,
    GlobalLocal,
    LastQueryAttention,
    OutputReconstruction,
    RandomScores,
    RetentionGate,
    Scorer,
    Sinks,
    WindowAttention,
)
from kvsieve.parts.scorers.snapkv_plus import GroupWindowAttention
from kvsieve.parts.selectors import ExactTopK, FilteredHybridSparse, HybridSparse, Quest, Selector, SparQ
from kvsieve.policies.policy import Policy

#: Parameters every preset accepts (they belong to the policy or its schedule).
POLICY_PARAMS = ("budget", "ratio", "schedule", "buffer", "block_size", "allocator", "action", "expand_gqa")


class UnknownPolicyError(ValueError):
    """Raised for a policy name that is not registered; the message lists the known ones."""


@dataclass(frozen=True)
class Preset:
    """A named method: which parts it uses, with what defaults, and where its parameters go."""

    name: str
    summary: str
    scorer: type[Scorer] | None = None
    allocator: type[Allocator] = Uniform
    selector: type[Selector] | None = None
    #: CAOTE presets: ``False`` CAOTE, ``True`` FastCAOTE; None: no correction.
    caote: bool | None = None
    #: ``adakv``: the scorer is another preset's, named by the ``base`` parameter.
    base_param: bool = False
    #: Parameter name → part kind, where a name would otherwise be ambiguous.
    routes: dict[str, str] = field(default_factory=dict)
    #: The action used unless ``action=`` names another (EMS: evict-then-merge; ``rocketkv_mt`` marks
    #: instead of evicting).
    action: str = "evict"
    #: The schedule used when none is given (EMS compresses at prefill and while decoding).
    schedule: str = "prefill"
    #: Parameter defaults of this preset (``trimkv``: ``schedule="decode"``), overridden by the caller's.
    defaults: dict[str, Any] = field(default_factory=dict)

    def parameters(self, base: str | None = None) -> list[str]:
        """Every parameter this preset accepts (with the default scorer for ``adakv``)."""
        names = list(POLICY_PARAMS)
        scorer = _scorer_class(self, base or "snapkv")
        for cls in (scorer, self.allocator, self.selector, ACTIONS[self.action]):
            if cls is not None:
                names += [f.name for f in fields(cls) if f.name not in names and f.name != "base"]
                names += [a for a in cls.aliases if a not in names]
        if self.base_param:
            names += ["base", "window"] if "window" not in names else ["base"]
        if self.caote is not None:
            names = [n for n in names if n != "fast"]
        if self.selector is not None:
            names = [n for n in names if n != "k"]
        return names


def _caote(fast: bool) -> str:
    return "FastCAOTE (mean value, Eq. 8)" if fast else "CAOTE (value-aware eviction error, Eq. 7)"


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("full", "everything (reference; no compression)"),
        Preset("random", "a seeded uniform random subset", RandomScores),
        Preset("streaming_llm", "4 attention sinks + the most recent entries", Sinks),
        Preset("h2o", "accumulated attention of all queries + a recent half", AccumulatedAttention),
        Preset("tova", "attention of the last query (all heads of the layer)", LastQueryAttention),
        Preset("snapkv", "observation-window attention (w=32), pooled (kernel 5), window kept", WindowAttention),
        Preset("pyramidkv", "snapkv scores, layer budgets decreasing with depth", WindowAttention, Pyramid),
        Preset("adakv", "any base score (snapkv by default), budget split across the heads of a layer",
               None, Adaptive, base_param=True, routes={"alpha": "allocator"}),
        Preset("exact_topk", "everything in memory; each decoding query attends to its top-k q·k (selection)",
               None, Uniform, ExactTopK),
        Preset("restkv", "output-reconstruction error with EMA and adaptive-window smoothing",
               OutputReconstruction),
        Preset("pyramid_restkv", "restkv scores with PyramidKV layer budgets", OutputReconstruction, Pyramid),
        Preset("ada_restkv", "restkv scores with AdaKV head budgets", OutputReconstruction, Adaptive),
        *(
            Preset(f"{base}_{'fastcaote' if fast else 'caote'}", f"{_caote(fast)} over {base}", cls, caote=fast)
            for base, cls in (("h2o", AccumulatedAttention), ("tova", LastQueryAttention), ("snapkv", WindowAttention))
            for fast in (False, True)
        ),
        Preset("ems", "EMS: Global-Local score (w=32, kernel 7), head-wise evict-then-merge (γ=4, τ=0.6), "
               "prefill and decoding", GlobalLocal, action=EvictThenMerge.name, schedule="decode"),
        Preset("ems_pos", "EMS w. pos: ems plus a position look-up table, centres expanded to their positions "
               "at attention time", GlobalLocal, action=EvictThenMergePos.name, schedule="decode"),
        Preset("quest", "everything in memory; top pages by the q·k upper bound from page min/max, token budget t "
               "split evenly (selection)", None, Uniform, Quest),
        Preset("sparq", "everything in memory; top-r |q| dims approximate scores, exact top t/2, mean-value mix, "
               "token budget t (selection)", None, Uniform, SparQ),
        Preset("hsa", "everything in memory; RocketKV's hybrid sparse attention (pages × top-k1 dims), token "
               "budget t (selection)", None, Uniform, HybridSparse),
        Preset("rocketkv", "SnapKV++ keeps N/c^r (evicts), then hybrid sparse attention; token budget t",
               GroupWindowAttention, TwoStageSplit, HybridSparse),
        Preset("rocketkv_mt", "everything in memory; each turn SnapKV++ marks N/c^r, hybrid sparse attention "
               "among them; token budget t (selection)", GroupWindowAttention, TwoStageSplit,
               FilteredHybridSparse, action="mark"),
        Preset("trimkv", "learned retention gates (untied), top-M per head, evicting at prefill and decoding",
               RetentionGate, defaults={"schedule": "decode", "buffer": 16, "pretrained": "trimkv"}),
        Preset("dbtrimkv", "learned retention gates (tied readout), one global budget over all layers and heads",
               RetentionGate, GlobalBudget, defaults={"schedule": "decode", "buffer": 16, "pretrained": "dbtrimkv"}),
        Preset("dbtrimkv_untied", "dbtrimkv's global ranking with untied gates (the paper's no-tying ablation)",
               RetentionGate, GlobalBudget,
               defaults={"schedule": "decode", "buffer": 16, "pretrained": "dbtrimkv_untied"}),
    )
}


def list_policies() -> dict[str, Preset]:
    """Every registered preset by name, sorted."""
    return dict(sorted(PRESETS.items()))


def preset(name: str) -> Preset:
    if name not in PRESETS:
        raise UnknownPolicyError(f"unknown policy {name!r}; known policies: {sorted(PRESETS)}")
    return PRESETS[name]


def _scorer_class(p: Preset, base: str) -> type[Scorer] | None:
    if not p.base_param:
        return p.scorer
    return preset(base).scorer


def _owner(param: str, p: Preset, classes: dict[str, type[Part] | None]) -> tuple[str, str] | None:
    """(part kind, field name) that ``param`` belongs to, or None."""
    if param in p.routes:
        kind = p.routes[param]
        cls = classes.get(kind)
        if cls is not None:
            return kind, param
    for kind in ("scorer", "allocator", "selector", "action"):
        cls = classes.get(kind)
        if cls is None:
            continue
        names = {f.name for f in fields(cls)} - {"base", "fast", "k"}
        if param in names:
            return kind, param
        if param in cls.aliases:
            return kind, cls.aliases[param]
    return None


def make_policy(name: str, **params: Any) -> Policy:
    """Build a preset; unknown names and parameters, and out-of-range values, raise before any work."""
    p = preset(name)
    params = {**p.defaults, **params}
    base_name = params.pop("base", "snapkv") if p.base_param else None
    allowed = p.parameters(base_name if isinstance(base_name, str) else None)
    if p.base_param:
        if base_name == name:
            raise PolicyConfigError(f"{name}: base must be a scoring policy other than {name}")
        if not isinstance(base_name, str):
            raise PolicyConfigError(f"{name}: base must be a policy name; got {base_name!r}")
        base_preset = preset(base_name)
        if base_preset.scorer is None or base_preset.base_param:
            raise PolicyConfigError(f"{name}: base {base_name!r} has no eviction score to allocate with")
    scorer_cls = _scorer_class(p, base_name or "snapkv")
    allocator = params.pop("allocator", None)
    allocator_cls: type[Allocator] = p.allocator
    if isinstance(allocator, str):
        if allocator not in ALLOCATORS:
            raise PolicyConfigError(f"{name}: allocator must be one of {sorted(ALLOCATORS)}; got {allocator!r}")
        allocator_cls = ALLOCATORS[allocator]
    elif isinstance(allocator, Allocator):
        allocator_cls = type(allocator)
    elif allocator is not None:
        raise PolicyConfigError(f"{name}: allocator must be a name or an Allocator; got {allocator!r}")
    action = params.pop("action", p.action)
    if isinstance(action, str) and action not in ACTIONS:
        raise PolicyConfigError(f"{name}: action must be one of {sorted(ACTIONS)}; got {action!r}")
    classes: dict[str, type[Part] | None] = {
        "scorer": scorer_cls, "allocator": allocator_cls, "selector": p.selector,
        "action": ACTIONS[action] if isinstance(action, str) else type(action),
    }
    policy_kw: dict[str, Any] = {k: params.pop(k) for k in ("budget", "ratio", "expand_gqa") if k in params}
    schedule = params.pop("schedule", p.schedule)
    buffer, block_size = params.pop("buffer", 0), params.pop("block_size", 128)
    per_part: dict[str, dict[str, Any]] = {"scorer": {}, "allocator": {}, "selector": {}, "action": {}}
    aliased: dict[tuple[str, str], str] = {}
    for param, value in params.items():
        owner = _owner(param, p, classes)
        if owner is None:
            if p.base_param and param == "window":
                continue  # adakv over a base without a window (h2o, tova...): kept for compatibility, unused
            raise PolicyConfigError(
                f"{name}: unexpected parameter {param!r}; allowed parameters: {allowed}"
            )
        per_part[owner[0]][owner[1]] = value
        if owner[1] != param:
            aliased[owner] = param
    try:
        from kvsieve.parts.schedules import make_schedule

        policy_kw["schedule"] = make_schedule(schedule, buffer=buffer, block_size=block_size)
    except PolicyConfigError as err:
        raise PolicyConfigError(f"{name}: {err}") from None
    built: dict[str, Any] = {}
    for kind in ("scorer", "allocator", "selector", "action"):
        cls = classes[kind]
        if cls is None:
            continue
        # a part given as an object keeps its settings; parameters of the same part are applied to it
        given = {"allocator": allocator if isinstance(allocator, Allocator) else None,
                 "action": action if isinstance(action, Action) else None}.get(kind)
        kwargs = per_part[kind]
        if kind == "selector" and policy_kw.get("budget") is not None:
            kwargs = {**kwargs, "k": policy_kw["budget"]}
        if kind == "selector" and policy_kw.get("budget") is None:
            raise PolicyConfigError(f"{name}: needs budget (int ≥ 1): the number of entries each query attends to")
        try:
            built[kind] = cls(**kwargs) if given is None else replace(given, **kwargs)
        except PolicyConfigError as err:
            names = [aliased[(kind, f)] for f in kwargs if (kind, f) in aliased]
            prefix = f"{name}: {', '.join(names)}: " if names else f"{name}: "
            raise PolicyConfigError(prefix + str(err)) from None
    caote = preset(base_name).caote if p.base_param and isinstance(base_name, str) else p.caote
    if caote is not None:
        built["scorer"] = Caote(base=built["scorer"], fast=caote)
    return Policy(name=name, **built, **policy_kw)
