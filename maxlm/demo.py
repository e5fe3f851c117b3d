"""`maxlm demo`: the quickstart's main job on the embedded corpus; reruns reuse finished work.

corpus -> tokenizer + prepare -> ledger -> train through the demo stages (killed once with
SIGKILL and resumed, to show the recomputed steps are bit for bit the same) -> bits per byte
-> three samples -> curves.png.
"""

import pathlib
import signal
import subprocess
import sys
import time

from maxlm import MaxlmError, config as config_lib, io
from maxlm.data import corpus, ledger, loader, prepare, quality, show, store
from maxlm.data.quality import funnel
from maxlm.train import metrics

SAMPLE_PROMPTS = ("def ", "The ", "import ")


# The demo's prose is package documentation, not web text: C4's line cleaning would keep
# under a tenth of it, so the demo shows language ID and dedup only.
DEMO_QUALITY = quality.QualityConfig(filters=False)


def _prepared(data_dir):
  """Whether data_dir holds a complete data dir of this maxlm (one from before data dirs
  listed their files, or had a funnel, is prepared again)."""
  try:
    return "funnel" in store.load_manifest(data_dir)
  except MaxlmError:
    return False


def run(config_name="demo"):
  cfg = config_lib.load(config_name)
  config_path = config_lib.resolve_path(config_name)
  run_dir = pathlib.Path(cfg.run_dir)
  raw_dir = run_dir / "raw"
  if not (raw_dir / "code.jsonl").exists():
    print(f"[1/7] building the embedded corpus from this machine's Python in {raw_dir}")
    corpus.build(str(raw_dir))
  else:
    print(f"[1/7] embedded corpus: reusing {raw_dir}")
  if not _prepared(cfg.data.dir):
    print(f"[2/7] training the tokenizer and preparing {cfg.data.dir}")
    prepare.prepare([str(raw_dir / "prose.jsonl"), str(raw_dir / "code.jsonl")], cfg.data.dir,
                    prepare.Options(vocab_size=4096, overwrite=True, quality=DEMO_QUALITY))
  else:
    print(f"[2/7] prepared data: reusing {cfg.data.dir}")
  data = loader.Data(cfg)
  if data.manifest.get("funnel"):
    print("      the funnel (language ID and dedup; web text also gets the line, quality and "
          "repetition filters: docs/data.md)")
    print("\n".join("      " + line for line in funnel.table(data.manifest["funnel"]).split("\n")))
  for name, s in data.manifest["sources"].items():
    print(f"      {name:<8} {s['documents']:>6,} docs {s['tokens']:>10,} tokens")
  print("[3/7] the ledger of the demo schedule (from the plan, before training)")
  led = ledger.ledger(data.planner)
  print(ledger.format_table(led, {i: s.name or str(i) for i, s in enumerate(cfg.stages)}))
  batch = loader.stage_dataset(data, 0)[0]
  row = show.busiest_row(batch)
  show.save_row_png(batch, row, str(run_dir / "batch.png"), "demo",
                    data.provenance(data.global_batch_pieces(0, 0))[row])
  total = sum(st.num_steps for st in cfg.stages)
  print(f"[4/7] training {total} steps through {len(cfg.stages)} stages in {run_dir}")
  _train_with_one_kill(config_path, run_dir, cfg)
  print("[5/7] bits per byte on held-out documents")
  _cli("eval", str(run_dir))
  print("[6/7] three samples")
  for i, prompt in enumerate(SAMPLE_PROMPTS):
    _cli("generate", str(run_dir), "--prompt", prompt, "--max-tokens", "48", "--seed", str(i))
  print("[7/7] curves")
  _cli("plot", str(run_dir))
  print(f"\ndone. run dir {run_dir}: metrics.jsonl, TensorBoard events, checkpoints/, "
        f"curves.png, batch.png; data {cfg.data.dir}; corpus {raw_dir}")


def _cli(*args):
  _wait(subprocess.Popen([sys.executable, "-m", "maxlm.cli", *args]))


def _wait(proc):
  """Waits for a child; on Ctrl-C (which the child gets too: training saves a checkpoint and
  exits) waits for it to finish instead of killing it, so the demo stays resumable."""
  try:
    code = proc.wait()
  except KeyboardInterrupt:
    _interrupted(proc)
  if code:
    raise MaxlmError(f"`maxlm {' '.join(proc.args[3:5])}` failed (exit code {code})")


def _interrupted(proc):
  proc.wait()
  raise MaxlmError("interrupted; what ran is saved: run `maxlm demo` again to resume") from None


def _train_with_one_kill(config_path, run_dir, cfg):
  command = [sys.executable, "-m", "maxlm.cli", "train", str(config_path)]
  logged = metrics.read_jsonl(str(run_dir))
  total = sum(st.num_steps for st in cfg.stages)
  if not logged:  # a fresh run: kill it once after its first checkpoint, then resume
    kill_after = cfg.train.checkpoint_every + cfg.train.checkpoint_every // 2
    proc = subprocess.Popen(command)
    try:
      while proc.poll() is None and len(metrics.read_jsonl(str(run_dir))) < kill_after:
        time.sleep(0.05)
    except KeyboardInterrupt:
      _interrupted(proc)
    if proc.poll() is None:
      proc.send_signal(signal.SIGKILL)
      proc.wait()
      done = [r["step"] for r in metrics.read_jsonl(str(run_dir)) if "loss" in r]
      print(f"\n      SIGKILL after step {max(done, default=-1)} (as printed); resuming")
  if len({r["step"] for r in metrics.read_jsonl(str(run_dir))}) < total or not (
      run_dir / "checkpoints").exists():
    _wait(subprocess.Popen(command))
  rows = metrics.read_jsonl(str(run_dir))
  first = {}
  repeats = same = 0
  for row in rows:
    if row["step"] in first:
      repeats += 1
      same += (first[row["step"]]["loss"], first[row["step"]]["fingerprint"]) == (
          row["loss"], row["fingerprint"])
    else:
      first[row["step"]] = row
  if repeats and not logged:  # killed and resumed in this call, not an earlier one
    verdict = "bit for bit identical" if same == repeats else "DIFFERENT"
    print(f"      {repeats} steps were recomputed after the kill: losses and batches "
          f"{verdict}")
