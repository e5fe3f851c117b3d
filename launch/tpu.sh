#!/usr/bin/env bash
# Cloud TPU VMs, single host or a pod slice: create, set up, run maxlm train on every worker,
# watch, stop, collect logs, ssh, delete. Every command is a `gcloud compute tpus ...` line;
# --dry-run prints them instead of running them.
#
#   launch/tpu.sh create --name N --zone Z [--accelerator v5litepod-8] [--version V]
#                        [--spot] [--queued [--no-wait]] [--project P]
#   launch/tpu.sh setup  --name N --zone Z           # this checkout + jax[tpu] on every worker
#   launch/tpu.sh run    --name N --zone Z --run-dir gs://BUCKET/RUN [--accelerator A]
#                        [--upload-data] CONFIG [key=value ...]
#   launch/tpu.sh status --name N --zone Z [--queued]   # the VM's state, each worker's last line
#   launch/tpu.sh stop   --name N --zone Z           # SIGTERM: all save one agreed step, exit 0
#   launch/tpu.sh logs   --name N --zone Z [--out DIR]
#   launch/tpu.sh ssh    --name N --zone Z [--worker W]
#   launch/tpu.sh delete --name N --zone Z [--queued]
#
# The runtime image follows the accelerator (v4, v5e, v5p, v6e) unless --version names one.
# `create --queued` waits until the queued resource is ACTIVE, printing its state. `run` ships
# the config to every worker, starts the same `maxlm train` on all of them (distributed=true)
# detached from the ssh session, and needs a gs:// run_dir; a multi-host slice also needs a
# gs:// data.dir (or --upload-data, which copies a local data dir to every worker). Rerunning
# `run` resumes from the run_dir's latest checkpoint; for recovery from preemption without
# you, see launch/skypilot.yaml.
set -euo pipefail

usage() {
  sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'
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
accelerator="${MAXLM_TPU_ACCELERATOR:-v5litepod-8}"
version=""
spot=0
queued=0
wait=1
dry_run=0
upload_data=0
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
    --no-wait) wait=0; shift ;;
    --upload-data) upload_data=1; shift ;;
    --worker) worker="$2"; shift 2 ;;
    --run-dir) run_dir="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage 0 ;;
    --*) die "unknown option $1 (see launch/tpu.sh --help)" ;;
    *) train_args+=("$1"); shift ;;
  esac
done

case "$verb" in create|setup|run|status|stop|logs|ssh|delete) ;; -h|--help) usage 0 ;;
  *) die "unknown verb '$verb': expected create, setup, run, status, stop, logs, ssh or delete" ;;
esac
[[ -n "$name" ]] || die "--name is required (or set MAXLM_TPU_NAME)"
[[ -n "$zone" ]] || die "--zone is required (or set MAXLM_TPU_ZONE)"

# The runtime image per TPU generation (cloud.google.com/tpu/docs/runtimes) and the number of
# hosts of a slice: v4 and v5p count TensorCores (2 per chip, 4 chips a host); v5e and v6e
# count chips (one host up to 8, then 4 chips a host).
runtime_for() {
  case "$1" in
    v4-*) echo "tpu-ubuntu2204-base" ;;
    v5p-*) echo "v2-alpha-tpuv5" ;;
    v5litepod-*|v5e-*) echo "v2-alpha-tpuv5-lite" ;;
    v6e-*) echo "v2-alpha-tpuv6e" ;;
    *) die "unknown accelerator '$1': expected v4-N, v5p-N, v5litepod-N or v6e-N (or pass --version)" ;;
  esac
}

hosts_for() {
  local n="${1##*-}"
  [[ "$n" =~ ^[0-9]+$ ]] || die "accelerator '$1' does not end in a size (e.g. v5litepod-8)"
  case "$1" in
    v4-*|v5p-*) echo $(( (n / 2 + 3) / 4 )) ;;
    *) if (( n <= 8 )); then echo 1; else echo $(( n / 4 )); fi ;;
  esac
}

[[ -n "$version" ]] || version="$(runtime_for "$accelerator")"
hosts="$(hosts_for "$accelerator")"

common=(--zone "$zone")
[[ -z "$project" ]] || common+=(--project "$project")

# Runs a command, or with --dry-run prints it as you would type it (single quotes where needed).
run() {
  if [[ "$dry_run" == 1 ]]; then
    python3 -c 'import shlex, sys; print(shlex.join(sys.argv[1:]))' "$@"
  else
    "$@"
  fi
}

on_workers() {  # on_workers WORKER COMMAND: one remote shell command on the given worker(s)
  run gcloud compute tpus tpu-vm ssh "$name" "${common[@]}" --worker="$1" --command "$2"
}

