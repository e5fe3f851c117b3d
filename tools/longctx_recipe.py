"""The long-context recipe of docs/schedule.md, end to end and measured: configs/
longctx_recipe.yaml (the demo model through 256 -> 1K -> 4K -> 16K, RoPE extended with YaRN at
each step) on the demo corpus plus synthetic retrieval documents sized to each stage, the
retrieval grids scored as it trains, and the ablations branched off before the last stage.

  python tools/longctx_recipe.py --json                  # the numbers in docs/schedule.md
  python tools/longctx_recipe.py --json --ablations      # and the ablation table
  python tools/longctx_recipe.py --json --scale 0.02 --stages 2 --ablations --corpus-bytes \
      150000 --vocab 512 --samples 1 --workdir runs/doc/longctx        # the docs test's size

1. Data: the demo corpus (maxlm/data/corpus.py, --corpus-bytes per source) and one retrieval
   source per stage (tools/make_passkey_source.py: passkey, multikey and vartrack documents
   whose filler is the corpus's prose, short enough that a document fits its stage's rows
   whole), prepared together (--filters off --dedup off: the filler repeats the prose).
2. Training, stage by stage (`maxlm train --stop-after`), with train.eval_passkey scoring the
   three tasks at every evaluation on the stage's own L and RoPE, and at 2L (extrapolation):
   metrics.jsonl holds retrieval accuracy against steps, `maxlm plot` draws it.
3. After each stage, `maxlm eval --stage S --passkey` of its last checkpoint at the stage's L
   and RoPE: the grids {task: {length: {depth: accuracy}}} for prompts of 128.. up to L and
   of 2L (extrapolation), --samples prompts per cell, and held-out loss by position (prose).
4. --ablations: the run is copied before its last stage and that stage trained again with
   linear position interpolation instead of YaRN, with no RoPE scaling, and without the
   sample-level mask (data.document_mask=false); and the whole schedule trained again with
   its last stage split into an indexer warm-up and a sparse stage (a run without sparse
   stages has no indexer in its state to branch from). Each branch's grids and position
   losses beside the recipe's.

After each stage it also probes for an induction head (copying a repeated sequence of random
tokens): retrieval is copying, so a model without one scores 0 in every cell.

The last line of --json is {"stages": [{"name", "seq_len", "step", "tasks", "positions",
"induction"}],
"curve": [{"step", TASK: mean accuracy at the stage's L}], "ablations": {...},
"cpu_minutes", "wall_minutes"}. --require X exits 1 unless the passkey accuracy at the last
trained stage's L, averaged over depths, is at least X.
"""

import argparse
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
CONFIG = os.path.join(REPO, "configs", "longctx_recipe.yaml")
sys.path.insert(0, os.path.join(REPO, "tools"))
TASKS = ("passkey", "multikey", "vartrack")
# characters of filler per retrieval document, per stage: a document fits its stage's rows
# whole (the demo tokenizer reads ~2-3 characters a token on this text)
FILLER = ((0, 150), (150, 1500), (1500, 6000), (6000, 24000))
DOCS = (8000, 3000, 800, 250)


