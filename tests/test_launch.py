"""launch/: each script's --dry-run commands for one host and many, shellcheck, the GPU XLA
flags this jaxlib knows, and the MAXLM_* variables that join processes with jax.distributed."""

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
from limits import HANG_S
import xlaflags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ["launch/tpu.sh", "launch/gpu.sh", "launch/slurm.sbatch"]


def script(path, *args, env=None, ok=True):
  proc = subprocess.run(["bash", os.path.join(ROOT, path), *args], capture_output=True,
                        text=True, env={**os.environ, **(env or {})}, cwd=ROOT, timeout=HANG_S)
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

  lines, _ = script("launch/tpu.sh", "run", *base, "--accelerator", accelerator, "--run-dir",
                    "gs://b/run1", "configs/schedule_4k_1m.yaml", "train.keep=3",
                    "data.dir=gs://b/data")
  ship, run = lines
  assert ship[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "scp"] and "--worker=all" in ship
  assert ship[5:7] == ["configs/schedule_4k_1m.yaml", "lm:maxlm-run.yaml"]
  assert run[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh"] and "--worker=all" in run
  remote = run[-1]
  assert ("maxlm train $HOME/maxlm-run.yaml train.keep=3 data.dir=gs://b/data "
          "run_dir=gs://b/run1") in remote
  assert "distributed=true" in remote and "nohup setsid" in remote
  assert ">> $HOME/maxlm-logs/train-$(hostname).log" in remote
  assert "echo $! > $HOME/maxlm-logs/train.pid" in remote

  lines, _ = script("launch/tpu.sh", "logs", *base, "--out", "here")
  assert lines[0] == ["mkdir", "-p", "here"] and "--worker=all" in lines[1]

  lines, _ = script("launch/tpu.sh", "delete", *base, *(["--queued"] if queued else []))
  assert lines[0][3] == ("queued-resources" if queued else "tpu-vm") and "delete" in lines[0]


@pytest.mark.parametrize("accelerator, image", [
    ("v4-32", "tpu-ubuntu2204-base"), ("v5p-8", "v2-alpha-tpuv5"),
    ("v5litepod-16", "v2-alpha-tpuv5-lite"), ("v6e-8", "v2-alpha-tpuv6e")])
def test_tpu_runtime_image_follows_the_accelerator(accelerator, image):
  base = ["--name", "lm", "--zone", "z", "--dry-run", "--accelerator", accelerator]
  (create,), _ = script("launch/tpu.sh", "create", *base)
  assert create[create.index("--version") + 1] == image
  lines, _ = script("launch/tpu.sh", "create", *base, "--queued", "--version", "mine")
  assert lines[0][lines[0].index("--runtime-version") + 1] == "mine"


def test_tpu_unknown_accelerator_is_one_line():
  _, err = script("launch/tpu.sh", "create", "--name", "a", "--zone", "z", "--dry-run",
                  "--accelerator", "v9-8", ok=False)
  assert "unknown accelerator 'v9-8'" in err and err.count("\n") == 1


def test_tpu_queued_create_waits_until_active(tmp_path):
  """A stand-in gcloud answers WAITING_FOR_RESOURCES twice, then ACTIVE."""
  fake = tmp_path / "gcloud"
  fake.write_text("#!/bin/bash\necho \"$*\" >> \"$CALLS\"\n"
                  "if [[ \"$*\" == *describe* ]]; then n=$(grep -c describe \"$CALLS\"); "
                  "if (( n < 3 )); then echo WAITING_FOR_RESOURCES; else echo ACTIVE; fi; fi\n")
  fake.chmod(0o755)
  env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "CALLS": str(tmp_path / "calls"),
         "MAXLM_TPU_POLL_S": "0"}
  _, err = script("launch/tpu.sh", "create", "--name", "lm", "--zone", "z", "--queued",
                  "--accelerator", "v5litepod-8", env=env)
  calls = (tmp_path / "calls").read_text().splitlines()
  assert calls[0].startswith("compute tpus queued-resources create lm")
  assert [c.split()[3] for c in calls[1:]] == ["describe"] * 3
  assert "lm is WAITING_FOR_RESOURCES after" in err and "lm is ACTIVE after" in err
  lines, _ = script("launch/tpu.sh", "create", "--name", "lm", "--zone", "z", "--queued",
                    "--no-wait", "--dry-run")
  assert len(lines) == 1


