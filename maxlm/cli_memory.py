"""`maxlm memory CONFIG`: the per-device memory estimate of every stage, for the config's mesh
(maxlm/train/memory.py), and with --compiled XLA's accounting of the compiled step beside it.
Memory counts every parameter (all experts of an MoE model); the total and the active count
(what a token goes through, which FLOPs count) are printed below the table. Tested as a user
runs it (tests/test_train_memory.py: the table, --json and its refusals)."""

import json

from maxlm import MaxlmError, config as config_lib, io


def add_parser(sub, add_config):
  p = sub.add_parser("memory", help="per-device memory estimate of each stage on its mesh: "
                     "params, optimizer, gradients, activations, attention, logits")
  add_config(p)
  p.add_argument("--devices", type=int, help="devices the job runs on (default: this machine's)")
  p.add_argument("--platform", choices=("cpu", "gpu", "tpu"),
                 help="where it runs, which decides attention=auto (default: this machine's)")
  p.add_argument("--vocab", type=int, help="vocabulary size, if neither model.vocab_size nor "
                 "the data dir's manifest gives it")
  p.add_argument("--compiled", action="store_true",
                 help="also compile each stage's train step on this machine's first --devices "
                      "devices and print XLA's accounting of it")
  p.add_argument("--json", action="store_true", help="print the estimate as JSON, not a table")


def cmd_memory(args):
  import jax
  from maxlm.train import memory
  cfg = config_lib.load(args.config, args.overrides)
  devices = args.devices or len(jax.devices())
  if devices < 1:
    raise MaxlmError(f"--devices must be >= 1, got {devices}")
  vocab = args.vocab or cfg.model.vocab_size or _manifest_vocab(cfg)
  estimates = [memory.estimate(cfg, s, devices, vocab, args.platform)
               for s in range(len(cfg.stages))]
  counts = memory.param_counts(cfg, vocab)
  compiled = ([memory.compiled(cfg, s, devices, vocab) for s in range(len(cfg.stages))]
              if args.compiled else None)
  if args.json:
    print(json.dumps({"devices": devices, "vocab": vocab, "params": counts, "stages": [
        {"stage": s, "estimate": e, **({"compiled": compiled[s]} if compiled else {})}
        for s, e in enumerate(estimates)]}))
    return
  print(memory.format_table(cfg, estimates, devices, counts))
  for s, c in enumerate(compiled or ()):
    print(f"stage {cfg.stages[s].name or s}: XLA's accounting of the compiled step "
          f"{c['total'] / 2**30:.3f} GiB a device (estimate / XLA = "
          f"{estimates[s]['total'] / c['total']:.2f})")


def _manifest_vocab(cfg):
  path = io.join(cfg.data.dir, "manifest.json")
  try:
    return int(json.loads(io.read_bytes(path))["vocab_size"])
  except (MaxlmError, OSError, ValueError, KeyError):
    raise MaxlmError(f"the vocabulary size is unknown: set model.vocab_size, pass --vocab N, or "
                     f"prepare data.dir ({path} is not readable)") from None
