"""Multi-process training on one machine: 2 CPU processes x 2 devices joined by jax.distributed
over gloo (maxlm/parallel/distributed.py), against 1 process x 4 devices.

Every run here is `maxlm train` in subprocesses, as a user starts it, on a one-stage tiny
config; the reference is one uninterrupted 1 x 4 run with `distributed: true`, whose CPU
collectives are then gloo's too. Two processes give bitwise the same losses as that one (the
same XLA program on the same 4-device mesh, the same gloo all-reduce), so every run is
compared bitwise to it: batch fingerprints (the digest of every row's digest in global order,
so equal fingerprints mean process p supplied exactly its own rows of the global batch),
losses, gradient and parameter norms, validation losses and loss tokens. A plain
one-process run (XLA's in-process all-reduce) reads the same batches and matches to the last
bits of float32 (relative 1e-6).
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

from maxlm.train import metrics

import datagen
from limits import HANG_S
import xlaflags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 8
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def config(tmp_path_factory):
  root = tmp_path_factory.mktemp("multiprocess")
  rng = np.random.default_rng(0)
  lengths = rng.lognormal(np.log(40), 0.8, 200).astype(int) + 1
  sources = ["prose" if i % 2 else "code" for i in range(len(lengths))]
  data = datagen.write_data_dir(root / "data", datagen.make_docs(lengths, sources),
                                val_fraction=0.1)
  raw = {"seed": 0, "run_dir": str(root / "unused"), "distributed": True,
         "data": {"dir": str(data), "mix": {"prose": 0.5, "code": 0.5}, "overlap": 4,
                  "shuffle_rows": 8, "block_rows": 64},
         "stages": [{"seq_len": 32, "batch": 8, "steps": STEPS}],
         "model": {"size": "tiny", "dtype": "float32", "remat": "none", "d_model": 32,
                   "n_heads": 2, "n_kv_heads": 1, "head_dim": 16, "d_ff": 64, "loss_chunk": 32},
         "train": {"lr": 0.01, "warmup_steps": 2, "checkpoint_every": 2, "eval_every": 4}}
  path = root / "cfg.yaml"
  path.write_text(yaml.safe_dump(raw))
  return path


def _port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start(config, run_dir, processes, *args, env=None):
  """`maxlm train` as `processes` processes sharing 4 CPU devices; returns the Popen objects."""
  port = _port()
  procs = []
  for i in range(processes):
    penv = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
            "XLA_FLAGS": xlaflags.flags(4 // processes),
            "MAXLM_COORDINATOR": f"127.0.0.1:{port}", "MAXLM_NUM_PROCESSES": str(processes),
            "MAXLM_PROCESS_ID": str(i), **(env or {})}
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "maxlm.cli", "train", str(config), f"run_dir={run_dir}", *args],
        env=penv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
  return procs


def finish(procs, timeout=HANG_S):
  outs = []
  for p in procs:
    try:
      outs.append(p.communicate(timeout=timeout))
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
  return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def train(config, run_dir, processes, *args, env=None):
  results = finish(start(config, run_dir, processes, *args, env=env))
  for code, out, err in results:
    assert code == 0, (out[-2000:], err[-2000:])
  return results


def rows(run_dir):
  return {r["step"]: r for r in metrics.read_jsonl(str(run_dir))}


def wait_for_step(run_dir, step, procs, timeout=HANG_S):
  end = time.time() + timeout
  while time.time() < end:
    got = rows(run_dir)
    if got and max(got) >= step:
      return max(got)
    assert all(p.poll() is None for p in procs), "a process ended before the kill"
    time.sleep(0.02)
  raise AssertionError(f"step {step} not reached")


KEYS = ("fingerprint", "loss", "grad_norm", "param_norm", "val_loss", "val_bpb",
        "loss_tokens/prose", "loss_tokens/code")


def assert_same(reference, run_dir, steps=None):
  got = rows(run_dir)
  steps = sorted(reference) if steps is None else steps
  assert sorted(got) == steps
  for step in steps:
    for key in KEYS:
      assert got[step].get(key) == reference[step].get(key), (step, key)


@pytest.fixture(scope="module")
def reference(config, tmp_path_factory):
  run_dir = tmp_path_factory.mktemp("ref") / "run"
  train(config, run_dir, 1)
  ref = rows(run_dir)
  assert sorted(ref) == list(range(STEPS)) and any("val_loss" in r for r in ref.values())
  return ref


def test_two_processes_log_the_losses_of_one_and_only_process_0_writes(config, reference,
                                                                       tmp_path):
  run_dir = tmp_path / "run"
  results = train(config, run_dir, 2)
  assert_same(reference, run_dir)
  names = sorted(os.listdir(run_dir))
  events = [n for n in names if n.startswith("events.out.tfevents.")]
  assert [n for n in names if n not in events] == ["checkpoints", "config.yaml", "lease.json",
                                                   "metrics.jsonl"]
  pids = {int(e.rsplit(".", 1)[1]) for e in events}
  holder = json.loads((run_dir / "lease.json").read_text())
  assert pids == {holder["pid"]}, "process 1 wrote an event file, or process 0 did not hold"
  assert all("run_dir:" in out for _, out, _ in results)

  # one plain process (XLA's in-process all-reduce, not gloo): the same batches, and losses
  # equal but for the last bits of the float32 sums, which add in another order
  plain = tmp_path / "plain"
  train(config, plain, 1, "distributed=false")
  got = rows(plain)
  for step, row in reference.items():
    assert got[step]["fingerprint"] == row["fingerprint"]
    assert got[step]["loss"] == pytest.approx(row["loss"], rel=1e-6, abs=0)


def paused_after(step, tmp_path):
  """Both processes wait after `step` until a stop is agreed or they die (maxlm/train/pause.py),
  so the job cannot finish before the test's next action lands."""
  return {"MAXLM_PAUSE_AFTER": f"{step}:{tmp_path / 'never'}"}