def cli(*args):
  proc = subprocess.run([sys.executable, "-m", "maxlm.cli", *map(str, args)],
                        capture_output=True, text=True)
  if proc.returncode:
    raise SystemExit(f"maxlm {args[0]} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
  return proc.stdout


def build_data(work, corpus_bytes, vocab, docs_scale):
  """The prepared data dir: prose, code and retrieval sources passkey_s0.. (one per stage)."""
  import make_passkey_source
  from maxlm.data import corpus
  data = os.path.join(work, "data")
  if os.path.exists(os.path.join(data, "manifest.json")):
    return data
  raw = os.path.join(work, "raw")
  prose, code = corpus.build(raw, bytes_per_source=corpus_bytes)
  sources = []
  for s, ((lo, hi), n) in enumerate(zip(FILLER, DOCS)):
    sources.append(os.path.join(raw, f"passkey_s{s}.jsonl"))
    with contextlib.redirect_stdout(sys.stderr):  # stdout is the --json result only
      make_passkey_source.main([
          "--docs", str(max(20, round(n * docs_scale))), "--from", prose, "--out", sources[-1],
          "--tasks", ",".join(TASKS), "--min-chars", str(lo), "--max-chars", str(hi),
          "--seed", str(s), "--source", f"passkey_s{s}"])
  cli("prepare", prose, code, *sources, "--out", data, "--vocab-size", vocab, "--filters",
      "off", "--dedup", "off", "--lang", "any")
  return data


def stage_grid(run, config, s, samples):
  """{name, seq_len, step, tasks: {task: {length: {depth: accuracy}}}, positions} of the run's
  latest checkpoint scored at stage s's L and RoPE, prompts of 128.. up to L and 2L."""
  from maxlm.eval import passkey
  stage = config.stages[s]
  lengths = passkey.lengths_up_to(stage.seq_len) + [2 * stage.seq_len]
  out = json.loads(cli("eval", run, "--stage", s, "--json", "--passkey", "--passkey-tasks",
                       ",".join(TASKS), "--passkey-samples", samples, "--passkey-lengths",
                       ",".join(map(str, lengths))).strip().splitlines()[-1])
  prose = out["positions"].get("prose", {})
  return {"name": stage.name, "seq_len": stage.seq_len, "step": out["step"],
          "tasks": {t: out[t] for t in TASKS},
          "positions": {b: round(e["loss"], 4) for b, e in prose.items()}}


def probe_ids(bos, vocab, n=60, rows=8, low=16):
  """[rows, 2n + 1] ids of the induction probe: BOS, then n seeded random ids at or above
  `low` (past the special and marker ids) written twice."""
  import numpy as np
  rng = np.random.default_rng(0)
  seqs = [rng.integers(low, vocab, n).tolist() for _ in range(rows)]
  return np.array([[bos] + seq + seq for seq in seqs])


INDUCTION_PROBE = r"""
import json, sys, numpy as np, jax
from maxlm.train import open_run
from maxlm.eval import passkey
sys.path.insert(0, sys.argv[2])
import longctx_recipe
config, data, s, mesh, model, params, step, _ = open_run.open_run(sys.argv[1])
ids = longctx_recipe.probe_ids(data.special.bos, model.cfg.vocab_size)
(rows, width), n = ids.shape, ids.shape[1] // 2
batch = {f: np.zeros((rows, width - 1), np.int32) for f in ("loss_mask", "roles")}
batch.update(inputs=ids[:, :-1], targets=ids[:, 1:], segment_ids=np.ones((rows, width - 1)),
             positions=np.tile(np.arange(width - 1), (rows, 1)))
batch = {k: v.astype(np.int32) for k, v in batch.items()}
where = np.tile(np.arange(n + 1, 2 * n)[None], (rows, 1)).astype(np.int32)
with mesh:
  got = np.asarray(jax.jit(passkey.make_predict(model, config.rules))(params, batch, where))
print(json.dumps(float((got == np.take_along_axis(batch["targets"], where, 1)).mean())))
"""


def induction(run):
  """Argmax accuracy on the second copy of a repeated sequence of random tokens (8 rows of
  60): near 0 without an induction head, near 1 with one. Retrieval needs one: a model that
  cannot copy a repeated sequence cannot copy a key."""
  path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
  proc = subprocess.run([sys.executable, "-c", INDUCTION_PROBE, run, os.path.join(REPO, "tools")],
                        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": path})
  if proc.returncode:
    raise SystemExit(f"the induction probe failed:\n{proc.stderr[-2000:]}")
  return round(json.loads(proc.stdout.strip().splitlines()[-1]), 4)


def curve(run, config):
  """[{step, TASK: mean accuracy over depths at the stage's L}] of every evaluation."""
  from maxlm.train import metrics, schedule
  sched = schedule.Schedule(config)
  out = []
  for r in metrics.read_jsonl(run):
    if "passkey/128" not in r:
      continue
    L = config.stages[sched.locate(r["step"])[0]].seq_len
    out.append({"step": r["step"], "seq_len": L,
                **{t: r[f"{t}/{L}"] for t in TASKS if f"{t}/{L}" in r}})
  return out


def _rope(stage, **changes):
  return {**stage, "rope": {**stage["rope"], **changes}}


def _sparse(stage):
  """The last stage as an indexer warm-up (a quarter of its steps) then a sparse stage."""
  warm = max(1, stage["steps"] // 4)
  return [{**stage, "name": stage["name"] + "_warmup", "steps": warm,
           "sparse": {**stage["sparse"], "mode": "indexer_warmup"}},
          {**stage, "name": stage["name"] + "_sparse", "steps": stage["steps"] - warm,
           "sparse": {**stage["sparse"], "mode": "sparse"}}]


ABLATIONS = {  # name: the config dict -> the branch's config dict (its last stage changed)
    "rope_linear": lambda c: {**c, "stages": c["stages"][:-1] + [_rope(c["stages"][-1],
                                                                       scaling="linear")]},
    "rope_none": lambda c: {**c, "stages": c["stages"][:-1] + [_rope(c["stages"][-1],
                                                                     scaling="none", factor=1)]},
    "no_document_mask": lambda c: {**c, "data": {**c["data"], "document_mask": False}},
    # a run with no sparse stage has no indexer in its train state, so this branch trains
    # the whole schedule again, from the same seed and batches, its last stage made sparse
    "sparse": lambda c: {**c, "stages": c["stages"][:-1] + _sparse(c["stages"][-1])},
}
FROM_SCRATCH = {"sparse"}
BRANCH_POINT = "branch_point"  # the run copied before its last stage


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--workdir", default=os.path.join(REPO, "runs", "longctx"))
  p.add_argument("--scale", type=float, default=1.0, help="multiplies every stage's steps")
  p.add_argument("--stages", type=int, default=0, help="train only the first N stages (0: all)")
  p.add_argument("--corpus-bytes", type=int, default=3_000_000, help="per demo source")
  p.add_argument("--vocab", type=int, default=4096)
  p.add_argument("--ablations", action="store_true", help="branch before the last stage")
  p.add_argument("--require", type=float, help="exit 1 below this passkey accuracy at L")
  p.add_argument("--samples", type=int, default=4, help="prompts per cell of the stage grids")
  p.add_argument("--json", action="store_true")
  args = p.parse_args()
  from maxlm import config as config_lib
  start = time.time()
  data = build_data(args.workdir, args.corpus_bytes, args.vocab, min(1.0, args.scale))
  cfg = config_lib.load(CONFIG)
  n = len(cfg.stages) if args.stages <= 0 else min(args.stages, len(cfg.stages))
  steps = [max(1, round(st.num_steps * args.scale)) for st in cfg.stages]
  if args.ablations and n < 2:
    p.error("--ablations branches before the last stage: it needs --stages 2 or more")
  run = os.path.join(args.workdir, "run")
  shutil.rmtree(run, ignore_errors=True)  # a fresh run each time (the data is kept)
  base = [f"data.dir={data}", *(f"stages.{i}.steps={k}" for i, k in enumerate(steps))]
  result = {"config": "configs/longctx_recipe.yaml", "scale": args.scale, "stages": []}
  for s in range(n):
    if s == n - 1 and args.ablations:
      shutil.rmtree(os.path.join(args.workdir, BRANCH_POINT), ignore_errors=True)
      shutil.copytree(run, os.path.join(args.workdir, BRANCH_POINT))
    cli("train", CONFIG, *base, f"run_dir={run}", "--stop-after", steps[s])
    cfg = config_lib.load(os.path.join(run, "config.yaml"))
    result["stages"].append({**stage_grid(run, cfg, s, args.samples),
                             "induction": induction(run)})
  result["curve"] = curve(run, cfg)
  if args.ablations:
    result["ablations"] = ablations(args.workdir, cfg, n, args.samples)
  cli("plot", run)
  used = resource.getrusage(resource.RUSAGE_CHILDREN)
  result["cpu_minutes"] = round((used.ru_utime + used.ru_stime) / 60, 1)
  result["wall_minutes"] = round((time.time() - start) / 60, 1)
  report(result, args.json)
  if args.require is not None:
    last = result["stages"][-1]
    row = last["tasks"]["passkey"][str(last["seq_len"])]
    accuracy = sum(row.values()) / len(row)
    if accuracy < args.require:
      print(f"passkey accuracy at L={last['seq_len']} is {accuracy:.2f}, below --require "
            f"{args.require}", file=sys.stderr)
      return 1
  return 0


def ablations(work, cfg, n, samples):
  """{name: the last stage's summary} of each branch, trained from the copy of the run made
  before its last stage (the first n stages of `cfg`)."""
  import yaml
  from maxlm import config as config_lib
  base = config_lib.to_dict(cfg)
  base["stages"] = base["stages"][:n]
  point = os.path.join(work, BRANCH_POINT)
  out = {}
  for name, make in ABLATIONS.items():
    run = os.path.join(work, name)
    shutil.rmtree(run, ignore_errors=True)
    branch = make(base)
    if name not in FROM_SCRATCH:
      shutil.copytree(point, run)
    path = os.path.join(work, f"{name}.yaml")
    with open(path, "w") as f:
      yaml.safe_dump({**branch, "run_dir": run}, f)
    cli("train", path)
    loaded = config_lib.load(path)
    out[name] = stage_grid(run, loaded, len(loaded.stages) - 1, samples)
  return out


def report(result, as_json):
  if as_json:
    print(json.dumps(result))
    return
  for st in result["stages"]:
    print(f"{st['name']} (L={st['seq_len']}), step {st['step']}: loss by position "
          f"{st['positions']}")
    for task, grid in st["tasks"].items():
      for length, row in grid.items():
        print(f"  {task:<9}{length:>7}: " + " ".join(f"{d}%={a:.2f}" for d, a in row.items()))
  print(f"{result['cpu_minutes']} CPU minutes, {result['wall_minutes']} minutes")


if __name__ == "__main__":
  sys.exit(main())
