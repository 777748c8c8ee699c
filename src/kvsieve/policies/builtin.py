"""Imports every built-in policy module so each registers itself."""

from kvsieve.policies import (  # noqa: F401
    ada_restkv,
    adakv,
    caote,
    exact_topk,
    full,
    h2o,
    pyramid_restkv,
    pyramidkv,
    random_policy,
    restkv,
    snapkv,
    streaming_llm,
    tova,
)
