#!/usr/bin/env bash
# Re-create requirements/constraints.txt: the versions a fresh, unlocked `scripts/setup.sh` resolves today.
# Review the diff, run the suite and the matrix (scripts/compat_matrix.sh), then commit it.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
KVSIEVE_VENV="$tmp/venv" KVSIEVE_CONSTRAINTS="" bash scripts/setup.sh
{
  echo "# The locked set scripts/setup.sh installs (pip install -c): regenerate with scripts/lock.sh."
  echo "# torch is pinned without its local build suffix (2.13.0 matches the CPU wheel 2.13.0+cpu)."
  "$tmp/venv/bin/python" -m pip freeze --all --exclude-editable \
    | grep -viE '^(kvsieve|setuptools|wheel)(==| @)' \
    | sed -E 's/^(torch==[^+]+)\+.*$/\1/'
} > requirements/constraints.txt
echo "wrote requirements/constraints.txt ($(grep -vc '^#' requirements/constraints.txt) pins)"
