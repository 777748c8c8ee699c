"""The parts a policy composes: scorers, allocators, actions, selectors and schedules."""

from kvsieve.core.part import Part, PolicyConfigError
from kvsieve.parts.actions import ACTIONS, Action, Evict, Merge
from kvsieve.parts.allocators import ALLOCATORS, Adaptive, Allocator, GlobalBudget, Pyramid, Uniform
from kvsieve.parts.schedules import SCHEDULES, Blockwise, Decode, Prefill, Schedule
from kvsieve.parts.scorers import (
    SCORERS,
    AccumulatedAttention,
    Caote,
    LastQueryAttention,
    OutputReconstruction,
    RandomScores,
    Scorer,
    Sinks,
    WindowAttention,
)
from kvsieve.parts.selectors import SELECTORS, ExactTopK, Selector

__all__ = [
    "ACTIONS", "ALLOCATORS", "SCHEDULES", "SCORERS", "SELECTORS",
    "AccumulatedAttention", "Action", "Adaptive", "Allocator", "Blockwise", "Caote", "Decode", "Evict", "ExactTopK",
    "GlobalBudget", "LastQueryAttention", "Merge", "OutputReconstruction", "Part", "PolicyConfigError", "Prefill",
    "Pyramid", "RandomScores", "Schedule", "Scorer", "Selector", "Sinks", "Uniform", "WindowAttention",
]
