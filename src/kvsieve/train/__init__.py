"""Training retention gates (TrimKV / DBTrimKV) on a frozen model: ``train_gates`` and ``kvsieve train``."""

from kvsieve.train.gated_attention import dense_gated_attention, gated_attention
from kvsieve.train.losses import capacity_loss, kl_teacher_student
from kvsieve.train.trainer import VARIANTS, TrainConfig, TrainResult, evaluate_heldout, train_gates

__all__ = [
    "VARIANTS",
    "TrainConfig",
    "TrainResult",
    "capacity_loss",
    "dense_gated_attention",
    "evaluate_heldout",
    "gated_attention",
    "kl_teacher_student",
    "train_gates",
]
