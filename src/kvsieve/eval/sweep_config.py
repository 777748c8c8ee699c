r"""What a sweep runs: policies × budgets × tasks × lengths × samples, from flags or a YAML file.

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
The full cache always runs as the reference (policy ``full``, budget ``None``). Policies are
:class:`kvsieve.policies.spec.PolicySpec`\ s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvsieve.eval.tasks.text import CALIBRATION_SEEDS, HELDOUT_SEEDS
from kvsieve.models.loading import DEFAULT_MODEL, parse_dtype, resolve_device
from kvsieve.models.names import validate_model_name
from kvsieve.policies.spec import PolicySpec, PolicySpecError

FULL = "full"
BACKENDS = ("local", "ray")
#: Keys a YAML sweep file may hold (dashes or underscores).
CONFIG_KEYS = (
    "policies", "budgets", "tasks", "lengths", "samples", "seed", "output_dir", "workers", "threads",
    "backend", "address", "model", "dtype", "device",
)


class SweepConfigError(ValueError):
    """A sweep setting is invalid (unknown policy, task, key, or a value out of range)."""


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
            entries = value if isinstance(value, list) else _as_list(value, key)
            try:
                value = [PolicySpec.parse(p) for p in entries]
            except PolicySpecError as err:
                raise SweepConfigError(str(err)) from None
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
    if config.seed in CALIBRATION_SEEDS:  # what kvsieve tune fits on is never what an evaluation reports
        raise SweepConfigError(
            f"seed: {config.seed} is a calibration seed ({CALIBRATION_SEEDS.start}–{CALIBRATION_SEEDS.stop - 1}, "
            f"reserved for kvsieve tune); evaluate on another seed, e.g. a held-out one "
            f"({HELDOUT_SEEDS.start}–{HELDOUT_SEEDS.stop - 1}: haystacks from essays no calibration sample uses)"
        )
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
