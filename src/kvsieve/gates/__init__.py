"""Learned retention gates (TrimKV / DBTrimKV): the gate module, its files, and the shipped gates."""

from kvsieve.gates.pretrained import VARIANTS, load_pretrained, pretrained_stem
from kvsieve.gates.retention import B_OUT_INIT, GateConfig, GateMismatchError, RetentionGates, load_gates

__all__ = [
    "B_OUT_INIT",
    "VARIANTS",
    "GateConfig",
    "GateMismatchError",
    "RetentionGates",
    "load_gates",
    "load_pretrained",
    "pretrained_stem",
]