def test_preemption_of_process_1_saves_one_step_on_both_then_resumes_on_1_then_on_2(
    config, reference, tmp_path):
  run_dir = tmp_path / "run"
  procs = start(config, run_dir, 2, env=paused_after(1, tmp_path))
  wait_for_step(run_dir, 1, procs)
  procs[1].send_signal(signal.SIGTERM)
  results = finish(procs)
  stops = []
  for code, out, err in results:
    assert code == 0, err[-2000:]
    (line,) = [x for x in out.splitlines() if x.startswith("stopped after step")]
    assert "all 2 processes agreed on" in line
    stops.append(int(re.search(r"checkpoint (\d+) saved", line)[1]))
  # both paused after step 1 (call counter 2) when the notice came: the agreed stop is the next
  (step,) = set(stops)
  assert step == 3 and os.path.isdir(run_dir / "checkpoints" / str(step))
  (result,) = train(config, run_dir, 1, "--stop-after", "1")  # 2 -> 1 process
  assert f"resumed from checkpoint {step} " in result[1]
  results = train(config, run_dir, 2)  # 1 -> 2 processes
  assert f"resumed from checkpoint {step + 1} " in results[0][1]
  assert_same(reference, run_dir)  # the same batches and losses, bitwise, throughout


def test_a_dead_peer_ends_the_others_with_one_line_and_a_rerun_resumes(config, reference,
                                                                      tmp_path):
  run_dir = tmp_path / "run"
  # a peer timeout a starved heartbeat thread cannot reach on a loaded machine
  procs = start(config, run_dir, 2, env={"MAXLM_PEER_TIMEOUT": "20", **paused_after(2, tmp_path)})
  wait_for_step(run_dir, 2, procs)  # both wait there: the job holds its lease until killed
  holder = json.loads((run_dir / "lease.json").read_text())["pid"]
  for code, _, err in finish(start(config, run_dir, 2)):  # a second job on the same run_dir:
    assert code == 2, err[-2000:]  # both of its processes stop with process 0's one line
    (line,) = [x for x in err.splitlines() if "error" in x]
    assert line.startswith("maxlm train: error: run_dir") and f"in use by pid {holder}" in line
  assert max(rows(run_dir)) == 2 and all(p.poll() is None for p in procs)
  while not os.path.isdir(run_dir / "checkpoints" / "2"):  # the save of step 1 has committed
    assert all(p.poll() is None for p in procs), "a process ended before the kill"
    time.sleep(0.02)
  procs[1].send_signal(signal.SIGKILL)
  code, out, err = finish(procs[:1])[0]
  procs[1].wait()
  assert code == 75, err[-2000:]
  lines = [x for x in err.splitlines() if "lost process 1 of 2" in x]
  assert len(lines) == 1 and lines[0].startswith("maxlm train: error:"), err[-2000:]
  assert "Traceback" not in err and "Terminating process" not in err, err[-2000:]
  results = train(config, run_dir, 2)
  assert "resumed from checkpoint 2 " in results[0][1]
  assert_same(reference, run_dir)


def test_verify_restart_kills_both_processes_and_resumes_bitwise(config, tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": xlaflags.flags(2)}
  proc = subprocess.run([sys.executable, "-m", "maxlm.cli", "verify-restart", str(config),
                         "--processes", "2", "--kills", "1", "--workdir", str(tmp_path)],
                        env=env, cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
  assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
  assert "uninterrupted run as 2 processes" in proc.stdout
  assert "kill 1: mid-stage" in proc.stdout and "(killed)" in proc.stdout
  assert proc.stdout.rstrip().endswith("bitwise identical")
  killed, base = rows(tmp_path / "killed"), rows(tmp_path / "uninterrupted")
  assert sorted(killed) == sorted(base) == list(range(STEPS))
  assert all(killed[s]["loss"] == base[s]["loss"] for s in base)
