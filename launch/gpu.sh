#!/usr/bin/env bash
# One machine with NVIDIA GPUs: install maxlm with jax[cuda12], then train on every local GPU
# from one process with the XLA flags that matter for throughput. --dry-run prints the
# commands instead of running them.
#
#   launch/gpu.sh install [--dry-run]
#   launch/gpu.sh run CONFIG [key=value ...] [--dry-run]
#
# For several machines under SLURM use launch/slurm.sbatch.
set -euo pipefail

# Overlap collectives with compute, and combine small all-reduces/all-gathers into large ones.
GPU_XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true \
--xla_gpu_enable_highest_priority_async_stream=true \
--xla_gpu_all_reduce_combine_threshold_bytes=134217728 \
--xla_gpu_enable_pipelined_all_gather=true \
--xla_gpu_enable_while_loop_double_buffering=true"

usage() {
  sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
  exit "${1:-2}"
}

die() {
  echo "launch/gpu.sh: $*" >&2
  exit 2
}

verb="${1:-}"
[[ -n "$verb" ]] || usage
shift
dry_run=0
train_args=()
for a in "$@"; do
  case "$a" in
    --dry-run) dry_run=1 ;;
    -h|--help) usage 0 ;;
    --*) die "unknown option $a (see launch/gpu.sh --help)" ;;
    *) train_args+=("$a") ;;
  esac
done

run() {  # runs a command, or with --dry-run prints it as you would type it
  if [[ "$dry_run" == 1 ]]; then
    python3 -c 'import shlex, sys; print(shlex.join(sys.argv[1:]))' "$@"
  else
    "$@"
  fi
}

repo="$(cd "$(dirname "$0")/.." && pwd)"
case "$verb" in
  -h|--help) usage 0 ;;
  install)
    run python3 -m pip install -e "${repo}[cuda]"
    run python3 -c "import jax; assert jax.default_backend() == \"gpu\", jax.devices(); print(jax.devices())"
    ;;
  run)
    [[ ${#train_args[@]} -gt 0 ]] || die "run needs a CONFIG (and optional key=value overrides)"
    run env "XLA_FLAGS=${XLA_FLAGS:+$XLA_FLAGS }$GPU_XLA_FLAGS" \
      XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}" \
      maxlm train "${train_args[@]}"
    ;;
  *) die "unknown verb '$verb': expected install or run (see launch/gpu.sh --help)" ;;
esac