def test_tpu_run_refuses_a_local_data_dir_on_a_pod_or_uploads_it(tmp_path):
  base = ["--name", "lm", "--zone", "z", "--dry-run", "--run-dir", "gs://b/r"]
  data = tmp_path / "my data"
  data.mkdir()
  _, err = script("launch/tpu.sh", "run", *base, "--accelerator", "v5litepod-32",
                  "configs/demo.yaml", f"data.dir={data}", ok=False)
  assert "is not in gs://" in err and "8 host(s)" in err and "--upload-data" in err
  _, err = script("launch/tpu.sh", "run", *base, "configs/demo.yaml", f"data.dir={data}",
                  ok=False)  # one host, but the folder is on this machine
  assert "--upload-data" in err
  lines, _ = script("launch/tpu.sh", "run", *base, "--accelerator", "v5litepod-32",
                    "--upload-data", "configs/demo.yaml", f"data.dir={data}")
  tar, scp, unpack, ship, run = lines
  assert tar[:2] == ["tar", "-cf"] and tar[-3:] == ["-C", str(tmp_path), "my data"]
  assert scp[4] == "scp" and "--worker=all" in scp and "--worker=all" in unpack
  assert "tar -xf $HOME/maxlm-data.tar -C $HOME/maxlm-data" in unpack[-1]
  assert ship[5] == "configs/demo.yaml"
  assert "maxlm train $HOME/maxlm-run.yaml data.dir=$HOME/maxlm-data/my\\ data " in run[-1]
  _, err = script("launch/tpu.sh", "run", *base, "--accelerator", "v4-16", "configs/demo.yaml",
                  "data.dir=gs://b/d", "init.from=/local/run", ok=False)
  assert "init.from /local/run is not in gs://" in err
  _, err = script("launch/tpu.sh", "run", *base, "configs/demo.yaml", "modle.size=1b",
                  ok=False)
  assert "did you mean 'model'" in err and err.count("\n") == 1


def test_tpu_status_and_stop():
  base = ["--name", "lm", "--zone", "z", "--dry-run"]
  lines, _ = script("launch/tpu.sh", "status", *base, "--queued")
  assert [line[3:5] for line in lines] == [["queued-resources", "describe"],
                                           ["tpu-vm", "describe"], ["tpu-vm", "ssh"]]
  assert "--worker=all" in lines[2] and "train.pid" in lines[2][-1]
  (stop,), _ = script("launch/tpu.sh", "stop", *base)
  assert "--worker=all" in stop and "kill -TERM $pid" in stop[-1]
  assert "while kill -0 $pid" in stop[-1]  # waits until every worker has saved and exited


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
                        capture_output=True, text=True, timeout=HANG_S)
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


def test_slurm_outside_a_job_says_so_and_its_dry_run_assumes_the_default_nodes():
  _, err = script("launch/slurm.sbatch", "configs/x.yaml", ok=False,
                  env={"SLURM_JOB_NODELIST": ""})
  assert "sbatch" in err
  lines, _ = script("launch/slurm.sbatch", "--dry-run", "configs/x.yaml",
                    env={"SLURM_JOB_NODELIST": "", "SLURM_NNODES": "", "SLURM_NTASKS": ""})
  assert lines[0][:6] == ["(not", "inside", "a", "SLURM", "job:", "assuming"]
  assert [task[4] for task in lines[2:]] == ["MAXLM_PROCESS_ID=0", "MAXLM_PROCESS_ID=1"]


@pytest.mark.parametrize("path", SCRIPTS)
def test_every_script_answers_help_with_its_usage(path):
  proc = subprocess.run(["bash", os.path.join(ROOT, path), "--help"], capture_output=True,
                        text=True, cwd=ROOT, timeout=HANG_S)
  assert proc.returncode == 0 and proc.stdout.count(path) >= 2, proc.stdout + proc.stderr
  assert not proc.stderr and "#" not in proc.stdout.split("\n")[0]


