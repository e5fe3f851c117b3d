#!/usr/bin/env bash
# The prepared MoE check for a lent GPU or TPU (tools/gpu_moe_check.py says what it measures):
#   bash tools/gpu_moe_check.sh [OUT_DIR] [--dry-run]     (~2 minutes on one H200; JSON in OUT_DIR)
# the grouped matmul (ragged_dot_tiles; megablox on TPU) against a dense per-expert loop, forward +
# backward, and the expert-parallel all-to-all dispatch over every device.
# --dry-run (or DRY_RUN=1): tiny sizes in f32 on 8 fake CPU devices (what the tests run).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-.}
dry=${DRY_RUN:-0}
for arg in "$@"; do
  case $arg in
    --dry-run) dry=1 ;;
    *) out=$arg ;;
  esac
done
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
flags=()
if [ "$dry" = 1 ]; then
  export JAX_PLATFORMS=cpu XLA_FLAGS="--xla_force_host_platform_device_count=8"
  flags=(--dry-run)
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
  export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
fi
timeout 400 python3 tools/gpu_moe_check.py --json "$out/gpu_moe.json" "${flags[@]}" \
  > "$out/gpu_moe.log" 2>&1
status=$?
tail -c 3000 "$out/gpu_moe.json" 2>/dev/null || tail -20 "$out/gpu_moe.log"
exit $status
