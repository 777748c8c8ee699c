"""What a sweep runs: policies × budgets × tasks × lengths × samples, from flags or a YAML file.

YAML keys are the long flag names (``output-dir`` or ``output_dir``)::

    policies:
      - snapkv
      - {name: h2o, schedule: blockwise}
    budgets: [64, 128]
    tasks: [niah_single_1, vt]
    lengths: [2048, 4096]
    samples: 20
    seed: 0
    output-dir: results/eval

On the command line a policy takes parameters after colons: ``--policies snapkv,h2o:schedule=blockwise``.
The full cache always runs as the reference (policy ``full``, budget ``None``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvsieve.eval.model_loader import DEFAULT_MODEL, parse_dtype, validate_model_name
from kvsieve.models.loading import resolve_device

FULL = "full"
BACKENDS = ("local", "ray")
#: Keys a YAML sweep file may hold (dashes or underscores).
CONFIG_KEYS = (
    "policies", "budgets", "tasks", "lengths", "samples", "seed", "output_dir", "workers", "threads",
    "backend", "address", "model", "dtype", "device",
)


class SweepConfigError(ValueError):
    """A sweep setting is invalid (unknown policy, task, key, or a value out of range)."""


def _scalar(text: str) -> Any:
    """``"8"`` → 8, ``"true"`` → True, ``"0.5"`` → 0.5, anything else stays a string."""
    value = yaml.safe_load(text)
    return value if isinstance(value, int | float | bool) or value is None else text


@dataclass(frozen=True)
class PolicySpec:
    """A policy name and its parameters other than the budget (sorted, hashable)."""

    name: str
    params: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def parse(cls, entry: str | Mapping[str, Any]) -> PolicySpec:
        """From ``"h2o:schedule=blockwise"`` or ``{"name": "h2o", "schedule": "blockwise"}``."""
        if isinstance(entry, Mapping):
            params = dict(entry)
            name = params.pop("name", None)
            if not isinstance(name, str):
                raise SweepConfigError(f"a policy entry needs a 'name'; got {dict(entry)!r}")
        else:
            name, *pairs = str(entry).strip().split(":")
            params = {}
            for pair in pairs:
                key, sep, value = pair.partition("=")
                if not sep or not key:
                    raise SweepConfigError(f"policy {entry!r}: parameters are written name:key=value")
                params[key.strip()] = _scalar(value.strip())
        if "budget" in params:
            raise SweepConfigError(f"policy {name!r}: give budgets with 'budgets', not as a policy parameter")
        return cls(name.strip(), tuple(sorted(params.items())))

    @property
    def params_dict(self) -> dict[str, Any]:
        return dict(self.params)

    @property
    def params_key(self) -> str:
        """Canonical JSON of the parameters (part of a cell's identity)."""
        return json.dumps(self.params_dict, sort_keys=True)

    @property
    def label(self) -> str:
        """``h2o`` or ``h2o(schedule=blockwise)``: how tables and plots name it."""
        return label_of(self.name, self.params_dict)


def label_of(name: str, params: Mapping[str, Any] | None) -> str:
    """Display name of a policy with its parameters."""
    if not params:
        return name
    return f"{name}({','.join(f'{k}={v}' for k, v in sorted(params.items()))})"


@dataclass
class SweepConfig:
    """Everything a sweep needs; :func:`validate_config` checks it before any model is loaded."""

    policies: list[PolicySpec] = field(default_factory=lambda: [PolicySpec("snapkv")])
    budgets: list[int] = field(default_factory=lambda: [128])
    tasks: list[str] = field(default_factory=lambda: ["niah_single_1"])
    lengths: list[int] = field(default_factory=lambda: [2048])
    samples: int = 1
    seed: int = 0
    output_dir: str = "results/eval"
    workers: int | None = None
    threads: int | None = None
    backend: str = "local"
    address: str | None = None
    model: str = DEFAULT_MODEL
    dtype: str = "float32"
    device: str = "cpu"

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (policies as ``{name, **params}``)."""
        out = {key: getattr(self, key) for key in CONFIG_KEYS}
        out["policies"] = [{"name": p.name, **p.params_dict} for p in self.policies]
        return out


def _as_list(value: Any, key: str) -> list[Any]:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, int | float):
        return [value]
    if isinstance(value, Iterable) and not isinstance(value, Mapping):
        return list(value)
    raise SweepConfigError(f"{key}: expected a list or a comma-separated string; got {value!r}")


def _ints(value: Any, key: str) -> list[int]:
    out = []
    for item in _as_list(value, key):
        try:
            number = int(item)
        except (TypeError, ValueError):
            raise SweepConfigError(f"{key}: expected integers; got {item!r}") from None
        if isinstance(item, float) and item != number:
            raise SweepConfigError(f"{key}: expected integers; got {item!r}")
        out.append(number)
    return out


def build_config(values: Mapping[str, Any]) -> SweepConfig:
    """A :class:`SweepConfig` from a mapping of keys (YAML or parsed flags); ``None`` values are skipped."""
    config = SweepConfig()
    for raw_key, value in values.items():
        key = raw_key.replace("-", "_")
        if key not in CONFIG_KEYS:
            raise SweepConfigError(f"unknown sweep setting {raw_key!r}; known settings: {list(CONFIG_KEYS)}")
        if value is None:
            continue
        if key == "policies":
            value = [PolicySpec.parse(p) for p in (value if isinstance(value, list) else _as_list(value, key))]
        elif key in ("budgets", "lengths"):
            value = list(dict.fromkeys(_ints(value, key)))
        elif key == "tasks":
            value = [str(t) for t in _as_list(value, key)]
        elif key in ("samples", "seed", "workers", "threads"):
            numbers = _ints(value, key)
            if len(numbers) != 1:
                raise SweepConfigError(f"{key}: expected one integer; got {value!r}")
            value = numbers[0]
        else:
            value = str(value)
        setattr(config, key, value)
    return config


def load_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML sweep file (raises :class:`SweepConfigError` on anything else)."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise SweepConfigError(f"cannot read sweep file {path}: {err}") from None
    except yaml.YAMLError as err:
        raise SweepConfigError(f"{path}: invalid YAML: {err}") from None
    if not isinstance(data, dict):
        raise SweepConfigError(f"{path}: expected a mapping of sweep settings; got {type(data).__name__}")
    return data


def _default_get_task(name: str) -> Any:
    from kvsieve.eval.tasks import get_task

    return get_task(name)


def validate_config(config: SweepConfig, get_task: Callable[[str], Any] | None = None) -> None:
    """Check every policy × budget, task and range before anything heavy happens.

    Raises:
        SweepConfigError: the message names the bad setting and what is allowed.
    """
    from kvsieve.policies.presets import make_policy

    config.policies = [p for p in config.policies if p.name != FULL]  # the full cache always runs
    if config.policies and not config.budgets:
        raise SweepConfigError("budgets: give at least one budget (entries per KV head)")
    if len(set(config.policies)) != len(config.policies):
        raise SweepConfigError("policies: the same policy with the same parameters is listed twice")
    for spec in config.policies:
        for budget in config.budgets:
            try:
                make_policy(spec.name, budget=budget, **spec.params_dict)
            except ValueError as err:  # UnknownPolicyError and PolicyConfigError are ValueErrors
                raise SweepConfigError(f"policy {spec.label} with budget {budget}: {err}") from None
    if not config.tasks:
        raise SweepConfigError("tasks: give at least one task")
    lookup = get_task or _default_get_task
    _check_ranges(config)
    for task in config.tasks:
        try:
            spec = lookup(task)
        except (KeyError, ValueError) as err:
            raise SweepConfigError(f"tasks: {err.args[0] if err.args else err}") from None
        check_length = getattr(spec, "check_length", None)
        for length in config.lengths if callable(check_length) else ():
            try:
                check_length(length)
            except ValueError as err:
                raise SweepConfigError(f"lengths: {err}") from None


def _check_ranges(config: SweepConfig) -> None:
    if not config.lengths or any(n < 1 for n in config.lengths):
        raise SweepConfigError(f"lengths: give context lengths ≥ 1 token; got {config.lengths}")
    if config.samples < 1:
        raise SweepConfigError(f"samples: must be ≥ 1; got {config.samples}")
    for key in ("workers", "threads"):
        value = getattr(config, key)
        if value is not None and value < 1:
            raise SweepConfigError(f"{key}: must be ≥ 1; got {value}")
    if config.backend not in BACKENDS:
        raise SweepConfigError(f"backend: choose one of {list(BACKENDS)}; got {config.backend!r}")
    try:
        parse_dtype(config.dtype)
        validate_model_name(config.model)
        resolve_device(config.device)
    except ValueError as err:
        raise SweepConfigError(str(err)) from None
