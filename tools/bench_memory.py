"""`maxlm memory`'s estimate against XLA's own accounting of the compiled train step.

For each case (a model size, remat policy, mesh split, attention implementation) the train
step is compiled on fake CPU devices and `compiled.memory_analysis()` gives the bytes per
device: arguments + outputs not aliased to a donated argument + XLA's temporaries. The estimate
(`maxlm/train/memory.py`) of the same stage is printed beside it, with their ratio. float32
models only: XLA on CPU may compute bfloat16 in float32, so a bfloat16 model's CPU figure
says little about an accelerator's.

  python tools/bench_memory.py [--json] [--cases NAME,...]
"""

import argparse
import json
import os
import sys

if __name__ == "__main__":  # before jax is imported: 8 fake CPU devices
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from maxlm import config as config_lib  # noqa: E402
from maxlm.train import memory  # noqa: E402

BASE = ["model.size=demo", "model.dtype=float32", "model.vocab_size=1024", "model.loss_chunk=256",
        "stages.0.seq_len=256", "stages.0.batch=16", "stages.0.block_q=128",
        "stages.0.block_k=128", "stages.0.mesh.data=-1"]
F2048, HEADS8, D512 = ["model.d_ff=2048"], ["model.n_heads=8", "model.n_kv_heads=8"], [
    "model.d_model=512", "model.n_heads=8"]
FSDP4 = ["stages.0.mesh.data=1", "stages.0.mesh.fsdp=4"]
TENSOR2 = ["stages.0.mesh.data=2", "stages.0.mesh.tensor=2"]
CONTEXT2 = ["stages.0.mesh.data=2", "stages.0.mesh.context=2"]
VOCAB16K = ["model.vocab_size=16384", "model.loss_chunk=128"]
REFERENCE = ["stages.0.seq_len=128", "stages.0.batch=32", "stages.0.attention=reference"]
WIDE = ["model.d_model=1024", "model.n_heads=16", "model.n_kv_heads=4", "model.d_ff=2816",
        "model.vocab_size=8192", "stages.0.seq_len=512", "stages.0.batch=4"]


def _cases():
  """{name: (devices, overrides)}."""
  out = {}
  for remat in ("none", "full", "dots", "dots_no_batch"):
    out[f"demo/{remat}"] = (1, [f"model.remat={remat}"])
  for remat in ("none", "full", "dots"):
    out[f"d_ff2048/{remat}"] = (1, [f"model.remat={remat}", *F2048])
    out[f"heads8/{remat}"] = (1, [f"model.remat={remat}", *HEADS8])
    out[f"d512/{remat}"] = (1, [f"model.remat={remat}", *D512])
    out[f"tensor2/{remat}"] = (4, [f"model.remat={remat}", *TENSOR2])
  for remat in ("none", "full"):
    out[f"layers4/{remat}"] = (1, [f"model.remat={remat}", "model.n_layers=4"])
    out[f"vocab16k/{remat}"] = (1, [f"model.remat={remat}", *VOCAB16K])
    out[f"reference/{remat}"] = (1, [f"model.remat={remat}", *REFERENCE])
    out[f"fsdp4/{remat}"] = (4, [f"model.remat={remat}", *FSDP4])
    out[f"context2/{remat}"] = (4, [f"model.remat={remat}", *CONTEXT2])
    out[f"accum2/{remat}"] = (1, [f"model.remat={remat}", "train.grad_accum=2"])
  out["fsdp2_tensor2_context2/full"] = (8, ["model.remat=full", "stages.0.mesh.data=1",
                                            "stages.0.mesh.fsdp=2", "stages.0.mesh.tensor=2",
                                            "stages.0.mesh.context=2"])
  out["wide/full"] = (1, ["model.remat=full", *WIDE])
  out["wide_fsdp4/dots"] = (4, ["model.remat=dots", *WIDE, *FSDP4])
  return out


CASES = _cases()


def measure(name):
  """One case: its XLA bytes per device, the estimate's parts and their ratio."""
  devices, overrides = CASES[name]
  cfg = config_lib.load("configs/demo.yaml", [*BASE, *overrides])
  vocab = cfg.model.vocab_size
  xla = memory.compiled(cfg, 0, devices, vocab)
  est = memory.estimate(cfg, 0, devices, vocab, platform="cpu")
  return {"case": name, "devices": devices, "xla_bytes": xla["total"],
          "estimate_bytes": est["total"], "ratio": round(est["total"] / xla["total"], 4),
          "xla": xla, "estimate": est}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--json", action="store_true")
  ap.add_argument("--cases", help="comma-separated case names (default: all)")
  args = ap.parse_args(argv)
  names = args.cases.split(",") if args.cases else list(CASES)
  rows = []
  for name in names:
    r = measure(name)
    rows.append(r)
    print(f"{name:<28} {r['devices']:>2} dev  XLA {r['xla_bytes'] / 2**20:>8.1f} MiB  "
          f"estimate {r['estimate_bytes'] / 2**20:>8.1f} MiB  ratio {r['ratio']:.3f}",
          file=sys.stderr if args.json else sys.stdout, flush=True)
  worst = max(rows, key=lambda r: abs(r["ratio"] - 1))
  summary = {"cases": len(rows), "worst_case": worst["case"], "worst_ratio": worst["ratio"],
             "min_ratio": min(r["ratio"] for r in rows),
             "max_ratio": max(r["ratio"] for r in rows)}
  if args.json:
    print(json.dumps({"rows": rows, **summary}))
  else:
    print(json.dumps(summary))
  return 0


if __name__ == "__main__":
  sys.exit(main())
