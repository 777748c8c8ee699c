"""``kvsieve train``: train retention gates (TrimKV / DBTrimKV) for a model on CPU or GPU.

Its own module with a ``register(subparsers)`` / ``run(args)`` pair, so ``cli.py`` only calls
:func:`register`. Example (the shipped gates were made this way, see ``docs/results/trimkv/``)::

    kvsieve train --variant dbtrimkv --budget 128 --steps 50 --output runs/dbtrimkv
"""

from __future__ import annotations

import argparse
import json

import torch

from kvsieve.train.trainer import VARIANTS, TrainConfig, train_gates


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lengths must be comma-separated ints; got {text!r}") from None


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``train`` sub-command to ``kvsieve``'s parser."""
    from kvsieve.models.arguments import add_model_arguments

    p = sub.add_parser("train", help="train retention gates (trimkv / dbtrimkv) on the frozen model")
    defaults = TrainConfig()
    add_model_arguments(p)
    p.add_argument("--variant", choices=tuple(VARIANTS), default=defaults.variant)
    p.add_argument("--budget", type=int, default=defaults.budget, help="M, entries per KV head (global: L·H·M)")
    p.add_argument("--capacity-weight", type=float, default=defaults.capacity_weight, help="λ")
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--bias-lr", type=float, default=defaults.bias_lr, help="learning rate of b_out")
    p.add_argument("--gate-hidden", type=int, default=defaults.gate_hidden)
    p.add_argument("--lengths", type=_ints, default=defaults.lengths, help="training lengths in tokens, e.g. 1024,2048")
    p.add_argument("--kl-tokens", type=int, default=defaults.kl_tokens, help="last positions scored by the KL")
    p.add_argument("--block-size", type=int, default=defaults.block_size)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--heldout", type=int, default=defaults.heldout, help="held-out samples")
    p.add_argument("--eval-every", type=int, default=defaults.eval_every)
    p.add_argument("--save-every", type=int, default=defaults.save_every)
    p.add_argument("--max-minutes", type=float, default=None, help="stop (and save) after this much training time")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--output", required=True, help="folder: checkpoint.* (resumable) and gates.{safetensors,json}")
    p.add_argument("--no-resume", action="store_true", help="start over even if a checkpoint exists")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvsieve.models.arguments import load_model_from_args

    config = TrainConfig(
        variant=args.variant, budget=args.budget, capacity_weight=args.capacity_weight, steps=args.steps,
        lr=args.lr, bias_lr=args.bias_lr, gate_hidden=args.gate_hidden, lengths=args.lengths, kl_tokens=args.kl_tokens,
        block_size=args.block_size, seed=args.seed, heldout=args.heldout, eval_every=args.eval_every,
        save_every=args.save_every, max_minutes=args.max_minutes,
    )
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model_from_args(args)
    result = train_gates(model, tokenizer, config, output_dir=args.output, resume=not args.no_resume,
                         progress=not args.no_progress)
    print(json.dumps({"steps": result.steps_done, "seconds": round(result.seconds, 1),
                      "heldout": result.heldout, "gates": f"{args.output}/gates.safetensors"}, indent=1))
    return 0
