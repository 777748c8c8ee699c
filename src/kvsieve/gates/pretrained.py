"""Gates shipped with kvsieve (``gates/pretrained/<model>-<variant>.{safetensors,json}``).

``variant`` is what the gate was trained for: ``"trimkv"`` (untied readout, per-head capacity loss),
``"dbtrimkv"`` (tied readout, global capacity loss) or ``"dbtrimkv_untied"`` (untied readout, global
capacity loss: the paper's "no weight tying" ablation). Files are produced by ``kvsieve train`` (see
``docs/results/trimkv/``).
"""

from __future__ import annotations

from pathlib import Path

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
