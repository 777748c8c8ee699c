#!/usr/bin/env bash
# The CUDA checks of issues 21 and 22, for a lent GPU machine (nothing depends on it; CI never runs it):
# the CUDA test module (tests/test_cuda.py: full == DynamicCache, CPU == CUDA kept positions, fused statistics, every preset
# generating on CUDA, host synchronisations per decoding step) and the mixed-precision decoding benchmark on
# the default model's architecture and on Llama-3.1-8B's, random weights (the weights cannot travel there), and the
# prefill cost of every scoring method vs snapkv with statistics fused and unfused (benchmarks/statistics_prefill.py).
# Issue 23: the speed of KeyDiff, Expected Attention, CAKE, KVzip (with its reconstruction) and DuoAttention vs snapkv
# (benchmarks/new_methods_speed.py). ONLY_NEW=1 runs the tests and that benchmark only. Issue 22: the engine's overhead
# against a DynamicCache on the device (benchmarks/engine_overhead.py --device cuda) and the packed vs grouped decoding
# query (benchmarks/packed_decoding.py), unless ONLY_NEW is set.
# Writes into ${OUT:-results/cuda}: test_cuda.log and one JSON per benchmark and model.
set -u
out=${OUT:-results/cuda}
mkdir -p "$out"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -s -rf tests/test_cuda.py > "$out/test_cuda.log" 2>&1
echo "tests rc=$?"
grep -E "SYNCS|passed|failed|FAILED|Error" "$out/test_cuda.log" | cut -c1-400
for model in random-smollm2 random-llama8b; do
  timeout "${BENCH_TIMEOUT:-200}" python3 benchmarks/new_methods_speed.py --device cuda --model "$model" \
    --output "$out/new_methods_speed_cuda_${model#random-}.json" 2>&1 | grep -E "PASS|FAIL|Error|error"
  if [ -n "${ONLY_NEW:-}" ]; then continue; fi
  if [ -z "${SKIP_QUANTIZE:-}" ]; then
    timeout "${BENCH_TIMEOUT:-200}" python3 benchmarks/quantize_decode.py --device cuda --model "$model" \
      --output "$out/quantize_decode_cuda_${model#random-}.json" 2>&1 | grep -E "ms/step|prefill T|PASS|FAIL|Error|error"
  fi
  timeout "${BENCH_TIMEOUT:-200}" python3 benchmarks/statistics_prefill.py --device cuda --model "$model" \
    --output "$out/statistics_prefill_cuda_${model#random-}.json" 2>&1 | grep -E "T=|over|Error|error"
  timeout "${BENCH_TIMEOUT:-200}" python3 benchmarks/engine_overhead.py --device cuda --model "$model" \
    --decode-policies snapkv,adakv,full,dbtrimkv,h2o,ems --policy-params '{"h2o": {"schedule": "decode"}}' \
    --output "$out/engine_overhead_cuda_${model#random-}.json" 2>&1 | grep -E "ms/step|PASS|FAIL|Error|error"
done
# session 22: decoding steps at new key lengths (what generation meets): cuDNN's plan builds, kvsieve without them
timeout "${BENCH_TIMEOUT:-200}" python3 benchmarks/cuda_plan_builds.py --steps 8 --output "$out/cuda_plan_builds.json" \
  2>&1 | grep -E "micro|decode b|prefill|Error"
if [ -z "${ONLY_NEW:-}" ]; then
  timeout 90 python3 benchmarks/packed_decoding.py --device cuda --repeats 3 --output "$out/packed_decoding_cuda.json" | tail -25
fi
# code unpacking on the GPU: lookup table (what the CPU prefers) vs shifts and masks, Llama-8B batch-8 tier shapes
python3 - <<'PY'
import time, torch
from kvsieve.ops.quantize import code_table, unpack, unpack_float
packed = torch.randint(0, 256, (8 * 8 * 10, 32, 32), dtype=torch.uint8, device="cuda")
table = code_table(2, packed.device)
def timed(fn):
    for _ in range(5): fn()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(50): fn()
    torch.cuda.synchronize(); return (time.perf_counter() - t) / 50 * 1e6
assert torch.equal(unpack_float(packed, table, 128), unpack(packed, 2, 128).float())
print(f"unpack 2-bit {tuple(packed.shape)}: lookup {timed(lambda: unpack_float(packed, table, 128)):.1f} us, "
      f"shifts {timed(lambda: unpack(packed, 2, 128).float()):.1f} us")
PY
