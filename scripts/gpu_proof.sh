#!/usr/bin/env bash
# The GPU proof in one command (docs/gpu_proof.md). On a bare GPU machine with no network:
#   bash scripts/gpu_proof.sh --out DIR          install the carried wheels (wheels/, pinned in
#                                                scripts/gpu_wheels.txt) and nothing else, then run
#                                                scripts/gpu_proof.py: CPU-only paths off on CUDA,
#                                                benchmarks.gpu, pytest -m cuda -> DIR/gpu_proof.*
#   bash scripts/gpu_proof.sh --smoke --out DIR  the same script on the CPU at a tiny shape, in the
#                                                current environment (CI: tests/test_gpu_proof.py)
#   bash scripts/gpu_proof.sh --skip-benchmark --out DIR   the checks only (a rerun after a fix)
#   bash scripts/gpu_proof.sh --fetch-wheels     here, with a package registry: download the
#                                                pinned wheels into wheels/ (Python 3.12, x86-64)
#                                                and print their size against the 64 MiB carry
# PYTHON names the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY=${PYTHON:-python3}
MODE=full
OUT=gpu_proof_out
FETCH=0
SKIP_BENCH=0
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) MODE=smoke ;;
    --fetch-wheels) FETCH=1 ;;
    --out) OUT=${2:?--out needs a folder}; shift ;;
    --skip-benchmark) SKIP_BENCH=1 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "gpu_proof.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

LIMIT=$((64 * 1024 * 1024)) # what travels with one device call: working tree + carried paths
repo_bytes() { # tracked and untracked-not-ignored files (what travels besides carried paths)
  if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git ls-files -z --cached --others --exclude-standard | "$PY" -c '
import os, sys
print(sum(os.path.getsize(p) for p in sys.stdin.read().split("\0") if p and os.path.isfile(p)))'
  else # a copy without .git: everything but the wheels
    du -sb --exclude=./wheels --exclude=./.git . | cut -f1
  fi
}
wheel_bytes() { find wheels -name '*.whl' -printf '%s\n' 2>/dev/null | awk '{s+=$1} END {print s+0}'; }
report_sizes() {
  local repo wheels
  repo=$(repo_bytes)
  wheels=$(wheel_bytes)
  echo "gpu_proof.sh: wheels/ $wheels bytes ($((wheels / 1048576)) MiB); repository $repo bytes" \
    "($((repo / 1048576)) MiB); together $(((repo + wheels) / 1048576)) MiB of the 64 MiB carry" \
    "(budget for wheels: $(((LIMIT - repo) / 1048576)) MiB)"
  [ $((repo + wheels)) -le $LIMIT ]
}

if [ "$FETCH" = 1 ]; then
  mkdir -p wheels
  platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
  download() {
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp "${platforms[@]}" -d wheels "$@"
  }
  # the required wheels: every line of the list without '# optional'
  grep -v '^\s*#' scripts/gpu_wheels.txt | grep -v '# optional' | sed 's/#.*//' | grep -v '^\s*$' \
    >/tmp/gpu_wheels_required.txt
  download -r /tmp/gpu_wheels_required.txt
  # optional wheels (bitsandbytes: QLoRA): kept only while the carry still fits
  grep '# optional' scripts/gpu_wheels.txt | sed 's/#.*//' | while read -r pin; do
    before=$(ls wheels)
    download "$pin"
    if ! report_sizes >/dev/null; then
      for f in wheels/*.whl; do
        echo "$before" | grep -qx "$(basename "$f")" || { rm -f "$f"; echo "gpu_proof.sh: $pin does not fit the carry; left out"; }
      done
    fi
  done
  report_sizes || { echo "gpu_proof.sh: over the 64 MiB carry" >&2; exit 1; }
  exit 0
fi

SITE=/tmp/rlhf_lab_gpu_site
if [ "$MODE" = full ]; then
  if ls wheels/*.whl >/dev/null 2>&1; then
    report_sizes || echo "gpu_proof.sh: warning: over the 64 MiB carry" >&2
    rm -rf "$SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" wheels/*.whl
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  elif ! "$PY" -c 'import pydantic, datasets' 2>/dev/null; then
    echo "gpu_proof.sh: no wheels/ here and pydantic/datasets are missing: run" \
      "'bash scripts/gpu_proof.sh --fetch-wheels' on a machine with a package registry and" \
      "carry wheels/ (docs/gpu_proof.md)" >&2
    exit 2
  fi
else
  report_sizes || true # smoke: the current environment has the packages; sizes for the record
fi
export PYTHONPATH="$REPO/src:$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
args=(--out "$OUT")
[ "$MODE" = smoke ] && args+=(--smoke)
[ "$SKIP_BENCH" = 1 ] && args+=(--skip-benchmark)
exec "$PY" scripts/gpu_proof.py "${args[@]}"