wait_active() {  # polls the queued resource until ACTIVE, printing its state as it changes
  local describe=(gcloud compute tpus queued-resources describe "$name" "${common[@]}"
                  --format='value(state.state)')
  if [[ "$dry_run" == 1 ]]; then
    run "${describe[@]}"
    return
  fi
  local start=$SECONDS state last=""
  while true; do
    state="$("${describe[@]}")"
    if [[ "$state" != "$last" ]]; then
      echo "launch/tpu.sh: $name is $state after $(( SECONDS - start )) s" >&2
      last="$state"
    fi
    case "$state" in
      ACTIVE) return ;;
      FAILED|SUSPENDED) die "queued resource $name is $state: see gcloud compute tpus queued-resources describe $name" ;;
    esac
    sleep "${MAXLM_TPU_POLL_S:-30}"
  done
}

repo="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck disable=SC2016  # these expand on the workers, not here
venv='$HOME/maxlm-venv' logs='$HOME/maxlm-logs'

case "$verb" in
  create)
    spot_flag=()
    [[ "$spot" == 0 ]] || spot_flag=(--spot)
    if [[ "$queued" == 1 ]]; then
      run gcloud compute tpus queued-resources create "$name" "${common[@]}" --node-id "$name" \
        --accelerator-type "$accelerator" --runtime-version "$version" "${spot_flag[@]}"
      [[ "$wait" == 0 ]] || wait_active
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
    config="${train_args[0]}"
    [[ -f "$config" ]] || die "config $config is not a file on this machine"
    overrides=("${train_args[@]:1}")
    paths="$(python3 "$repo/launch/config_paths.py" "$config" "${overrides[@]}" \
      "run_dir=$run_dir")" || exit 2
    data_dir="$(sed -n 's/^data\.dir=//p' <<< "$paths")"
    init_from="$(sed -n 's/^init\.from=//p' <<< "$paths")"
    extra=()
    if [[ "$data_dir" != gs://* ]]; then
      if [[ "$upload_data" == 1 ]]; then
        [[ -d "$data_dir" ]] || die "--upload-data: data.dir $data_dir is not a folder here"
        data_tar="${TMPDIR:-/tmp}/maxlm-data.tar"
        run tar -cf "$data_tar" -C "$(dirname "$data_dir")" "$(basename "$data_dir")"
        run gcloud compute tpus tpu-vm scp "$data_tar" "$name:maxlm-data.tar" "${common[@]}" \
          --worker=all
        on_workers all "mkdir -p \$HOME/maxlm-data && tar -xf \$HOME/maxlm-data.tar -C \
\$HOME/maxlm-data && rm \$HOME/maxlm-data.tar"
        extra+=("data.dir=\$HOME/maxlm-data/$(printf %q "$(basename "$data_dir")")")
      elif [[ "$hosts" -gt 1 || -d "$data_dir" ]]; then
        die "data.dir $data_dir is not in gs:// and $accelerator has $hosts host(s) that cannot \
read this machine's disk: prepare it to gs://BUCKET/data (maxlm prepare ... --out gs://...), or \
pass --upload-data to copy it to every worker"
      fi
    fi
    if [[ -n "$init_from" && "$init_from" != gs://* && "$hosts" -gt 1 ]]; then
      die "init.from $init_from is not in gs://: every host of $accelerator must read it"
    fi
    # the config travels with the run: workers read their copy, not a path on this machine
    run gcloud compute tpus tpu-vm scp "$config" "$name:maxlm-run.yaml" "${common[@]}" \
      --worker=all
    args=" \$HOME/maxlm-run.yaml"
    for a in "${overrides[@]}"; do
      [[ ${#extra[@]} -gt 0 && "$a" == data.dir=* ]] || args+=" $(printf '%q' "$a")"
    done
    for a in "${extra[@]}"; do args+=" $a"; done
    # detached, so a dropped ssh session does not stop training; `logs` collects the output
    on_workers all "cd \$HOME/maxlm && mkdir -p $logs && nohup setsid \
$venv/bin/maxlm train$args run_dir=$(printf %q "$run_dir") distributed=true \
>> $logs/train-\$(hostname).log 2>&1 < /dev/null & echo \$! > $logs/train.pid; \
echo started on \$(hostname)"
    ;;
  status)
    if [[ "$queued" == 1 ]]; then
      run gcloud compute tpus queued-resources describe "$name" "${common[@]}" \
        --format='value(state.state)'
    fi
    run gcloud compute tpus tpu-vm describe "$name" "${common[@]}" \
      --format='value(state,health,acceleratorType)'
    on_workers all "if kill -0 \$(cat $logs/train.pid 2>/dev/null) 2>/dev/null; then \
echo \$(hostname): training; else echo \$(hostname): not training; fi; \
tail -n 2 $logs/train-\$(hostname).log 2>/dev/null || true"
    ;;
  stop)
    # SIGTERM every worker's trainer: JAX's preemption sync makes all of them save the same
    # step and exit 0 (maxlm/parallel/preemption.py); this waits until they have
    on_workers all "pid=\$(cat $logs/train.pid 2>/dev/null) && kill -TERM \$pid 2>/dev/null \
|| { echo \$(hostname): not training; exit 0; }; while kill -0 \$pid 2>/dev/null; do sleep 2; \
done; echo \$(hostname): stopped; tail -n 2 $logs/train-\$(hostname).log"
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
