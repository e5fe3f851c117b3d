#!/usr/bin/env bash
# The prepared GPU training check (one NVIDIA GPU with jax[cuda]): bash tools/gpu_train_check.sh
#  1. a ~1B model at L=4096 for 30 steps, MFU against the device's
#     bf16 peak from maxlm/parallel/peaks.py (H200: 989.4 TFLOP/s dense);
#  2. a small model at the 1M-token stage (128 documents of 8192 per row) for a few steps.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-.}}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
export XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 330 python3 tools/bench_train.py --json --seq-len 4096 --batch 8 --steps 30 \
  --vocab 128256 model.size=1b model.dtype=bfloat16 model.remat=dots_no_batch \
  model.loss_chunk=4096 stages.0.attention=gpu stages.0.block_q=128 2>&1 | tee "$out/train_1b_4k.log" | tail -3
timeout 200 python3 tools/bench_train.py --json --seq-len 1048576 --batch 1 --steps 3 \
  --docs 128 --vocab 32000 model.size=tiny model.d_model=512 model.n_heads=8 \
  model.n_kv_heads=4 model.head_dim=64 model.d_ff=1536 model.n_layers=4 model.dtype=bfloat16 \
  model.remat=full model.loss_chunk=8192 stages.0.attention=blockwise stages.0.block_q=1024 \
  stages.0.block_k=1024 2>&1 | tee "$out/train_small_1m.log" | tail -3
