"""``kvsieve calibrate-duo``: measure a DuoAttention head pattern for a model (:mod:`kvsieve.train.duo`).

Example (the pattern shipped for the default model was made this way, see ``docs/results/new_methods/``)::

    kvsieve calibrate-duo --lengths 1024,2048 --samples 2 --sinks 16 --recent 112 --output runs/duo.json
"""

from __future__ import annotations

import argparse
import sys

from kvsieve.train.cli import _ints
from kvsieve.train.duo import CALIBRATION_SEED


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``calibrate-duo`` sub-command to ``kvsieve``'s parser."""
    from kvsieve.models.arguments import add_model_arguments

    p = sub.add_parser("calibrate-duo", help="measure which KV heads need the whole context (DuoAttention pattern)")
    add_model_arguments(p)
    p.add_argument("--lengths", type=_ints, default=(1024, 2048), help="calibration prompt lengths, e.g. 1024,2048")
    p.add_argument("--samples", type=int, default=2, help="passkey prompts per length")
    p.add_argument("--sinks", type=int, default=16, help="sink entries of a streaming head")
    p.add_argument("--recent", type=int, default=112, help="recent entries of a streaming head")
    p.add_argument("--seed", type=int, default=CALIBRATION_SEED, help="first calibration seed (keep ≥ 10000)")
    p.add_argument("--group", type=int, default=16, help="caches filled per shared prefill")
    p.add_argument("--output", required=True, help="the pattern's JSON file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvsieve.models.arguments import load_model_from_args
    from kvsieve.train.duo import calibrate_head_pattern

    if args.samples < 1 or args.recent < 1 or args.sinks < 0 or args.group < 1 or not args.lengths:
        print("kvsieve calibrate-duo: --samples, --recent and --group must be ≥ 1, --sinks ≥ 0, --lengths non-empty",
              file=sys.stderr)
        return 2
    model, tokenizer = load_model_from_args(args)

    def report(done: int, total: int) -> None:
        print(f"calibration prompt {done}/{total}", file=sys.stderr)

    pattern = calibrate_head_pattern(model, tokenizer, args.lengths, args.samples, args.sinks, args.recent, args.seed,
                                     args.group, report)
    path = pattern.save(args.output)
    print(f"head pattern ({tuple(pattern.scores.shape)} layers × KV heads) written to {path}")
    return 0
