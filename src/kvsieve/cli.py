"""The ``kvsieve`` command line: ``list``, ``niah``, ``eval``, ``plot``, ``bench``, ``generate``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvsieve.models.arguments import add_model_arguments
from kvsieve.models.loading import MissingExtraError
from kvsieve.policies.presets import UnknownPolicyError, list_policies


def _csv(kind: type, name: str):  # type: ignore[no-untyped-def]
    def parse(text: str) -> list:
        try:
            return [kind(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}: expected a comma-separated list of {kind.__name__}") from None

    return parse


def _cmd_list(_: argparse.Namespace) -> int:
    from dataclasses import MISSING, fields

    from kvsieve.core.part import PART_KINDS
    from kvsieve.policies.catalog import parts
    from kvsieve.policies.presets import make_policy

    print("Presets (a named method = parts; any parameter below can be passed to KVCache(model, name, ...)):")
    for name, entry in list_policies().items():
        try:
            example = make_policy(name, budget=64) if entry.needs_budget else make_policy(name)
        except ValueError:
            example = None
        described = [f"{kind}={part}" for kind, part in entry.parts().items() if part is not None]
        described += [f"{alias}: another {kind}" for alias, kind in entry.aliases.items()]
        kind = getattr(entry.action, "effect", "evicts") if entry.deletes else "keeps all entries"
        schedules = ", ".join(example.schedules()) if example is not None else "prefill, decode, blockwise"
        print(f"  {name:<16} {entry.summary}")
        print(f"  {'':<16} [{kind}; {'; '.join(described) or 'no parts'}; schedules: {schedules}]")
        print(f"  {'':<16} parameters: {', '.join(entry.parameters())}")
    print("\nParts (combine freely: KVCache(model, 'restkv', budget=256, allocator='adaptive'), or pass objects):")
    for kind in PART_KINDS:
        print(f"  {kind}s:")
        for name, cls in parts(kind).items():
            params = []
            for f in fields(cls):
                default = f.default if f.default is not MISSING else "required"
                params.append(f"{f.name}={default!r}")
            doc = (cls.__doc__ or "").strip().splitlines()
            print(f"    {name:<14} {cls.__name__}({', '.join(params)})  {doc[0] if doc else ''}")
    return 0


def _cmd_niah(args: argparse.Namespace) -> int:
    from kvsieve.eval.niah_cli import run_niah_command

    return run_niah_command(args)


def _cmd_eval(args: argparse.Namespace) -> int:
    from kvsieve.eval.commands import run_eval_command

    return run_eval_command(args)


def _cmd_plot(args: argparse.Namespace) -> int:
    from kvsieve.eval.commands import run_plot_command

    return run_plot_command(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    from kvsieve.bench.commands import run_bench_command

    return run_bench_command(args)


def _add_suite_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from kvsieve.bench.commands import add_bench_arguments
    from kvsieve.eval.commands import add_eval_arguments, add_plot_arguments

    ev = sub.add_parser("eval", help="sweep policies × budgets × tasks × lengths × samples (resumable)")
    add_eval_arguments(ev)
    ev.set_defaults(func=_cmd_eval)
    plot = sub.add_parser("plot", help="figures from a sweep's records.jsonl")
    add_plot_arguments(plot)
    plot.set_defaults(func=_cmd_plot)
    bench = sub.add_parser("bench", help="throughput, latency, prefill, memory: full vs compressed caches")
    add_bench_arguments(bench)
    bench.set_defaults(func=_cmd_bench)


def _cmd_generate(args: argparse.Namespace) -> int:
    from kvsieve.generation.cli import run_generate_command

    return run_generate_command(args)


def _add_generate_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from kvsieve.generation.cli import add_generate_arguments

    generate = sub.add_parser("generate", help="answer questions about your document with a compressed cache "
                                               "(--compare several caches side by side)")
    add_generate_arguments(generate)
    generate.set_defaults(func=_cmd_generate)


def _version() -> str:
    from kvsieve import __version__

    return f"kvsieve {__version__}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvsieve", description="KV-cache compression for transformers")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="print the registered policies with their parameters").set_defaults(func=_cmd_list)

    niah = sub.add_parser("niah", help="passkey retrieval in Paul Graham essays at 4k tokens: the full cache vs "
                                       "the strongest methods at two budgets — accuracy, memory held and decoding "
                                       "speed (table + plot, ~5 min on 2 cores)")
    niah.add_argument("--policies", type=_csv(str, "--policies"),
                      default=["streaming_llm", "snapkv", "restkv", "ada_restkv", "rocketkv", "dbtrimkv"],
                      help="policies to compare, parameters after colons (the full cache always runs as reference)")
    niah.add_argument("--budgets", type=_csv(int, "--budgets"), default=[128, 512],
                      help="entries per KV head")
    niah.add_argument("--lengths", type=_csv(int, "--lengths"), default=[4096])
    niah.add_argument("--depths", type=_csv(float, "--depths"), default=[0.1, 0.5, 0.9])
    niah.add_argument("--seeds", type=_csv(int, "--seeds"), default=[0, 1])
    add_model_arguments(niah)
    niah.add_argument("--max-new-tokens", type=int, default=8)
    niah.add_argument("--output", default="results/niah.json", help="JSON result file")
    niah.add_argument("--no-progress", action="store_true")
    niah.add_argument("--no-plot", action="store_true", help="do not draw the figure")
    niah.set_defaults(func=_cmd_niah)
    _add_suite_commands(sub)
    from kvsieve.train import cli as train_cli
    from kvsieve.train import duo_cli

    train_cli.register(sub)
    duo_cli.register(sub)
    from kvsieve.tune import cli as tune_cli

    tune_cli.register(sub)
    _add_generate_command(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (UnknownPolicyError, ValueError, FileNotFoundError, MissingExtraError) as err:
        print(f"kvsieve: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
