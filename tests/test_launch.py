"""launch/: each script's --dry-run commands for one host and many, shellcheck, the GPU XLA
flags this jaxlib knows, and the MAXLM_* variables that join processes with jax.distributed."""

import os
import shlex
import shutil
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ["launch/tpu.sh", "launch/gpu.sh", "launch/slurm.sbatch"]


def script(path, *args, env=None, ok=True):
  proc = subprocess.run(["bash", os.path.join(ROOT, path), *args], capture_output=True,
                        text=True, env={**os.environ, **(env or {})}, cwd=ROOT, timeout=60)
  assert (proc.returncode == 0) == ok, (proc.stdout, proc.stderr)
  return [shlex.split(line) for line in proc.stdout.splitlines()], proc.stderr


def test_shellcheck_passes_on_every_script():
  shellcheck = shutil.which("shellcheck")
  assert shellcheck, "shellcheck is a test dependency (pip install -e '.[test]')"
  proc = subprocess.run([shellcheck, "--severity=style", *SCRIPTS], cwd=ROOT,
                        capture_output=True, text=True)
  assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize("accelerator, queued", [("v5litepod-8", False), ("v5litepod-32", True)])
def test_tpu_create_setup_run_delete(accelerator, queued):
  base = ["--name", "lm", "--zone", "us-west4-a", "--project", "p1", "--dry-run"]
  extra = ["--queued", "--spot"] if queued else []
  lines, _ = script("launch/tpu.sh", "create", *base, "--accelerator", accelerator, *extra)
  create = lines[0]
  assert create[:4] == ["gcloud", "compute", "tpus",
                        "queued-resources" if queued else "tpu-vm"]
  assert accelerator in create and "us-west4-a" in create and "p1" in create
  assert ("--spot" in create) == queued and ("--node-id" in create) == queued

  lines, _ = script("launch/tpu.sh", "setup", *base)
  assert lines[0][0] == "tar" and "--exclude=.git" in lines[0]
  assert lines[1][:4] == ["gcloud", "compute", "tpus", "tpu-vm"] and "scp" in lines[1]
  assert all("--worker=all" in line for line in lines[1:])
  assert "maxlm[tpu]" in lines[2][-1] and "python3.11 -m venv" in lines[2][-1]

  lines, _ = script("launch/tpu.sh", "run", *base, "--run-dir", "gs://b/run1",
                    "configs/schedule_4k_1m.yaml", "train.keep=3")
  (run,) = lines
  assert run[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh"] and "--worker=all" in run
  remote = run[-1]
  assert "maxlm train configs/schedule_4k_1m.yaml train.keep=3 run_dir=gs://b/run1" in remote
  assert "distributed=true" in remote and "nohup setsid" in remote
  assert ">> $HOME/maxlm-logs/train-$(hostname).log" in remote

  lines, _ = script("launch/tpu.sh", "logs", *base, "--out", "here")
  assert lines[0] == ["mkdir", "-p", "here"] and "--worker=all" in lines[1]

  lines, _ = script("launch/tpu.sh", "delete", *base, *(["--queued"] if queued else []))
  assert lines[0][3] == ("queued-resources" if queued else "tpu-vm") and "delete" in lines[0]


def test_tpu_errors_say_what_is_missing():
  _, err = script("launch/tpu.sh", "run", "--name", "lm", "--zone", "z", "--dry-run",
                  "configs/demo.yaml", ok=False)
  assert "gs://" in err and err.count("\n") == 1
  _, err = script("launch/tpu.sh", "create", "--dry-run", ok=False, env={"MAXLM_TPU_NAME": ""})
  assert "--name is required" in err
  _, err = script("launch/tpu.sh", "start", "--name", "a", "--zone", "z", ok=False)
  assert "unknown verb 'start'" in err


def test_gpu_install_and_run_commands():
  lines, _ = script("launch/gpu.sh", "install", "--dry-run")
  assert lines[0][:4] == ["python3", "-m", "pip", "install"] and lines[0][-1].endswith("[cuda]")
  lines, _ = script("launch/gpu.sh", "run", "configs/demo.yaml", "stages.0.attention=gpu",
                    "--dry-run", env={"XLA_FLAGS": "--xla_dump_to=/tmp/d"})
  (run,) = lines
  assert run[0] == "env" and run[-3:] == ["train", "configs/demo.yaml", "stages.0.attention=gpu"]
  flags = next(a for a in run if a.startswith("XLA_FLAGS="))
  assert flags.startswith("XLA_FLAGS=--xla_dump_to=/tmp/d --xla_gpu_enable_latency_hiding")


def test_gpu_xla_flags_are_known_to_this_jaxlib():
  lines, _ = script("launch/gpu.sh", "run", "c.yaml", "--dry-run", env={"XLA_FLAGS": ""})
  flags = next(a for a in lines[0] if a.startswith("XLA_FLAGS="))[len("XLA_FLAGS="):]
  env = {**os.environ, "XLA_FLAGS": flags}
  proc = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-500:]  # XLA aborts on an unknown flag


@pytest.mark.parametrize("nodelist, tasks, head", [("gpu07", "1", "gpu07"),
                                                   ("gpu[03-06]", "4", "gpu03")])
def test_slurm_tasks_get_coordinator_count_and_index(nodelist, tasks, head):
  env = {"SLURM_JOB_NODELIST": nodelist, "SLURM_NTASKS": tasks, "PATH": "/usr/bin:/bin"}
  lines, _ = script("launch/slurm.sbatch", "--dry-run", "configs/x.yaml", "run_dir=/shared/r",
                    env=env)
  assert lines[0][1] == f"{head}:12355,"
  tasks = lines[1:]
  assert len(tasks) == int(env["SLURM_NTASKS"])
  for i, task in enumerate(tasks):
    assert task[2:5] == [f"MAXLM_COORDINATOR={head}:12355",
                         f"MAXLM_NUM_PROCESSES={env['SLURM_NTASKS']}", f"MAXLM_PROCESS_ID={i}"]
    assert task[5:] == ["maxlm", "train", "configs/x.yaml", "run_dir=/shared/r",
                        "distributed=true"]


def test_slurm_outside_a_job_says_so():
  _, err = script("launch/slurm.sbatch", "configs/x.yaml", ok=False,
                  env={"SLURM_JOB_NODELIST": ""})
  assert "sbatch" in err


JOIN = """
import sys
from maxlm.parallel import mesh
mesh.initialize_distributed(True)
import jax
print(jax.process_count(), jax.process_index())
"""


@pytest.mark.slow
def test_maxlm_variables_join_two_processes():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(MAXLM_COORDINATOR=f"127.0.0.1:{port}", MAXLM_NUM_PROCESSES="2",
             JAX_PLATFORMS="cpu")
  procs = [subprocess.Popen([sys.executable, "-c", JOIN], env={**env, "MAXLM_PROCESS_ID": str(i)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  outs = [p.communicate(timeout=120) for p in procs]
  assert [o[0].split() for o in outs] == [["2", "0"], ["2", "1"]], outs


def test_partial_maxlm_variables_are_an_error():
  from maxlm import MaxlmError
  from maxlm.parallel import mesh
  with pytest.raises(MaxlmError, match="MAXLM_PROCESS_ID missing"):
    mesh.initialize_distributed(True, env={"MAXLM_COORDINATOR": "h:1",
                                           "MAXLM_NUM_PROCESSES": "2"})
