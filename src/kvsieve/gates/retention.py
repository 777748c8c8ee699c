"""Retention gates of TrimKV / DBTrimKV: per layer and KV head, ``β = σ(w_out · φ(W x + b) + b_out)``.

TrimKV (Bui et al. 2025, "Cache What Lasts", arXiv:2512.03324) gives every cached token a retention score
``β_i ∈ (0, 1)`` predicted once, when the token enters the cache, from the hidden state ``x_i`` its layer's
attention reads (after the layer's norm); its importance then decays geometrically, ``β_i^{t−i}``. DBTrimKV
(Bui et al., 2026, "Make Each Token Count", arXiv:2605.09649, Sec. 4.1, "Weight-tied retention gates") ties
the final projection ``(w_out, b_out)`` across all layers and heads so that scores of different heads share
one scale and can be ranked globally; TrimKV keeps one ``(w_out, b_out)`` per layer and head.

Reading chosen here (DBTrimKV Sec. 4.1's gate, with the two-layer MLP and tied final layer of its Sec. 5.1):
each (layer, KV head) has its own first layer ``W_{l,h} ∈ R^{d×r}, b_{l,h}`` (``r = gate_hidden``), the
activation ``φ`` is SiLU (the model's ``hidden_act`` in the authors' released configs), and the readout is
``w_out ∈ R^r, b_out ∈ R`` (tied) or ``w_out ∈ R^{L×H×r}, b_out ∈ R^{L×H}`` (untied). ``b_out`` starts at 18
(Sec. 5.1), so ``β ≈ 1 − 1.5·10⁻⁸``: a fresh gate is (numerically) full attention. The gate returns
``log β = log σ(z)`` (never ``β`` itself, which rounds to 1 in float32).

Files: ``<stem>.safetensors`` (the tensors) and ``<stem>.json`` (:class:`GateConfig`: base-model
architecture, shapes, tying, training summary). :func:`load_gates` refuses a model whose architecture or
shapes differ, naming the field.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

#: ``b_out`` at initialisation (DBTrimKV Sec. 5.1): β ≈ 1, the gated model starts as the full model.
B_OUT_INIT = 18.0
FORMAT = "kvsieve-retention-gates/1"


class GateMismatchError(ValueError):
    """Gates were trained for another model (architecture or shapes differ)."""


@dataclass(frozen=True)
class GateConfig:
    """What the gates were built for: the base model's architecture and shapes, and the gate's own shape."""

    model_type: str
    num_layers: int
    num_kv_heads: int
    hidden_size: int
    gate_hidden: int = 32
    tied: bool = True
    activation: str = "silu"
    #: Base model name (informational: the folder or hub name it was loaded from).
    model_name: str = ""
    #: Free-form training summary (data, steps, losses) written by the trainer.
    training: dict[str, Any] = field(default_factory=dict)
    format: str = FORMAT
    #: :func:`kvsieve.models.fingerprint.model_fingerprint` of the model the gates were trained on ("" if unknown).
    model_fingerprint: str = ""

    @staticmethod
    def for_model(model: torch.nn.Module, gate_hidden: int = 32, tied: bool = True) -> GateConfig:
        from kvsieve.models.fingerprint import model_fingerprint

        cfg = _text_config(model)
        return GateConfig(
            model_fingerprint=model_fingerprint(model),
            model_type=str(cfg.model_type), num_layers=int(cfg.num_hidden_layers),
            num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads),
            hidden_size=int(cfg.hidden_size), gate_hidden=gate_hidden, tied=tied,
            model_name=Path(str(getattr(cfg, "_name_or_path", "") or "")).name,
        )

    def check_model(self, model: torch.nn.Module, source: str = "gates") -> None:
        """Raise :class:`GateMismatchError` naming the first field where ``model`` differs."""
        other = GateConfig.for_model(model)
        for name in ("model_type", "num_layers", "num_kv_heads", "hidden_size"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                raise GateMismatchError(
                    f"{source} were trained for a {self.model_type} model with num_layers={self.num_layers}, "
                    f"num_kv_heads={self.num_kv_heads}, hidden_size={self.hidden_size} ({self.model_name or '?'}); "
                    f"this model has {name}={theirs!r} (gates: {mine!r}). Train gates for it with `kvsieve train`"
                )


def _text_config(model: torch.nn.Module) -> Any:
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


class RetentionGates(torch.nn.Module):
    """All retention gates of one model: ``log_beta(layer, x) → (batch, kv_heads, tokens)``."""

    def __init__(self, config: GateConfig, init_std: float = 0.02, seed: int | None = 0):
        super().__init__()
        if config.activation != "silu":
            raise ValueError(f"activation must be 'silu'; got {config.activation!r}")
        for name in ("num_layers", "num_kv_heads", "hidden_size", "gate_hidden"):
            if int(getattr(config, name)) < 1:
                raise ValueError(f"GateConfig.{name} must be an int ≥ 1; got {getattr(config, name)!r}")
        self.config = config
        layers, heads, d, r = config.num_layers, config.num_kv_heads, config.hidden_size, config.gate_hidden
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        self.w_in = torch.nn.Parameter(torch.randn(layers, heads, d, r, generator=gen) * init_std)
        self.b_in = torch.nn.Parameter(torch.zeros(layers, heads, r))
        out_shape = (r,) if config.tied else (layers, heads, r)
        self.w_out = torch.nn.Parameter(torch.randn(*out_shape, generator=gen) * init_std)
        self.b_out = torch.nn.Parameter(torch.full(() if config.tied else (layers, heads), B_OUT_INIT))
        #: Per layer, the input weights flattened for :meth:`_inference_logits`, with the weights' identity and version.
        self._flat: dict[int, tuple[tuple[int, int, int, int], torch.Tensor, torch.Tensor]] = {}

    def __repr__(self) -> str:
        c = self.config
        return (f"RetentionGates({c.model_type} {c.num_layers}×{c.num_kv_heads}, hidden {c.gate_hidden}, "
                f"{'tied' if c.tied else 'untied'})")

    def __deepcopy__(self, memo: dict[int, Any]) -> RetentionGates:
        return self  # read-only at inference: copies of a cache share their gates

    def on(self, device: torch.device) -> RetentionGates:
        """These gates on ``device``: ``self`` when already there, else a frozen copy (``self`` is left where it is,
        so gates shared by caches of models on different devices stay valid for each)."""
        if self.w_in.device == device:
            return self
        moved = RetentionGates(self.config, seed=None)
        moved.load_state_dict({name: tensor.detach().to(device) for name, tensor in self.state_dict().items()},
                              assign=True)
        return moved.requires_grad_(False)

    def logits(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """Gate pre-activations ``z`` ``(batch, kv_heads, tokens)`` from ``hidden`` ``(batch, tokens, d)``.

        Without gradients (inference: a cache scoring its new entries at every layer and decoding step) every head's
        input layer is one ``(d, heads·r)`` matrix applied by one ``addmm`` (:meth:`_inference_logits`); with them
        (training) the per-head form below, which autograd sees through. Both compute the same sums (within float
        rounding: 1e-7 on log β in float32)."""
        if not (torch.is_grad_enabled() and self.w_in.requires_grad):
            return self._inference_logits(layer, hidden)
        x = hidden.to(self.w_in.dtype).unsqueeze(1)  # (batch, 1, tokens, d) @ (heads, d, r): one batched matmul
        inner = torch.nn.functional.silu(torch.matmul(x, self.w_in[layer]) + self.b_in[layer, :, None])
        if self.config.tied:
            return inner @ self.w_out + self.b_out
        return (inner @ self.w_out[layer].unsqueeze(-1)).squeeze(-1) + self.b_out[layer, :, None]

    def _inference_logits(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """:meth:`logits` as ``silu(x·W + b)`` with ``W`` ``(d, heads·r)`` (the heads' input layers side by side,
        flattened once per layer and kept while the weights stay the same tensors, unmodified), then each head's
        readout: 3 operations instead of a broadcast batched matmul (64 → 23 µs per layer at batch 8, CPU)."""
        heads, dim, hidden_units = self.w_in.shape[1:]
        key = (self.w_in.data_ptr(), _version(self.w_in), self.b_in.data_ptr(), _version(self.b_in))
        cached = self._flat.get(layer)
        if cached is None or cached[0] != key:
            weight = self.w_in[layer].detach().transpose(0, 1).reshape(dim, heads * hidden_units).contiguous()
            cached = (key, weight, self.b_in[layer].detach().reshape(heads * hidden_units).contiguous())
            self._flat[layer] = cached
        _, weight, bias = cached
        batch, tokens, _ = hidden.shape
        inner = torch.nn.functional.silu(torch.addmm(bias, hidden.reshape(batch * tokens, dim).to(weight.dtype),
                                                     weight)).view(batch, tokens, heads, hidden_units)
        if self.config.tied:
            z = inner @ self.w_out + self.b_out
        else:
            z = (inner * self.w_out[layer]).sum(dim=-1) + self.b_out[layer]
        return z.transpose(1, 2)

    def log_beta(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """``log β`` ``(batch, kv_heads, tokens)`` (float32), numerically safe for β near 1."""
        return torch.nn.functional.logsigmoid(self.logits(layer, hidden).float())

    # ------------------------------------------------------------------ files
    def save(self, stem: str | Path) -> tuple[Path, Path]:
        """Write ``<stem>.safetensors`` and ``<stem>.json``; returns both paths."""
        stem = Path(stem)
        stem.parent.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        weights, meta = stem.with_suffix(".safetensors"), stem.with_suffix(".json")
        save_file(tensors, str(weights), metadata={"format": FORMAT})
        meta.write_text(json.dumps(asdict(self.config), indent=1, sort_keys=True) + "\n")
        return weights, meta


def _version(t: torch.Tensor) -> int:
    """``t``'s in-place modification counter; -1 for an inference tensor (gates loaded under
    ``torch.inference_mode``), which tracks none: such gates are read-only where they were made."""
    return -1 if t.is_inference() else t._version


def gate_files(stem: str | Path) -> tuple[Path, Path]:
    """The ``.safetensors`` and ``.json`` files of a gate ``stem`` (either file's path is accepted too)."""
    stem = Path(stem)
    if stem.suffix in (".safetensors", ".json"):
        stem = stem.with_suffix("")
    return stem.with_suffix(".safetensors"), stem.with_suffix(".json")


#: Field types of a gate config file (a hand-edited or foreign file is refused, naming the field).
_CONFIG_TYPES: dict[str, type | tuple[type, ...]] = {
    "model_type": str, "num_layers": int, "num_kv_heads": int, "hidden_size": int, "gate_hidden": int,
    "tied": bool, "activation": str, "model_name": str, "training": dict, "format": str, "model_fingerprint": str,
}
_POSITIVE = ("num_layers", "num_kv_heads", "hidden_size", "gate_hidden")


def read_config(stem: str | Path) -> GateConfig:
    """The :class:`GateConfig` of ``<stem>.json``; :class:`GateMismatchError` naming the file and the field
    for anything that is not a gate config (not JSON, not an object, unknown or missing keys, wrong types)."""
    _, meta = gate_files(stem)
    if not meta.is_file():
        raise FileNotFoundError(f"gates: no config file {meta} (expected next to the .safetensors)")
    try:
        raw = json.loads(meta.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise GateMismatchError(f"gates: cannot read {meta} as JSON ({err})") from None
    if not isinstance(raw, dict):
        raise GateMismatchError(f"gates: {meta} holds a {type(raw).__name__}, not a gate config object")
    if raw.get("format") != FORMAT:
        raise GateMismatchError(f"gates: {meta} is not a {FORMAT} file (format={raw.get('format')!r})")
    unknown = sorted(set(raw) - set(_CONFIG_TYPES))
    if unknown:
        raise GateMismatchError(f"gates: {meta} has unknown keys {unknown}; expected {sorted(_CONFIG_TYPES)}")
    missing = sorted({"model_type", *_POSITIVE[:3]} - set(raw))
    if missing:
        raise GateMismatchError(f"gates: {meta} lacks {missing}")
    for key, value in raw.items():
        kind = _CONFIG_TYPES[key]
        wrong_bool = kind is int and isinstance(value, bool)
        if not isinstance(value, kind) or wrong_bool or (key in _POSITIVE and value < 1):
            expected = "an int ≥ 1" if key in _POSITIVE else f"a {getattr(kind, '__name__', kind)}"
            raise GateMismatchError(f"gates: {meta}: {key} must be {expected}; got {value!r}")
    return GateConfig(**raw)


def load_gates(stem: str | Path, model: torch.nn.Module | None = None) -> RetentionGates:
    """Load gates from ``<stem>.safetensors`` + ``<stem>.json``; with ``model``, refuse a mismatched one.

    The tensors must have exactly the shapes the config names (a hand-edited or truncated file raises).
    The gates are put on the model's device (float32) and frozen.
    """
    weights, _ = gate_files(stem)
    config = read_config(stem)
    if model is not None:
        config.check_model(model, source=f"gates {weights.name}")
    gates = RetentionGates(config, seed=None)
    if not weights.is_file():
        raise FileNotFoundError(f"gates: no weights file {weights} (expected next to {weights.with_suffix('.json')})")
    try:
        tensors = load_file(str(weights))
    except Exception as err:  # safetensors raises its own error type for truncated or foreign files
        raise GateMismatchError(f"gates: {weights} is not a readable safetensors file (truncated?): {err}") from None
    expected = {k: tuple(v.shape) for k, v in gates.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    if expected != got:
        raise GateMismatchError(f"gates {weights}: tensors {got} do not match the config's shapes {expected}")
    bad = [name for name, tensor in tensors.items() if not bool(torch.isfinite(tensor).all())]
    if bad:
        raise GateMismatchError(f"gates {weights}: {', '.join(bad)} hold NaN or infinite values (a diverged "
                                "training run?); retrain them")
    gates.load_state_dict(tensors)
    gates.requires_grad_(False)
    if model is not None:
        device = next(iter(model.parameters())).device
        gates = gates.to(device)
    return gates
