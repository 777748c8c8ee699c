"""Policy names: presets of parts (see :mod:`kvsieve.policies.presets`)."""

from kvsieve.policies.presets import PRESETS, Preset, UnknownPolicyError, list_policies, make_policy, preset

__all__ = ["PRESETS", "Preset", "UnknownPolicyError", "list_policies", "make_policy", "preset"]
