"""What `maxlm train` prints: start-up phases, the compile line, the progress line and its ETA,
and no message glued to the progress line on a terminal."""

import io
import os
import pty
import re
import subprocess
import sys

import numpy as np
import pytest

from maxlm.train import console, metrics

import datagen
from smallrun import ROOT, small_config
from limits import HANG_S


class FakeTerminal(io.StringIO):
  def isatty(self):
    return True


def test_messages_end_a_pending_progress_line():
  term = FakeTerminal()
  out = console.Console(print, term)
  out.progress("step 1 ETA 0:03")
  out.progress("step 2 ETA 0:02")
  out("stopped after step 2")
  with out.phase("compiling the stage-1 step"):
    pass
  out.progress("step 3", keep=True)
  lines = term.getvalue().split("\n")
  assert lines[0] == "\rstep 1 ETA 0:03\x1b[K\rstep 2 ETA 0:02\x1b[K"
  assert lines[1] == "stopped after step 2"
  assert re.fullmatch(r"compiling the stage-1 step\.\.\.\rcompiling the stage-1 step\.\.\. "
                      r"\d+\.\d s\x1b\[K", lines[2])
  assert lines[3] == "\rstep 3\x1b[K" and lines[4] == ""


def test_a_phase_that_fails_ends_its_line():
  term = FakeTerminal()
  out = console.Console(print, term)
  with pytest.raises(ValueError):
    with out.phase("opening data"):
      raise ValueError
  assert term.getvalue() == "opening data...\n" and not out.pending


def test_piped_or_logged_every_message_is_a_line():
  lines = []
  out = console.Console(lines.append)
  out.progress("step 1")
  with out.phase("compiling"):
    out("a note")
  assert lines[:3] == ["step 1", "compiling...", "a note"]
  assert re.fullmatch(r"compiling\.\.\. \d+\.\d s", lines[3])


def test_eta_leaves_out_compiling_steps_and_weighs_stages_by_positions():
  eta = console.Eta([(3, 100), (2, 400)])
  eta.start_stage()
  eta.step(0, now=100.0)  # compiled: not measured
  assert eta.left(0) is None and console.clock(None) == "--:--"
  eta.step(1, now=101.0)  # 1 s for 100 positions
  assert eta.left(1) == pytest.approx(1 * 1 + 2 * 4)
  eta.start_stage()
  eta.step(3, now=200.0)  # stage 1 compiles: not measured
  eta.step(4, now=204.0)
  assert eta.left(4) == 0 and eta.left(3) == pytest.approx((1 + 4) / 500 * 400)
  assert console.clock(3725) == "1:02:05" and console.clock(61) == "1:01"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  rng = np.random.default_rng(1)
  lengths = rng.lognormal(np.log(40), 0.8, 120).astype(int) + 1
  sources = ["prose" if i % 2 else "code" for i in range(len(lengths))]
  return datagen.write_data_dir(tmp_path_factory.mktemp("console") / "data",
                                datagen.make_docs(lengths, sources), val_fraction=0.1)


def test_train_on_a_terminal_says_what_it_does(tmp_path, data_dir):
  """`maxlm train` on a pseudo-terminal: a line per start-up phase, the compile line with its
  time, and the stop message on a line of its own, not glued to the progress line."""
  cfg = small_config(tmp_path, data_dir, eval_every=0)
  main, child = pty.openpty()
  env = {**os.environ, "COLUMNS": "200"}
  proc = subprocess.Popen([sys.executable, "-m", "maxlm.cli", "train", str(cfg),
                           "--stop-after", "8"], stdout=child, stderr=child, cwd=ROOT, env=env)
  os.close(child)
  chunks = []
  while True:
    try:
      chunk = os.read(main, 4096)
    except OSError:  # EIO: the child closed the terminal
      break
    if not chunk:
      break
    chunks.append(chunk)
  os.close(main)
  assert proc.wait(timeout=HANG_S) == 0
  text = b"".join(chunks).decode().replace("\r\n", "\n")
  lines = text.split("\n")
  for phase in ("opening ", "looking for checkpoints in ", "initializing the parameters",
                "compiling the stage-0 step (L=32, batch 8) and running step 0",
                "compiling the stage-1 step (L=64, batch 8) and running step 6"):
    assert re.search(rf"^{re.escape(phase)}.*\.\.\. \d+\.\d s", text.replace("\r", "\n"),
                     re.M), f"no line for {phase!r}:\n{text}"
  stop = [line for line in lines if "stopped after step 7" in line]  # its 8th: 0-based
  assert len(stop) == 1 and stop[0].startswith("stopped after step 7"), text
  assert re.search(r"ETA \d+:\d\d", text) and "ETA --:--" in text  # none until steady state
  # the progress line's step numbers are metrics.jsonl's (and `maxlm trace --step`'s)
  shown = re.findall(r"step (\d+)/10 \(stage (\d) step (\d+)/\d+\) loss (\d+\.\d{4})", text)
  logged = [(str(r["step"]), str(r["stage"]), str(r["stage_step"]), f"{r['loss']:.4f}")
            for r in metrics.read_jsonl(str(tmp_path / "run"))]
  assert shown == logged and len(logged) == 8, text


def test_a_dpo_progress_line_shows_reward_accuracy_and_margin():
  row = {"loss": 0.6931, "lr": 1e-3, "tokens_per_s": 1234.0, "reward_accuracy": 0.75,
         "reward_margin": 0.125}
  line = console.progress_line(1, 2, 5, 8, 10, row, 61)
  assert line.startswith("step 8/9 (stage 1 step 2/4) loss 0.6931 reward_acc 0.75 margin "
                         "0.125 lr 1.00e-03 1,234 tok/s ETA 1:01")
  lm = {k: v for k, v in row.items() if not k.startswith("reward")}
  assert console.progress_line(0, 0, 5, 0, 10, lm, None) == (
      "step 0/9 (stage 0 step 0/4) loss 0.6931 lr 1.00e-03 1,234 tok/s ETA --:--")


def test_the_redrawn_line_fits_the_terminal(monkeypatch):
  monkeypatch.setenv("COLUMNS", "40")
  term = FakeTerminal()
  out = console.Console(print, term)
  out.progress("x" * 100)
  out.progress("y" * 100, keep=True)  # a kept line may wrap: it is not redrawn
  assert term.getvalue() == "\r" + "x" * 39 + "\x1b[K\r" + "y" * 100 + "\x1b[K\n"
