"""One decoding query's attention: transformers' grouped-query SDPA call vs the packed call kvsieve makes.

transformers attends a single decoding query without a mask through ``scaled_dot_product_attention(...,
enable_gqa=True)``; kvsieve's ``packed_decoding_output`` (``src/kvsieve/engine/attention_output.py``) puts each KV
head's query heads in the rows of one call instead. The engine packs on a CPU in half precision, where the grouped
kernel was measured 4–7× slower; this benchmark measures both calls per (device, dtype, length, batch) so the
choice can be checked where it is not made (float32, accelerators). Layer shapes: SmolLM2-135M (9 query / 3 KV
heads of 64) and Llama-3.1-8B (32 / 8 of 128). Writes ``benchmarks/results/packed_decoding[_<device>].json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quantize_decode import device_info

from kvsieve.engine.attention_output import packed_decoding_output

SHAPES = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}
RESULTS = Path(__file__).resolve().parent / "results"


def _timed(fn: Callable[[], torch.Tensor], device: torch.device, repeats: int) -> float:
    """Median seconds per call over ``repeats`` timed blocks of 20 calls (after 5 warm calls)."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(5):
        fn()
    samples = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(20):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / 20)
    return statistics.median(samples)


def measure(shape: str, length: int, batch: int, dtype: torch.dtype, device: torch.device, repeats: int
            ) -> dict[str, Any]:
    q_heads, kv_heads, dim = SHAPES[shape]
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(batch, q_heads, 1, dim, generator=generator).to(device, dtype)
    keys = torch.randn(batch, kv_heads, length, dim, generator=generator).to(device, dtype)
    values = torch.randn(batch, kv_heads, length, dim, generator=generator).to(device, dtype)
    scaling = dim ** -0.5
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def grouped() -> torch.Tensor:
        return sdpa(query, keys, values, scale=scaling, enable_gqa=True)

    def packed() -> torch.Tensor:
        return packed_decoding_output(query, keys, values, scaling)

    reference = grouped().transpose(1, 2).float()
    difference = float((packed().float() - reference).abs().max())
    grouped_s, packed_s = _timed(grouped, device, repeats), _timed(packed, device, repeats)
    return {"shape": shape, "length": length, "batch": batch, "grouped_us": grouped_s * 1e6,
            "packed_us": packed_s * 1e6, "grouped_over_packed": grouped_s / packed_s, "max_abs_difference": difference}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--lengths", default="128,1024,4096")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for shape in SHAPES:
            for length in (int(n) for n in args.lengths.split(",")):
                for batch in (int(b) for b in args.batches.split(",")):
                    row = {"dtype": dtype_name, **measure(shape, length, batch, dtype, device, args.repeats)}
                    print(f"{dtype_name} {shape} L={length} b{batch}: grouped {row['grouped_us']:.1f} us, "
                          f"packed {row['packed_us']:.1f} us, ratio {row['grouped_over_packed']:.2f}", flush=True)
                    rows.append(row)
    suffix = "" if device.type == "cpu" else f"_{device.type}"
    output = args.output or RESULTS / f"packed_decoding{suffix}.json"
    record = {"benchmark": "packed_decoding", "device": device_info(device), "threads": torch.get_num_threads(),
              "torch": torch.__version__, "repeats": args.repeats, "rows": rows}
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
