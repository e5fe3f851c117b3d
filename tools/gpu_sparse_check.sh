#!/usr/bin/env bash
# The prepared GPU comparison for sparse attention (issue: dense -> indexer -> sparse), one
# NVIDIA GPU with jax[cuda]:
#   bash tools/gpu_sparse_check.sh [OUT_DIR]     (~4 minutes on one H200; JSON in OUT_DIR)
# tools/bench_sparse.py in bf16 at 16K/64K/131K: block-sparse attention (the training path)
# against dense attention by our Triton kernel (`gpu`) and by jax's (`gpu_mha`), forward +
# backward, fastest of 3, with the device's peak memory of the sparse case.
# DRY_RUN=1 runs the same commands on the CPU at L = 512 (what the tests exercise).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-.}}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ "${DRY_RUN:-0}" = 1 ]; then
  lengths="512" impls="blockwise" dtype=float32 repeats=1
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
  lengths="16384 65536 131072" impls="gpu gpu_mha" dtype=bfloat16 repeats=3
fi
status=0
for impl in $impls; do
  # shellcheck disable=SC2086
  timeout 150 python3 tools/bench_sparse.py --json --dtype "$dtype" --dense-impl "$impl" \
    --repeats "$repeats" --token-max 0 --lengths $lengths > "$out/sparse_vs_$impl.json" \
    2> "$out/sparse_vs_$impl.log" || status=$?
  tail -c 2000 "$out/sparse_vs_$impl.json"
done
exit $status
