#!/usr/bin/env bash
# The prepared GPU check for the segment-skipping kernels (one NVIDIA GPU with jax[cuda]):
#   bash tools/gpu_kernels_check.sh [OUT_DIR]      (~8 minutes on one H200; JSON in OUT_DIR)
# Parts: 1 correctness, 2 attention 4K/16K/64K x 1/32 documents (new gpu vs gpu_mha vs
# blockwise), 3 the 1b model at 4K (MFU, tokens/s), 4 the 1M-token stage of a small model,
# 5 the train loop with and without its one-step lookahead.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-.}}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
nvcc --version 2>/dev/null | tail -1 || true
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
export XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true"
timeout 220 python3 tools/gpu_kernels_check.py --parts 1,2 --json "$out/gpu_kernels.json" \
  2>&1 | tee "$out/gpu_kernels.log" | tail -2
timeout 140 python3 tools/gpu_kernels_check.py --parts 3 --json "$out/gpu_train_1b.json" \
  2>&1 | tee "$out/gpu_train_1b.log" | tail -2
timeout 90 python3 tools/gpu_kernels_check.py --parts 4 --json "$out/gpu_train_1m.json" \
  2>&1 | tee "$out/gpu_train_1m.log" | tail -2
timeout 80 python3 tools/gpu_kernels_check.py --parts 5 --json "$out/gpu_step_overlap.json" \
  2>&1 | tee "$out/gpu_step_overlap.log" | tail -2
