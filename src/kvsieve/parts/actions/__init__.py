"""Actions: what happens to the entries a plan does not keep (evict; merge)."""

from kvsieve.parts.actions.base import Action, Evict
from kvsieve.parts.actions.evict_merge import EvictThenMerge
from kvsieve.parts.actions.evict_merge_pos import EvictThenMergePos
from kvsieve.parts.actions.mark import Mark
from kvsieve.parts.actions.merge import Merge

ACTIONS: dict[str, type[Action]] = {cls.name: cls for cls in (Evict, Merge, EvictThenMerge, EvictThenMergePos, Mark)}

__all__ = ["ACTIONS", "Action", "Evict", "EvictThenMerge", "EvictThenMergePos", "Mark", "Merge"]