def test_dry_runs_print_commands_as_one_would_type_them():
  """Single quotes around an argument with spaces, not a backslash before each space."""
  proc = subprocess.run(["bash", os.path.join(ROOT, "launch/gpu.sh"), "install", "--dry-run"],
                        capture_output=True, text=True, cwd=ROOT, timeout=HANG_S)
  check = proc.stdout.splitlines()[1]
  assert check.startswith("python3 -c 'import jax; assert jax.default_backend() == \"gpu\"")
  assert "\\ " not in proc.stdout


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
  env = {**os.environ, "XLA_FLAGS": xlaflags.flags()}
  env.update(MAXLM_COORDINATOR=f"127.0.0.1:{port}", MAXLM_NUM_PROCESSES="2",
             JAX_PLATFORMS="cpu")
  procs = [subprocess.Popen([sys.executable, "-c", JOIN], env={**env, "MAXLM_PROCESS_ID": str(i)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  outs = [p.communicate(timeout=HANG_S) for p in procs]
  assert [o[0].split() for o in outs] == [["2", "0"], ["2", "1"]], outs


def test_partial_maxlm_variables_are_an_error():
  from maxlm import MaxlmError
  from maxlm.parallel import mesh
  with pytest.raises(MaxlmError, match="MAXLM_PROCESS_ID missing"):
    mesh.initialize_distributed(True, env={"MAXLM_COORDINATOR": "h:1",
                                           "MAXLM_NUM_PROCESSES": "2"})


@pytest.mark.parametrize("path, devices, device_gib", [
    ("configs/tpu_v5e8_150m.yaml", 8, 16),  # v5e: 16 GiB HBM per chip
    ("configs/gpu_1x_1b.yaml", 1, 80 * 1e9 / 2**30)])  # the smallest GPU it is meant for
def test_starter_configs_divide_and_fit(path, devices, device_gib):
  """Every parameter and the batch divide over the mesh on the devices the config is for,
  and the memory estimate (maxlm/train/memory.py) leaves a quarter of a device free."""
  from maxlm import config as config_lib
  from maxlm.model import build
  from maxlm.parallel import mesh
  from maxlm.train import memory
  from maxlm.train import stage as stage_lib
  cfg = config_lib.load(os.path.join(ROOT, path))
  vocab = cfg.model.vocab_size
  assert vocab, "a starter config fixes its vocabulary, so its memory is known"
  params = build.param_axes(cfg, vocab)
  for i, stage in enumerate(cfg.stages):
    shape = dict(zip(config_lib.MESH_AXES, mesh.mesh_shape(stage.mesh, devices)))
    stage_lib.check_params_divide(i, shape, cfg.rules, params)
    ways = int(np.prod([shape[a] for a in cfg.rules["batch"]]))
    assert (stage.batch // cfg.train.grad_accum) % ways == 0
    need = memory.estimate(cfg, i, devices, vocab)
    assert need["total"] < 0.75 * device_gib * 2**30, {k: v / 2**30 for k, v in need.items()}
    assert need["state"] > 0 and need["activations"] > 0


def test_memory_estimate_follows_sharding_remat_and_batch():
  from maxlm import config as config_lib
  from maxlm.train import memory
  cfg = config_lib.load(os.path.join(ROOT, "configs/tpu_v5e8_150m.yaml"))
  on8, on4 = (memory.estimate(cfg, 0, n, 32768) for n in (8, 4))
  assert on4["state"] == pytest.approx(2 * on8["state"], rel=0.01)  # fsdp halves it
  assert on4["activations"] == pytest.approx(2 * on8["activations"])  # twice the rows
  none = memory.estimate(config_lib.load(os.path.join(ROOT, "configs/tpu_v5e8_150m.yaml"),
                                         ["model.remat=none"]), 0, 8, 32768)
  assert none["activations"] > 3 * on8["activations"]
  half = memory.estimate(config_lib.load(os.path.join(ROOT, "configs/tpu_v5e8_150m.yaml"),
                                         ["train.grad_accum=2"]), 0, 8, 32768)
  assert half["activations"] == pytest.approx(on8["activations"] / 2)
  # the state: 16 bytes per parameter, over 8 ways of fsdp (norm scales are replicated)
  from maxlm.model import build
  n = sum(int(np.prod(d)) for _, d, _ in build.param_axes(cfg, 32768))
  assert 16 * n / 8 <= on8["state"] < 16 * n / 8 * 1.01


SKYPILOT = os.path.join(ROOT, "launch/skypilot.yaml")


def test_skypilot_task_parses_with_skypilots_own_parser():
  sky = pytest.importorskip("sky", reason="SkyPilot is not installed: pip install skypilot "
                            "(in a side venv) to check launch/skypilot.yaml with its parser")
  from maxlm.parallel import watchdog
  task = sky.Task.from_yaml(SKYPILOT)
  (res,) = task.resources
  assert res.accelerators == {"tpu-v5litepod-8": 1} and res.use_spot
  (create,), _ = script("launch/tpu.sh", "create", "--name", "a", "--zone", "z", "--dry-run",
                        "--accelerator", "v5litepod-8")
  assert res.accelerator_args["runtime_version"] == create[create.index("--version") + 1]
  recover = res.job_recovery["recover_on_exit_codes"]
  assert watchdog.EXIT_LOST in recover and 134 in recover
  assert res.job_recovery["max_restarts_on_errors"] == 0  # a bad config is not retried
  assert os.path.isfile(os.path.join(ROOT, task.envs["CONFIG"]))
  assert task.envs["RUN_DIR"].startswith("gs://") and task.workdir == "."
  task.set_resources_override({"accelerators": "H100:1"})  # the GPU variant in its header
  assert list(task.resources)[0].accelerators == {"H100": 1}


@pytest.mark.parametrize("extra, nodes, rank, want", [
    ("tpu", "1", "0", {"distributed": "true"}),
    ("cuda", "1", "0", {"distributed": "false"}),
    ("cuda", "2", "1", {"distributed": "true", "MAXLM_COORDINATOR": "10.0.0.5:12355",
                        "MAXLM_NUM_PROCESSES": "2", "MAXLM_PROCESS_ID": "1"})])
def test_skypilot_run_section_starts_maxlm_train(tmp_path, extra, nodes, rank, want):
  """The task's `run` script, with a stand-in maxlm that reports what it was given."""
  import yaml
  task = yaml.safe_load(open(SKYPILOT))
  fake = tmp_path / "venv" / "bin" / "maxlm"
  fake.parent.mkdir(parents=True)
  fake.write_text("#!/bin/bash\necho \"ARGS $*\"\n"
                  "echo \"ENV ${MAXLM_COORDINATOR:-} ${MAXLM_NUM_PROCESSES:-} "
                  "${MAXLM_PROCESS_ID:-}\"\n")
  fake.chmod(0o755)
  env = {**{k: str(v) for k, v in task["envs"].items()}, "EXTRA": extra,
         "MAXLM_VENV": str(tmp_path / "venv"), "SKYPILOT_NUM_NODES": nodes,
         "SKYPILOT_NODE_RANK": rank, "SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6",
         "PATH": os.environ["PATH"]}
  proc = subprocess.run(["bash", "-c", task["run"]], env=env, capture_output=True, text=True)
  assert proc.returncode == 0, proc.stderr
  args, got_env = proc.stdout.splitlines()
  assert args == (f"ARGS train {task['envs']['CONFIG']} run_dir={task['envs']['RUN_DIR']} "
                  f"data.dir={task['envs']['DATA_DIR']} distributed={want['distributed']}")
  assert got_env.split()[1:] == [want[k] for k in ("MAXLM_COORDINATOR", "MAXLM_NUM_PROCESSES",
                                                   "MAXLM_PROCESS_ID") if k in want]


def test_accelerator_extras_pin_the_jax_the_suite_runs():
  import tomllib
  import jax
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    extras = tomllib.load(f)["project"]["optional-dependencies"]
  assert f"jax[cuda12]=={jax.__version__}" in extras["cuda"]
  assert f"jax[tpu]=={jax.__version__}" in extras["tpu"]
  with open(os.path.join(ROOT, "docs/performance.md")) as f:
    text = f.read()
  assert f"jax and jaxlib {jax.__version__}" in text  # the versions statement names it


@pytest.mark.parametrize("env, message", [
    ({"MAXLM_COORDINATOR": "10.0.0.2", "MAXLM_NUM_PROCESSES": "2", "MAXLM_PROCESS_ID": "0"},
     "expected HOST:PORT"),
    ({"MAXLM_COORDINATOR": "h:99999", "MAXLM_NUM_PROCESSES": "2", "MAXLM_PROCESS_ID": "0"},
     "expected HOST:PORT"),
    ({"MAXLM_COORDINATOR": "h:1", "MAXLM_NUM_PROCESSES": "2", "MAXLM_PROCESS_ID": "2"},
     "MAXLM_PROCESS_ID=2 must be in 0..MAXLM_NUM_PROCESSES-1"),
    ({"MAXLM_COORDINATOR": "h:1", "MAXLM_NUM_PROCESSES": "two", "MAXLM_PROCESS_ID": "0"},
     "must be integers"),
    ({"MAXLM_COORDINATOR": "h:1", "MAXLM_NUM_PROCESSES": "0", "MAXLM_PROCESS_ID": "0"},
     "must be in 0..MAXLM_NUM_PROCESSES-1"),
    ({"MAXLM_PEER_TIMEOUT": "soon"}, "MAXLM_PEER_TIMEOUT='soon'"),
    ({"MAXLM_PEER_TIMEOUT": "1"}, "between 2 and 86400")])
def test_bad_maxlm_variables_are_one_line_errors(env, message):
  from maxlm import MaxlmError
  from maxlm.parallel import distributed
  with pytest.raises(MaxlmError, match=re.escape(message)):
    distributed.parse_env(env)
    distributed.peer_timeout(env)


def test_ipv6_coordinator_and_the_default_peer_timeout():
  from maxlm.parallel import distributed
  env = {"MAXLM_COORDINATOR": "[fd00::2]:12355", "MAXLM_NUM_PROCESSES": "4",
         "MAXLM_PROCESS_ID": "3"}
  assert distributed.parse_env(env) == ("[fd00::2]:12355", 4, 3)
  assert distributed.parse_env({}) is None and distributed.peer_timeout({}) == 100
