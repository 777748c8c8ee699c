"""Imports every built-in policy module so each registers itself."""

from kvsieve.policies import (  # noqa: F401
    adakv,
    exact_topk,
    full,
    h2o,
    pyramidkv,
    random_policy,
    snapkv,
    streaming_llm,
    tova,
)
