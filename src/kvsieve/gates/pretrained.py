"""Gates shipped with kvsieve (``gates/pretrained/<model>-<variant>.{safetensors,json}``).

``variant`` is what the gate was trained for: ``"trimkv"`` (untied readout, per-head capacity loss),
``"dbtrimkv"`` (tied readout, global capacity loss) or ``"dbtrimkv_untied"`` (untied readout, global
capacity loss: the paper's "no weight tying" ablation). Files are produced by ``kvsieve train`` (see
``docs/results/trimkv/``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvsieve.gates.retention import GateConfig, RetentionGates, load_gates, read_config

PRETRAINED_DIR = Path(__file__).parent / "pretrained"
VARIANTS = ("trimkv", "dbtrimkv", "dbtrimkv_untied")


def pretrained_stem(model: torch.nn.Module, variant: str) -> Path:
    """The shipped gate for ``model`` and ``variant``; raises ``FileNotFoundError`` listing what exists."""
    if variant not in VARIANTS:
        raise ValueError(f"pretrained variant must be one of {VARIANTS}; got {variant!r}")
    want = GateConfig.for_model(model)
    shipped = sorted(PRETRAINED_DIR.glob(f"*-{variant}.json"))
    for meta in shipped:
        config = read_config(meta)
        if config.model_fingerprint:  # shipped gates name the weights they were trained on, not a folder
            if config.model_fingerprint == want.model_fingerprint:
                return meta.with_suffix("")
            continue
        if (config.model_type, config.num_layers, config.num_kv_heads, config.hidden_size) == (
            want.model_type, want.num_layers, want.num_kv_heads, want.hidden_size
        ) and (not want.model_name or not config.model_name or config.model_name == want.model_name):
            return meta.with_suffix("")
    available = [m.stem for m in sorted(PRETRAINED_DIR.glob("*.json"))]
    source = str(getattr(getattr(model, "config", None), "_name_or_path", "") or "") or "PATH/TO/MODEL"
    raise FileNotFoundError(
        f"no pretrained {variant!r} gates for this model ({want.model_type}, {want.num_layers} layers, "
        f"{want.num_kv_heads} KV heads, hidden {want.hidden_size}, {want.model_name or 'unnamed'}, weights "
        f"{want.model_fingerprint}); shipped (matched by the weights' fingerprint, not the folder name): "
        f"{available}. Train gates for it with `kvsieve train --model {source} --variant {variant} "
        f"--output runs/{variant}` (about 30 CPU-minutes for a 135M model; see docs/results/trimkv) and pass "
        f"gates='runs/{variant}/gates'"
    )


def load_pretrained(model: torch.nn.Module, variant: str) -> RetentionGates:
    return load_gates(pretrained_stem(model, variant), model)


def check_shipped_for_config(config: dict[str, Any], variant: str, source: str) -> None:
    """Before any weight is read: ``FileNotFoundError`` (naming the model and how to train gates) when no
    shipped ``variant`` gate has ``config.json``'s architecture and shapes. Shapes that match still need the
    weights' fingerprint to match once the model is loaded (:func:`pretrained_stem`)."""
    text = config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config
    want = (text.get("model_type"), text.get("num_hidden_layers"),
            text.get("num_key_value_heads") or text.get("num_attention_heads"), text.get("hidden_size"))
    for meta in sorted(PRETRAINED_DIR.glob(f"*-{variant}.json")):
        shipped = read_config(meta)
        if (shipped.model_type, shipped.num_layers, shipped.num_kv_heads, shipped.hidden_size) == want:
            return
    available = [m.stem for m in sorted(PRETRAINED_DIR.glob("*.json"))]
    raise FileNotFoundError(
        f"no pretrained {variant!r} gates for {source} ({want[0]}, {want[1]} layers, {want[2]} KV heads, hidden "
        f"{want[3]}); shipped: {available}. Train gates for it with `kvsieve train --model {source} --variant "
        f"{variant} --output runs/{variant}` and pass gates='runs/{variant}/gates'"
    )
