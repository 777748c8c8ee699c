"""Checks of the chosen policies against the chosen model that can run before the model loads."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvsieve.gates.pretrained import check_shipped_for_config
from kvsieve.models.arguments import model_settings
from kvsieve.models.loading import spec_kind
from kvsieve.parts.scorers.retention import RetentionGate


def check_policies_for_model(args: argparse.Namespace, policies: list[Any]) -> None:
    """Before the model loads: learned-retention policies without ``gates=`` need shipped gates for a local
    model folder's architecture (read from its ``config.json``); refused here, naming how to train them."""
    spec = model_settings(args)["model"]
    if spec_kind(spec) != "folder":
        return  # built-in models, GGUF files, hub ids and functions: checked by fingerprint after loading
    config = json.loads((Path(spec).expanduser() / "config.json").read_text(encoding="utf-8"))
    for policy in policies:
        scorer = getattr(policy, "scorer", None)
        if isinstance(scorer, RetentionGate) and scorer.gates is None:
            check_shipped_for_config(config, scorer.pretrained, spec)
