"""Named KV-cache policies (one file each) and their registry."""

from kvsieve.policies.base import Policy, PolicyConfigError
from kvsieve.policies.registry import UnknownPolicyError, list_policies, make_policy, policy_class, register

__all__ = [
    "Policy",
    "PolicyConfigError",
    "UnknownPolicyError",
    "list_policies",
    "make_policy",
    "policy_class",
    "register",
]
