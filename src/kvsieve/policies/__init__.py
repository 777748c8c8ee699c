"""KV-cache policies: compositions of parts (:class:`Policy`) and the named presets."""

from kvsieve.core.part import PolicyConfigError
from kvsieve.policies.policy import Policy
from kvsieve.policies.presets import PRESETS, Preset, UnknownPolicyError, list_policies, make_policy

__all__ = ["PRESETS", "Policy", "PolicyConfigError", "Preset", "UnknownPolicyError", "list_policies", "make_policy"]
