"""Scorers: which held entries matter (one file per method)."""

from kvsieve.parts.scorers.base import Scorer, protect_recent
from kvsieve.parts.scorers.caote import Caote
from kvsieve.parts.scorers.global_local import GlobalLocal
from kvsieve.parts.scorers.h2o import AccumulatedAttention
from kvsieve.parts.scorers.random import RandomScores
from kvsieve.parts.scorers.restkv import OutputReconstruction
from kvsieve.parts.scorers.retention import RetentionGate
from kvsieve.parts.scorers.snapkv import WindowAttention
from kvsieve.parts.scorers.snapkv_plus import GroupWindowAttention
from kvsieve.parts.scorers.streaming_llm import Sinks
from kvsieve.parts.scorers.tova import LastQueryAttention

#: Scorers by the name ``str()`` and ``kvsieve list`` show.
SCORERS: dict[str, type[Scorer]] = {
    cls.name: cls
    for cls in (WindowAttention, AccumulatedAttention, LastQueryAttention, Sinks, RandomScores, OutputReconstruction,
                GlobalLocal)
}
SCORERS[GroupWindowAttention.name] = GroupWindowAttention
SCORERS[RetentionGate.name] = RetentionGate

__all__ = [
    "SCORERS",
    "AccumulatedAttention",
    "Caote",
    "GlobalLocal",
    "GroupWindowAttention",
    "LastQueryAttention",
    "OutputReconstruction",
    "RandomScores",
    "RetentionGate",
    "Scorer",
    "Sinks",
    "WindowAttention",
    "protect_recent",
]
