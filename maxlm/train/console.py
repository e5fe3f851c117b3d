"""What `maxlm train` prints: start-up phases, compile times, one progress line, an honest ETA.

The progress line numbers steps as metrics.jsonl does: `step` counts from 0 over the whole
schedule (the number `maxlm trace --step` takes and spike messages give) and the stage's own
step is `stage_step`, also from 0. A DPO run's line carries the step's reward accuracy and
margin; an MoE run's, its worst-balanced layer (the busiest expert's load over the mean).

On a terminal the progress line is redrawn in place (`\\r`); every other message first ends a
pending progress line, so nothing is ever glued to it. Piped or given another `log` (tests,
verify-restart), every message is a whole line. The ETA uses steady-state steps only: each
stage's first step in a process compiles (seconds to minutes), so it is left out, and the
remaining work is counted in row positions (batch x L), since later stages have other shapes.
Written here rather than with tqdm because the line carries the loss and eval results and must
interleave with checkpoint and resume messages from other modules.
"""

import contextlib
import shutil
import sys
import time


class Console:
  """A `log` function (call it with a message) that also owns the progress line."""

  def __init__(self, log=print, stream=None):
    self.stream = stream or sys.stdout
    self.tty = log is print and _isatty(self.stream)
    self.log = (lambda m: print(m, file=self.stream, flush=True)) if log is print else log
    self.pending = False  # a progress line without its newline is on the terminal

  def __call__(self, message):
    self.end_line()
    self.log(message)

  def end_line(self):
    if self.pending:
      self.stream.write("\n")
      self.stream.flush()
      self.pending = False

  def progress(self, line, keep=False):
    """Shows `line` in place on a terminal (kept, with its newline, if `keep`)."""
    if not self.tty:
      return self.log(line)
    if not keep:  # a line wider than the terminal wraps, and \r would redraw only its tail
      line = line[:max(20, shutil.get_terminal_size().columns - 1)]
    self.stream.write("\r" + line + "\x1b[K" + ("\n" if keep else ""))
    self.stream.flush()
    self.pending = not keep

  @contextlib.contextmanager
  def phase(self, what):
    """'what...' now, then 'what... 12.3 s' when the block ends (on one line on a terminal)."""
    start = time.perf_counter()
    if self.tty:
      self.end_line()
      self.stream.write(what + "...")
      self.stream.flush()
      self.pending = True
    else:
      self.log(what + "...")
    try:
      yield
    except BaseException:
      self.end_line()
      raise
    took = f"{what}... {time.perf_counter() - start:.1f} s"
    if self.tty and self.pending:
      self.stream.write("\r" + took + "\x1b[K\n")
      self.stream.flush()
      self.pending = False
    else:
      self(took)


def _isatty(stream):
  try:
    return stream.isatty()
  except (AttributeError, ValueError):
    return False


class Eta:
  """Seconds left, from the seconds per row position of this process's steady-state steps.

  `stages` is (steps, batch x L) per stage. `step(g)` records that global step g just ended;
  the first step of each stage in this process (it compiles) is not measured, nor is anything
  before it. Until a steady-state step exists there is no estimate (None)."""

  def __init__(self, stages):
    self.stages = [(int(n), int(p)) for n, p in stages]
    self.last = None  # (global step, time) of the previous step's end, within one stage
    self.seconds = self.measured = 0.0

  def start_stage(self):
    self.last = None

  def positions(self, g):
    for n, p in self.stages:
      if g < n:
        return p
      g -= n
    raise IndexError(g)

  def step(self, g, now=None):
    now = time.perf_counter() if now is None else now
    if self.last is not None and self.last[0] == g - 1:
      self.seconds += now - self.last[1]
      self.measured += self.positions(g)
    self.last = (g, now)

  def left(self, g):
    """Seconds for the steps after global step g."""
    if not self.measured:
      return None
    remaining, start = 0, 0
    for n, p in self.stages:
      remaining += max(0, start + n - max(g + 1, start)) * p
      start += n
    return self.seconds / self.measured * remaining


def clock(seconds):
  """12:34, or 1:02:03 past an hour; --:-- without an estimate."""
  if seconds is None:
    return "--:--"
  s = int(round(seconds))
  h, m = divmod(s // 60, 60)
  return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


def progress_line(s, k, steps, g, total, row, seconds_left):
  """Step g (step k of stage s's `steps`; `total` in all) from its metrics row."""
  line = f"step {g}/{total - 1} (stage {s} step {k}/{steps - 1}) loss {row['loss']:.4f}"
  if "reward_accuracy" in row:
    line += f" reward_acc {row['reward_accuracy']:.2f} margin {row['reward_margin']:.3f}"
  worst = worst_balance(row)
  if worst is not None:  # the busiest expert's load over the mean, of the worst MoE layer
    line += f" moe max/mean {worst[1]:.2f} (layer {worst[0]})"
  line += f" lr {row['lr']:.2e} {row['tokens_per_s']:,.0f} tok/s ETA {clock(seconds_left)}"
  if "val_loss" in row:
    line += f" val_loss {row['val_loss']:.4f} val_bpb {row['val_bpb']:.3f}"
  return line


def worst_balance(row):
  """(layer, max/mean) of the worst-balanced MoE layer in a metrics row (the
  moe/max_load_over_mean/<layer> values maxlm/model/moe_state.py logs), or None."""
  prefix = "moe/max_load_over_mean/"
  found = [(k[len(prefix):], v) for k, v in row.items() if k.startswith(prefix)]
  return max(found, key=lambda item: (item[1], item[0])) if found else None
