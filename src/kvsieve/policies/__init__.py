"""KV-cache policies: compositions of parts (:class:`Policy`), the discovered presets and their parameters."""

from kvsieve.core.part import PolicyConfigError
from kvsieve.core.preset import Preset
from kvsieve.policies.policy import Policy
from kvsieve.policies.presets import (
    UnknownPolicyError,
    list_policies,
    make_policy,
    register_preset,
    unregister_preset,
)

__all__ = ["Policy", "PolicyConfigError", "Preset", "UnknownPolicyError", "list_policies", "make_policy",
           "register_preset", "unregister_preset"]
