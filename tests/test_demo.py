"""`maxlm demo`'s Ctrl-C path: the terminal sends SIGINT to the whole process group; the demo
must wait for the training child to save, not kill it, and say how to resume."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import yaml

from maxlm.train import metrics
from limits import HANG_S
import xlaflags

# `maxlm demo`'s training wait under the signal handling `maxlm` gives every command
# (maxlm/cli.py): its own SIGINT handler, not one inherited from whatever started it
WRAPPER = textwrap.dedent("""
    import subprocess, sys
    from maxlm import MaxlmError, demo, signals
    signals.install_early()
    try:
      with signals.running():
        demo._wait(subprocess.Popen([sys.executable, "-m", "maxlm.cli", "train", sys.argv[1]]))
    except MaxlmError as e:
      print(e, file=sys.stderr)
      sys.exit(2)
""")


def test_ctrl_c_leaves_the_run_resumable(tmp_path, demo_data):
  config = tmp_path / "cfg.yaml"
  config.write_text(yaml.safe_dump({
      "run_dir": str(tmp_path / "run"), "data": {"dir": str(demo_data),
                                                  "mix": {"prose": 0.6, "code": 0.4}},
      "model": {"size": "tiny", "d_model": 32, "n_heads": 2, "n_kv_heads": 1, "head_dim": 16,
                "d_ff": 64, "dtype": "float32"},
      "stages": [{"seq_len": 128, "batch": 8, "steps": 400}],
      "train": {"checkpoint_every": 1000, "eval_every": 0}}))
  # the job pauses after step 2 until the signal reaches it (maxlm/train/pause.py): it cannot
  # finish before the Ctrl-C lands, however loaded the machine
  env = {**os.environ, "XLA_FLAGS": xlaflags.flags(),
         "MAXLM_PAUSE_AFTER": f"2:{tmp_path / 'never'}"}
  proc = subprocess.Popen([sys.executable, "-c", WRAPPER, str(config)], env=env,
                          start_new_session=True, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  run_dir = str(tmp_path / "run")
  while proc.poll() is None and len(metrics.read_jsonl(run_dir)) < 3:
    time.sleep(0.05)
  assert proc.poll() is None, proc.communicate()
  os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
  out, err = proc.communicate(timeout=HANG_S)
  assert proc.returncode == 2 and "run `maxlm demo` again to resume" in err, err
  steps = sorted(int(p) for p in os.listdir(os.path.join(run_dir, "checkpoints")) if p.isdigit())
  logged = len(metrics.read_jsonl(run_dir))
  assert steps == [logged] == [4]  # saved at the step after the pause, where it stopped
