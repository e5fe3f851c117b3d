"""What each step leaves behind: its metrics.jsonl row (the step's metrics, throughput, MFU,
the batch fingerprint, tokens per source, a loss spike when one is flagged) and the console's
progress line. Tested through the runs that write the rows (tests/test_train_mfu.py: throughput
and MFU; tests/test_train_spikes.py: the flagged spike; tests/test_train_console.py: the
progress line)."""

import jax

from maxlm.model import build
from maxlm.parallel import distributed, peaks
from maxlm.train import console, spikes


class StepLog:
  """One per run: the spike detector's window, the ETA, the steps run in this call."""

  def __init__(self, config, sched, log, spike_state=None, first_row=None):
    self.config, self.sched, self.log = config, sched, log
    self.peak, _ = peaks.per_device(config.model.dtype)  # MFU's denominator: x the device count
    self.detector = spikes.Detector(config.train.spike_window, config.train.spike_sigmas,
                                    spike_state)
    self.eta = console.Eta((st.num_steps, st.batch * st.seq_len) for st in config.stages)
    self.first_row = dict(first_row or {})  # once, in the first row this call writes
    self.ran, self.last_row = 0, {}

  def row(self, s, k, metrics, batch, seconds, tokens, model):
    """The row of global step g = (s, k)."""
    g, seq_len = self.sched.offset(s) + k, self.config.stages[s].seq_len
    real = int((batch["segment_ids"] > 0).sum()) * jax.process_count()
    flops = build.batch_flops_per_token(model.cfg, seq_len, batch["segment_ids"])
    row = {"stage": s, "stage_step": k, **metrics, "tokens_per_s": real / seconds,
           "mfu": peaks.mfu(flops, real, seconds, self.peak, jax.device_count()),
           "fingerprint": distributed.fingerprint(batch, g), **tokens, **self.first_row}
    self.first_row = {}
    spike = self.detector.observe(s, metrics["loss"])
    if spike:
      row["spike"] = spike
      t = self.config.train
      self.log(f"loss spike at step {g}: {metrics['loss']:.4f} > {spike['threshold']:.4f} "
               f"(mean + {t.spike_sigmas:g} std of the last {t.spike_window} steps); "
               f"maxlm trace {self.config.run_dir} --step {g}")
    return row

  def done(self, s, k, row):
    """Step (s, k) is written: count it and show the progress line. Tested through the runs that write the rows (tests/test_train_mfu.py: throughput
and MFU; tests/test_train_spikes.py: the flagged spike; tests/test_train_console.py: the
progress line)."""
    g, steps = self.sched.offset(s) + k, self.config.stages[s].num_steps
    self.ran, self.last_row = self.ran + 1, row
    self.eta.step(g)
    self.log.progress(console.progress_line(s, k, steps, g, self.sched.total, row,
                                            self.eta.left(g)),
                      keep="val_loss" in row or k + 1 == steps)
