#!/usr/bin/env bash
# Cloud TPU VMs, single host or multi-host: create, set up, run maxlm train on every worker,
# collect logs, ssh, delete. Every command is a `gcloud compute tpus ...` line; --dry-run
# prints them instead of running them.
#
#   launch/tpu.sh create --name N --zone Z [--accelerator v5litepod-8] [--version V]
#                        [--spot] [--queued] [--project P]
#   launch/tpu.sh setup  --name N --zone Z           # this checkout + jax[tpu] on every worker
#   launch/tpu.sh run    --name N --zone Z --run-dir gs://BUCKET/RUN CONFIG [key=value ...]
#   launch/tpu.sh logs   --name N --zone Z [--out DIR]
#   launch/tpu.sh ssh    --name N --zone Z [--worker W]
#   launch/tpu.sh delete --name N --zone Z [--queued]
#
# `run` starts the same `maxlm train` on all workers (--worker=all) with distributed=true, so
# jax.distributed.initialize() joins them, detached from the ssh session (`logs` fetches the
# output); run_dir must be gs:// so every worker and every restart sees the same checkpoints.
# After a preemption: delete, create, setup, and `run` again resumes.
set -euo pipefail

usage() {
  sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
  exit "${1:-2}"
}

die() {
  echo "launch/tpu.sh: $*" >&2
  exit 2
}

verb="${1:-}"
[[ -n "$verb" ]] || usage
shift
name="${MAXLM_TPU_NAME:-}"
zone="${MAXLM_TPU_ZONE:-}"
project="${MAXLM_TPU_PROJECT:-}"
accelerator="v5litepod-8"
version="v2-alpha-tpuv5-lite"
spot=0
queued=0
dry_run=0
worker=0
run_dir=""
out="tpu-logs"
train_args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) name="$2"; shift 2 ;;
    --zone) zone="$2"; shift 2 ;;
    --project) project="$2"; shift 2 ;;
    --accelerator) accelerator="$2"; shift 2 ;;
    --version) version="$2"; shift 2 ;;
    --spot) spot=1; shift ;;
    --queued) queued=1; shift ;;
    --worker) worker="$2"; shift 2 ;;
    --run-dir) run_dir="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage 0 ;;
    --*) die "unknown option $1 (see launch/tpu.sh --help)" ;;
    *) train_args+=("$1"); shift ;;
  esac
done

case "$verb" in create|setup|run|logs|ssh|delete) ;; -h|--help) usage 0 ;;
  *) die "unknown verb '$verb': expected create, setup, run, logs, ssh or delete" ;;
esac
[[ -n "$name" ]] || die "--name is required (or set MAXLM_TPU_NAME)"
[[ -n "$zone" ]] || die "--zone is required (or set MAXLM_TPU_ZONE)"

common=(--zone "$zone")
[[ -z "$project" ]] || common+=(--project "$project")

# Runs a command, or with --dry-run prints it shell-quoted.
run() {
  if [[ "$dry_run" == 1 ]]; then
    printf '%q ' "$@" | sed 's/ $//'
    echo
  else
    "$@"
  fi
}

on_workers() {  # on_workers WORKER COMMAND: one remote shell command on the given worker(s)
  run gcloud compute tpus tpu-vm ssh "$name" "${common[@]}" --worker="$1" --command "$2"
}

repo="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck disable=SC2016  # expands on the worker, not here
venv='$HOME/maxlm-venv'

case "$verb" in
  create)
    spot_flag=()
    [[ "$spot" == 0 ]] || spot_flag=(--spot)
    if [[ "$queued" == 1 ]]; then
      run gcloud compute tpus queued-resources create "$name" "${common[@]}" --node-id "$name" \
        --accelerator-type "$accelerator" --runtime-version "$version" "${spot_flag[@]}"
      run gcloud compute tpus queued-resources describe "$name" "${common[@]}" \
        --format='value(state.state)'
    else
      run gcloud compute tpus tpu-vm create "$name" "${common[@]}" \
        --accelerator-type "$accelerator" --version "$version" "${spot_flag[@]}"
    fi
    ;;
  setup)
    tarball="${TMPDIR:-/tmp}/maxlm-src.tar.gz"
    run tar -czf "$tarball" -C "$repo" --exclude=.git --exclude=runs --exclude='*.egg-info' \
      --exclude=.venv --exclude=venv --exclude=__pycache__ .
    run gcloud compute tpus tpu-vm scp "$tarball" "$name:maxlm-src.tar.gz" "${common[@]}" \
      --worker=all
    apt="sudo apt-get -o DPkg::Lock::Timeout=600"  # fresh VMs run unattended-upgrades first
    on_workers all "set -e; $apt update -qq; $apt install -y -qq python3.11 \
python3.11-venv; python3.11 -m venv $venv; mkdir -p \$HOME/maxlm; \
tar -xzf \$HOME/maxlm-src.tar.gz -C \$HOME/maxlm; $venv/bin/pip install -q -U pip; \
$venv/bin/pip install -q -e \"\$HOME/maxlm[tpu]\"; $venv/bin/python -c 'import jax; print(jax.devices())'"
    ;;
  run)
    [[ ${#train_args[@]} -gt 0 ]] || die "run needs a CONFIG (and optional key=value overrides)"
    [[ "$run_dir" == gs://* ]] || die "run needs --run-dir gs://BUCKET/PATH: every worker and \
every restart must see the same checkpoints"
    args=""
    for a in "${train_args[@]}"; do args+=" $(printf '%q' "$a")"; done
    # detached, so a dropped ssh session does not stop training; `logs` collects the output
    on_workers all "cd \$HOME/maxlm && mkdir -p \$HOME/maxlm-logs && nohup setsid \
$venv/bin/maxlm train$args run_dir=$(printf %q "$run_dir") distributed=true \
>> \$HOME/maxlm-logs/train-\$(hostname).log 2>&1 < /dev/null & echo started on \$(hostname)"
    ;;
  logs)
    run mkdir -p "$out"
    run gcloud compute tpus tpu-vm scp "$name:maxlm-logs/*" "$out/" "${common[@]}" --worker=all
    ;;
  ssh)
    run gcloud compute tpus tpu-vm ssh "$name" "${common[@]}" --worker="$worker"
    ;;
  delete)
    if [[ "$queued" == 1 ]]; then
      run gcloud compute tpus queued-resources delete "$name" "${common[@]}" --force --quiet
    else
      run gcloud compute tpus tpu-vm delete "$name" "${common[@]}" --quiet
    fi
    ;;
esac
