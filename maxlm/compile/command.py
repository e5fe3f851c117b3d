"""`maxlm compile CONFIG [key=value ...] --target TARGET [--stage S] [--json]`: every stage (or
one) compiled for the target, and the verdict. Per stage: the compiler's bytes a device against
the chip's memory (fits with its headroom, or the excess and the knobs that would fix it), our
estimate beside it (maxlm/train/memory.py), the attention compiled, the collectives, FLOPs (the
compiler's beside our 6N·D + attention count), on TPU the cost model's step time and the
tokens/s and MFU it implies (the compiler's estimate, not a measurement), and the compile time.
Exit 0 when every stage fits, 1 when one does not."""

import json
import sys

from maxlm import MaxlmError, config as config_lib
from maxlm.compile import target as target_lib

FIXES = ("model.remat=full (keep only each layer's input)", "a smaller model.loss_chunk",
         "more fsdp ways (stages.N.mesh.fsdp)",
         "a smaller stages.N.batch or a larger train.grad_accum")


def add_parser(sub, add_config):
  p = sub.add_parser("compile", help="compile each stage for a TPU slice (or GPU node) on this "
                     "machine: bytes a chip, collectives, FLOPs, whether it fits")
  add_config(p)
  p.add_argument("--target", required=True,
                 help="tpu:<chip>:<topology> (tpu:v5e:2x4, tpu:v5p:4x4x4, tpu:v6e:4x4) or "
                      "gpu:<h100|h200>:<partitions>x<hosts>x<gpus>")
  p.add_argument("--stage", type=int, default=None, help="only this stage (0 is the first)")
  p.add_argument("--json", action="store_true", help="print the report as JSON")


def cmd_compile(args):
  from maxlm.compile import stage as compile_stage  # jax: imported when the command runs
  from maxlm.train import memory
  cfg = config_lib.load(args.config, args.overrides)
  target = target_lib.parse(args.target)
  if args.stage is not None and not 0 <= args.stage < len(cfg.stages):
    raise MaxlmError(f"--stage {args.stage}: the config has stages 0..{len(cfg.stages) - 1}")
  vocab = cfg.model.vocab_size
  if not vocab:
    raise MaxlmError("maxlm compile needs model.vocab_size (the data dir is not read)")
  devices = target_lib.devices(target)
  stages = [args.stage] if args.stage is not None else range(len(cfg.stages))
  results = []
  for s in stages:
    out = compile_stage.compile_stage(cfg, s, vocab, devices, target.platform)
    est = memory.estimate(cfg, s, len(devices), vocab, target.platform)
    out.update(hbm_bytes=target.hbm_bytes, fits=out["compiled"]["total"] <= target.hbm_bytes,
               estimate_total=est["total"], **_speed(out, target, len(devices)))
    results.append(out)
    if not args.json:
      print(_line(out, target), flush=True)
  if args.json:
    print(json.dumps({"target": target.name, "devices": len(devices), "stages": results}))
  bad = [r for r in results if not r["fits"]]
  for r in bad:
    print(f"stage {r['name']} does not fit: {_gib(r['compiled']['total'])} GiB a chip of "
          f"{_gib(r['hbm_bytes'])} ({_gib(r['compiled']['total'] - r['hbm_bytes'])} GiB over); "
          f"try {'; or '.join(_fixes(cfg))}", file=sys.stderr)
  return 1 if bad else 0


def _fixes(cfg):
  """FIXES without the remat advice when every layer already keeps only its input."""
  return [f for f in FIXES if not (cfg.model.remat == "full" and f.startswith("model.remat"))]


def _speed(out, target, n_devices):
  """The cost model's step time and what it implies, where it has a sound one (TPU)."""
  seconds = out["cost"].get("optimal_seconds")
  peak = target_lib.TPU_PEAK_BF16.get(target.chip)
  if not seconds or not peak:
    return {}
  tokens = out["batch"] * out["seq_len"]
  mfu = out["flops"]["analytic"] / seconds / (peak * n_devices)
  if mfu > 1:  # the cost model counted a scanned layer loop once: no step time to quote
    return {}
  return {"model_step_s": seconds, "model_tokens_per_s": tokens / seconds, "model_mfu": mfu}


def _gib(n):
  return f"{n / 2**30:.2f}"


def _line(r, target):
  c = r["compiled"]
  room = target.hbm_bytes - c["total"]
  verdict = (f"fits, {_gib(room)} GiB ({room / target.hbm_bytes:.0%}) free" if r["fits"] else
             f"DOES NOT FIT by {_gib(-room)} GiB" + (" (the compiler refused it: its "
                                                     "temporaries alone)" if c.get("refused")
                                                     else ""))
  comms = ", ".join(f"{k} {v['count']}x {v['bytes'] / 2**20:.0f} MiB"
                    for k, v in r["collectives"].items() if v["count"]) or "none"
  speed = (f"; cost model {r['model_step_s'] * 1e3:.0f} ms a step, "
           f"{r['model_tokens_per_s']:,.0f} tokens/s, MFU {r['model_mfu']:.0%} (the compiler's "
           "estimate)" if "model_step_s" in r else "")
  kernels = f"attention {r['attention']}" + (f", {r['sparse']}" if r["sparse"] != "dense"
                                              else "") + (f", experts {r['grouped']}"
                                                          if r["grouped"] else "")
  flops = f"{r['flops']['analytic'] / 1e12:.1f} TFLOP a step (analytic)" + (
      f", the compiler counts {r['cost']['flops'] / 1e12:.1f} a device"
      if r["cost"].get("flops") else "")
  return (f"stage {r['name']} (L={r['seq_len']}, batch {r['batch']}, {r['objective']}, "
          f"{kernels}): {_gib(c['total'])} GiB a chip of "
          f"{_gib(target.hbm_bytes)} — {verdict}; estimate {_gib(r['estimate_total'])} GiB "
          f"({r['estimate_total'] / c['total']:.2f}x); arguments {_gib(c['arguments'])}, "
          f"temporaries {_gib(c['temporaries'])}; collectives: {comms}; "
          f"{flops}{speed}; compiled in "
          f"{r['compile_s']:.0f} s")
