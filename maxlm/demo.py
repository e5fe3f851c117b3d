"""`maxlm demo`: the quickstart's main job on the embedded corpus; reruns reuse finished work."""

import pathlib

from maxlm import config as config_lib, io
from maxlm.data import corpus, ledger, loader, prepare, show


def run(config_name="demo"):
  cfg = config_lib.load(config_name)
  run_dir = pathlib.Path(cfg.run_dir)
  raw_dir = run_dir / "raw"
  if not (raw_dir / "code.jsonl").exists():
    print(f"[1/4] building the embedded corpus from this machine's Python in {raw_dir}")
    corpus.build(str(raw_dir))
  else:
    print(f"[1/4] embedded corpus: reusing {raw_dir}")
  if not io.exists(io.join(cfg.data.dir, "manifest.json")):
    print(f"[2/4] training the tokenizer and preparing {cfg.data.dir}")
    manifest = prepare.prepare([str(raw_dir / "prose.jsonl"), str(raw_dir / "code.jsonl")],
                               cfg.data.dir, vocab_size=4096)
  else:
    print(f"[2/4] prepared data: reusing {cfg.data.dir}")
    manifest = None
  data = loader.Data(cfg)
  manifest = manifest or data.manifest
  for name, s in manifest["sources"].items():
    print(f"      {name:<8} {s['documents']:>6,} docs {s['tokens']:>10,} tokens")
  print("[3/4] the ledger of the demo schedule (from the plan, before training)")
  led = ledger.ledger(data.planner)
  print(ledger.format_table(led, {i: s.name or str(i) for i, s in enumerate(cfg.stages)}))
  png = run_dir / "batch.png"
  batch = loader.stage_dataset(data, 0)[0]
  row = show.busiest_row(batch)
  print(f"[4/4] a picture of stage 0, step 0, row {row}: {png}")
  show.save_row_png(batch, row, str(png), "demo stage 0 step 0")
  print(f"done. data: {cfg.data.dir}  corpus: {raw_dir}  batch picture: {png}")
