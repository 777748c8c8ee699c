"""``BudgetSpec``: what a part may know about the policy it is part of (its budget, not its other parts).

Parts check themselves against it (a window no larger than the budget) and allocators turn it into
per-head counts; :class:`kvsieve.policies.policy.Policy` builds it, so parts never import the policy.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BudgetSpec:
    """The budget of one policy, as its parts see it.

    Attributes:
        name: the policy's name (for error messages).
        budget: entries kept per KV head (None when ``ratio`` is given or nothing is compressed).
        ratio: fraction of held entries removed, in ``[0, 1)`` (None when ``budget`` is given).
        window: recent entries the policy's scorer always keeps (0 without a scorer).
    """

    name: str = "custom"
    budget: int | None = None
    ratio: float | None = None
    window: int = 0
