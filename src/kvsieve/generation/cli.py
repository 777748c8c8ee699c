"""``kvsieve generate``: a policy (or several, ``--compare``) on your own document and question.

    kvsieve generate --model M --policy snapkv --budget 256 --context doc.txt "question"

streams the answer, then prints what the compressed cache holds against the full cache (entries and
MiB), the prefill time and the decoding speed. ``--compare full,snapkv,restkv`` answers with each cache
in turn from the same context and ends with a side-by-side table; ``full`` is plain transformers'
``DynamicCache`` (labelled so), and each row's decoding speed is also given over it (``× full``). Several
questions are each asked from the same compressed context (compressed once per cache).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path
from typing import Any

from kvsieve.generation.saved_context import FULL
from kvsieve.models.arguments import add_model_arguments

#: How the uncompressed cache is labelled: plain transformers, the reference every speed is read against.
FULL_LABEL = "full (DynamicCache)"


def _policies(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``kvsieve generate``."""
    parser.add_argument("question", nargs="+", help="one or more questions about the context")
    parser.add_argument("--context", required=True, help="text file holding the document ('-': standard input)")
    parser.add_argument("--policy", default="snapkv",
                        help="cache policy, parameters after colons (snapkv:window=16); 'full' = no compression")
    parser.add_argument("--budget", type=int, default=256, help="entries kept per KV head (default 256)")
    parser.add_argument("--compare", type=_policies,
                        help="comma-separated caches to run side by side instead of --policy, e.g. full,snapkv,restkv")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                        help="use the tokenizer's chat template (default: when it has one)")
    add_model_arguments(parser)


def _read_context(source: str) -> str:
    if source == "-":
        return sys.stdin.read()
    path = Path(source).expanduser()
    if not path.is_file():
        raise ValueError(f"--context: no such file: {source}")
    return path.read_text(encoding="utf-8", errors="replace")


def _check(args: argparse.Namespace) -> list[tuple[str, str, dict[str, Any]]]:
    """Every setting checked before the model loads; returns (label, policy name, params) per cache."""
    from kvsieve.models.arguments import check_model_args
    from kvsieve.policies.model_check import check_policies_for_model
    from kvsieve.policies.presets import make_policy
    from kvsieve.policies.spec import parse_policy_spec

    if args.budget < 1:
        raise ValueError(f"--budget: must be ≥ 1 entry per KV head; got {args.budget}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens: must be ≥ 1; got {args.max_new_tokens}")
    if args.compare is not None and not args.compare:
        raise ValueError("--compare: no policy given; pass e.g. full,snapkv,restkv (or drop --compare)")
    specs = args.compare or [args.policy]
    repeated = sorted({spec for spec in specs if specs.count(spec) > 1})
    if repeated:
        raise ValueError(f"--compare: {', '.join(repeated)} given more than once")
    empty = [i for i, question in enumerate(args.question, start=1) if not question.strip()]
    if empty:
        raise ValueError(f"question: question {empty[0]} is empty; ask something about the context")
    flag = "--compare" if args.compare else "--policy"
    caches, policies = [], []
    for spec in specs:
        name, params = parse_policy_spec(spec, flag)
        if name != FULL:  # raises on unknown names and bad parameters
            policies.append(make_policy(name, budget=args.budget, **params))
        label = FULL_LABEL if name == FULL else f"{spec}@{args.budget}"
        caches.append((label, name, params))
    check_model_args(args)
    check_policies_for_model(args, policies)
    return caches


def _summary_line(label: str, stats: Any, answers: list[Any]) -> str:
    speeds = [a.tokens_per_s for a in answers if a.tokens_per_s == a.tokens_per_s]
    speed = f"{sum(speeds) / len(speeds):.1f} tok/s" if speeds else "n/a"
    return (f"[{label}] context {stats.context_tokens} tokens | entries held {stats.entries_held:,} of "
            f"{stats.entries_full:,} ({100 * stats.entries_held / stats.entries_full:.1f}%) | KV "
            f"{stats.kv_mib:.2f} MiB of {stats.kv_bytes_full / 2**20:.2f} MiB ({100 * stats.kv_fraction:.1f}%) | "
            f"prefill {stats.prefill_s:.2f} s | question {answers[0].question_s:.2f} s | decoding {speed}")


def _table(rows: list[tuple[str, Any, list[Any]]], width: int = 60) -> str:
    """Side by side; with the full cache among the rows, each row's decoding speed over plain transformers'."""
    reference = next((answers for label, _, answers in rows if label == FULL_LABEL), None)
    head = (f"{'cache':<22} {'entries':>9} {'KV MiB':>8} {'% full':>7} {'prefill s':>9} {'tok/s':>7} "
            f"{'× full':>6}  answer")
    lines = [head, "-" * len(head)]
    for label, stats, answers in rows:
        for i, answer in enumerate(answers):
            text = textwrap.shorten(answer.text.replace("\n", " "), width=width, placeholder="…") or "(empty)"
            ratio = ""
            if reference is not None and i < len(reference) and reference[i].tokens_per_s > 0:
                ratio = f"{answer.tokens_per_s / reference[i].tokens_per_s:.2f}"
            if i == 0:
                lines.append(f"{label[:22]:<22} {stats.entries_held:>9,} {stats.kv_mib:>8.2f} "
                             f"{100 * stats.kv_fraction:>6.1f}% {stats.prefill_s:>9.2f} {answer.tokens_per_s:>7.1f} "
                             f"{ratio:>6}  {text}")
            else:
                lines.append(f"{'':<22} {'':>9} {'':>8} {'':>7} {'':>9} {answer.tokens_per_s:>7.1f} {ratio:>6}  {text}")
    return "\n".join(lines)


def run_generate_command(args: argparse.Namespace) -> int:
    """Check, load, compress the context once per cache, answer every question, report."""
    caches = _check(args)
    context = _read_context(args.context)
    if not context.strip():
        raise ValueError("--context: the document is empty")

    from transformers import TextStreamer

    from kvsieve.generation.context import compress_context
    from kvsieve.models.arguments import load_model_from_args

    model, tokenizer = load_model_from_args(args)
    rows = []
    for label, name, params in caches:
        ctx = compress_context(model, tokenizer, context, name, None if name == FULL else args.budget,
                               chat=args.chat, **params)
        answers = []
        for question in args.question:
            print(f"\n=== {label} | {question}", flush=True)
            streamer = TextStreamer(tokenizer, skip_special_tokens=True)
            answers.append(ctx.ask(question, max_new_tokens=args.max_new_tokens, streamer=streamer))
        print(_summary_line(label, ctx.stats, answers), flush=True)
        rows.append((label, ctx.stats, answers))
        del ctx
    if len(rows) > 1:
        print()
        print(_table(rows))
    return 0
