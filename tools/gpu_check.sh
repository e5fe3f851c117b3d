#!/usr/bin/env bash
# The prepared GPU check (run on a machine with an NVIDIA GPU and jax[cuda] installed):
#   bash tools/gpu_check.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-.}}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
python3 tools/gpu_check.py --json "$out/gpu_check.json" 2>&1 | tee "$out/gpu_check.log"
