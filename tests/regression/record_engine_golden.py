"""Record the golden data of ``tests/test_engine_regression.py`` with whatever kvsieve is importable.

Runs every case of :func:`engine_cases.build_cases` on the tiny model of every architecture
(``conftest.build_model``, float32, one thread, ``torch.no_grad``) and writes
``tests/data/engine_golden.safetensors`` (kept positions, head lengths, tokens, logits) and
``tests/data/engine_golden.json`` (the cases with their parameters, what was skipped because it raised,
and the versions). Cases that raise are left out and listed under ``skipped``.

Record against a frozen tree, e.g. the baseline worktree::

    PYTHONPATH=/work/baseline/src .venv/bin/python tests/regression/record_engine_golden.py

``--check`` replays every recorded case once more (teacher-forced, as the test does) and fails on any
difference, so nondeterminism is caught before the data is written.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import platform
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TESTS_DIR = Path(__file__).resolve().parent.parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

import safetensors  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from conftest import ARCHS, build_model  # noqa: E402  (also sets torch.set_num_threads(1))
from safetensors.torch import save_file  # noqa: E402

import kvsieve  # noqa: E402
from regression import engine_cases as ec  # noqa: E402


def _git_state(path: Path) -> dict[str, Any]:
    try:
        head = subprocess.run(
            ["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(path), "status", "--porcelain", "--", "."], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {"commit": head, "src_dirty": bool(dirty)}


class CutProbe:
    """Smallest relative score gap at the eviction cut of every compaction (diagnostic, best effort).

    Wraps the recorded tree's ``KVCache.compact(layer, step)`` (an internal of the engine being recorded;
    when it is missing nothing is measured) and, before each compaction, re-scores and compares, within
    every head that loses entries, the lowest kept score with the highest evicted one. A gap of 0 means
    equal scores straddle the cut: the kept set then depends on ``torch.topk``'s tie-breaking, and an
    engine whose scores differ by one ulp may keep other entries. (AdaKV's cross-head allocation is not
    covered.)
    """

    def __init__(self) -> None:
        self.original = getattr(kvsieve.KVCache, "compact", None)
        self.gap = math.inf

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        self.gap = math.inf
        if self.original is None:
            yield
            return
        original, probe = self.original, self

        def compact(cache: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                _, step = args
                scores = cache.policy.score(step)
                probe.update(scores, cache.policy.allocate(scores, step))
            except Exception:  # another engine's internals: measure nothing, change nothing
                probe.original = None
            return original(cache, *args, **kwargs)

        kvsieve.KVCache.compact = compact
        try:
            yield
        finally:
            kvsieve.KVCache.compact = original

    def update(self, scores: torch.Tensor, counts: torch.Tensor) -> None:
        flat = scores.detach().float().reshape(-1, scores.shape[-1]).sort(-1, descending=True).values
        for row, count in zip(flat, counts.reshape(-1).tolist(), strict=True):
            valid = int((row > -math.inf).sum())
            if not 0 < count < valid:
                continue
            kept, evicted = float(row[count - 1]), float(row[count])
            if kept == evicted:
                self.gap = 0.0
            elif math.isfinite(kept):
                self.gap = min(self.gap, (kept - evicted) / max(abs(kept), abs(evicted), 1e-30))

    def result(self) -> float | None:
        return None if self.original is None or math.isinf(self.gap) else self.gap


def _run(model: torch.nn.Module, case: dict[str, Any], **kwargs: Any) -> list[ec.Track]:
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ec.run_case(model, case, **kwargs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="replay every case once more and compare")
    parser.add_argument("--only", default=None, help="record only case ids containing this string (debugging)")
    parser.add_argument("--out-dir", type=Path, default=ec.DATA_DIR)
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    started = time.perf_counter()
    kvsieve_dir = Path(kvsieve.__file__).resolve().parent
    print(f"kvsieve from {kvsieve_dir}", flush=True)
    models = {arch: build_model(arch) for arch in ARCHS}
    cases = [c for c in ec.build_cases() if args.only is None or args.only in c["id"]]
    probe = CutProbe()

    recorded: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    entries: list[tuple[dict[str, Any], list[ec.Track]]] = []
    track_no = 0
    for case in cases:
        results: dict[str, list[ec.Track]] = {}
        errors: dict[str, str] = {}
        gaps: dict[str, float | None] = {}
        for arch in ARCHS:
            try:
                with probe.watch():
                    results[arch] = _run(models[arch], case)
                gaps[arch] = probe.result()
            except Exception as err:  # a case that raises in the recorded tree is left out
                errors[arch] = f"{type(err).__name__}: {err}"
        if errors:
            skipped.append({"id": case["id"], "members": case["members"], "archs": sorted(errors), "errors": errors})
        if not results:
            continue
        case = {**case, "tracks": {}, "cut_gap": {arch: gaps[arch] for arch in results}}
        for arch, tracks in results.items():
            case["tracks"][arch] = track_no
            track_no += len(tracks)
            entries.append((case, tracks))
        recorded.append(case)

    tensors = ec.pack_tracks(entries)
    meta_cases = {c["id"]: c for c in recorded}
    if args.check:
        # Replay from the packed data exactly as the test does (teacher-forced) and compare.
        meta = {"arch_shapes": _arch_shapes(models)}
        failures = 0
        for case in recorded:
            for arch in case["tracks"]:
                golden = ec.golden_tracks(meta, tensors, meta_cases[case["id"]], arch)
                got = _run(models[arch], case, forced_tokens=[g.tokens for g in golden])
                problems = ec.compare(case, golden, got)
                if problems:
                    failures += 1
                    print(f"CHECK FAILED {arch}/{case['id']}:\n  " + "\n  ".join(problems), flush=True)
        if failures:
            print(f"{failures} case(s) are not reproducible; nothing written", flush=True)
            return 1

    kinds = collections.Counter(c["kind"] for c in recorded)
    meta = {
        "format": ec.FORMAT,
        "description": "Golden kept positions / logits of tests/test_engine_regression.py; see tests/regression/.",
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "safetensors": safetensors.__version__,
            "python": platform.python_version(),
            "kvsieve": kvsieve.__version__,
            "kvsieve_path": str(kvsieve_dir),
            **{f"kvsieve_git_{k}": v for k, v in _git_state(kvsieve_dir).items()},
            "torch_threads": torch.get_num_threads(),
        },
        "settings": {
            "budget": ec.BUDGET,
            "window": ec.WINDOW,
            "block_size": ec.BLOCK,
            "ratio": ec.RATIO,
            "logits_atol": ec.LOGITS_ATOL,
            "logits_stored_at": "every multi-token forward and the last one (tokens, fingerprints: every forward)",
        },
        "archs": list(ARCHS),
        "arch_shapes": _arch_shapes(models),
        "counts": {
            "cases": len(recorded),
            "case_arch_pairs": sum(len(c["tracks"]) for c in recorded),
            "per_kind": dict(sorted(kinds.items())),
            "skipped": len(skipped),
            "ties_at_cut": sorted(
                f"{arch}/{c['id']}" for c in recorded for arch, gap in c["cut_gap"].items() if gap == 0.0
            ),
        },
        "skipped": skipped,
        "cases": recorded,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.out_dir / ec.JSON_PATH.name
    tensors_path = args.out_dir / ec.TENSORS_PATH.name
    save_file(tensors, str(tensors_path), metadata={"format": str(ec.FORMAT)})
    json_path.write_text(_dump(meta))
    elapsed = time.perf_counter() - started
    print(
        f"recorded {len(recorded)} cases ({meta['counts']['case_arch_pairs']} case×arch), skipped {len(skipped)}; "
        f"{tensors_path.stat().st_size / 1e6:.2f} MB + {json_path.stat().st_size / 1e6:.2f} MB in {elapsed:.1f} s",
        flush=True,
    )
    for kind, n in sorted(kinds.items()):
        print(f"  {kind}: {n}")
    ties = meta["counts"]["ties_at_cut"]
    print(f"  {len(ties)} case×arch with equal scores at an eviction cut (topk tie-breaking): {', '.join(ties)}")
    for s in skipped:
        print(f"  skipped {s['id']} on {','.join(s['archs'])}: {next(iter(s['errors'].values()))}")
    return 0


def _arch_shapes(models: dict[str, torch.nn.Module]) -> dict[str, dict[str, int]]:
    return {
        arch: {"layers": m.config.num_hidden_layers, "kv_heads": m.config.num_key_value_heads}
        for arch, m in models.items()
    }


def _dump(meta: dict[str, Any]) -> str:
    """JSON with one case per line (readable diffs, small file)."""
    head = {k: v for k, v in meta.items() if k not in ("cases", "skipped")}
    text = json.dumps(head, indent=1)[:-2]
    for key in ("skipped", "cases"):
        rows = ",\n  ".join(json.dumps(c, separators=(",", ":")) for c in meta[key])
        text += f',\n "{key}": [\n  {rows}\n ]'
    return text + "\n}\n"


if __name__ == "__main__":
    sys.exit(main())
