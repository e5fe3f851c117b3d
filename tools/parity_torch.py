"""maxlm's training steps against a reference trainer: transformers' `LlamaForCausalLM` with
`torch.optim.AdamW`, from the same weights, on the same batches, in float32.

  python tools/parity_torch.py [--steps 20] [--json] [--data DIR] [--work DIR]

Needs the `hf` extra (torch, transformers). What it does, side by side in one run:

1. Data: the demo corpus (maxlm.data.corpus: the standard library's .py files and installed
   packages' docs, real text on this machine), prepared with a 1024-piece tokenizer; or --data,
   a prepared data dir.
2. Step-0 weights: a tiny Llama (2 layers, d 64, 4 query / 2 KV heads) initialised by maxlm
   exactly as a run does (`build.init_params` with the config's seed), written as a transformers
   folder by the export's own writer. maxlm trains from that folder (`init.from`), so both sides
   start from the same bytes.
3. maxlm: `maxlm train` of one stage (L 64, 8 rows, --steps steps, warmup 5 then cosine,
   weight decay 0.1, clip 0.5: the grad norm is 0.45-0.8 here, so steps are clipped and
   unclipped) writes metrics.jsonl: loss, grad_norm (before clipping) and lr per step.
4. Reference: the same stage's batches (`loader.stage_dataset`, what `maxlm batches` writes;
   each batch's fingerprint is checked against the one maxlm logged for that step) go to
   transformers' eager Llama with a 4D additive mask (block-diagonal causal by segment id) and
   the batch's position ids; the loss is torch's cross-entropy, mean over the loss-masked
   positions of the whole batch (ignore_index); `clip_grad_norm_` clips to 0.5 and returns
   the norm; AdamW with the same betas and eps, weight decay on the decay group only (every
   matrix but the embedding and the head, the usual group; the tool reports whether
   maxlm's optimizer mask decays exactly those), and a LambdaLR with the schedule written out
   here in plain Python (not maxlm's optax code).
5. Compared per step: loss, grad norm and lr, as |maxlm - torch| / |torch|; and after the
   last step every tensor of maxlm's final checkpoint against torch's, as
   ||maxlm - torch|| / ||torch|| (catches a wrong decay mask, which moves loss little).

Known difference by construction: torch's `clip_grad_norm_` scales by clip / (norm + 1e-6),
optax by clip / norm, a 1e-6 / norm relative difference on clipped steps.
"""

import argparse
import json
import math
import os
import shutil
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maxlm import config as config_lib  # noqa: E402

MODEL = {"size": "tiny", "dtype": "float32", "remat": "none", "d_model": 64, "n_layers": 2,
         "n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "d_ff": 128, "loss_chunk": 32}
TRAIN = {"lr": 3e-3, "warmup_steps": 5, "schedule": "cosine", "min_lr_ratio": 0.1,
         "weight_decay": 0.1, "clip": 0.5, "b1": 0.9, "b2": 0.95, "eps": 1e-8,
         "eval_every": 0, "eval_tokens": 64, "spike_window": 0}


def prepare_data(root):
  """A prepared data dir of real text on this machine (the demo corpus, smaller)."""
  from maxlm.data import corpus, prepare
  raw = corpus.build(os.path.join(root, "raw"), bytes_per_source=300_000)
  out = os.path.join(root, "data")
  prepare.prepare(raw, out, prepare.Options(vocab_size=1024, progress=False), log=lambda *_: None)
  return out


def make_config(data_dir, run_dir, steps, init_from=None, **train):
  raw = {"seed": 0, "run_dir": str(run_dir), "data": {"dir": str(data_dir), "overlap": 8},
         "stages": [{"seq_len": 64, "batch": 8, "steps": steps}],
         "model": MODEL, "train": {**TRAIN, "checkpoint_every": steps, **train}}
  if init_from:
    raw["init"] = {"from": str(init_from)}
  return config_lib.from_dict(raw)


def write_step0(config, folder):
  """maxlm's initial parameters (as a run initialises them) as a transformers folder; returns
  (maxlm params, ModelConfig with the vocabulary resolved)."""
  import dataclasses
  import jax
  from maxlm.data import loader
  from maxlm.data import tokenizer as tok_lib
  from maxlm.interop import export, hf_config, parity
  from maxlm.model import build
  from maxlm.parallel import mesh as mesh_lib
  data = loader.Data(config)
  vocab = int(data.manifest["vocab_size"])
  stage = config.stages[0]
  mesh = mesh_lib.make_mesh(stage.mesh)
  model = build.model_for(config, 0, mesh, vocab)
  params = jax.tree_util.tree_map(np.asarray, build.init_params(
      model, jax.random.key(config.seed), mesh, config.rules, stage.seq_len))
  model_cfg = dataclasses.replace(config.model, vocab_size=vocab)
  special = tok_lib.SpecialIds(**data.manifest["special_ids"])
  meta = {"stage": 0, "stage_step": 0, "global_step": 0}
  hf = hf_config.llama_config(config, meta, vocab, special, "float32")
  os.makedirs(folder, exist_ok=True)
  export.write_model(str(folder), hf, special, parity.ParamsSource(model_cfg, params))
  return params, model_cfg


def maxlm_decayed(params, model_cfg, train):
  """The transformers names of the tensors maxlm's optimizer decays."""
  import jax
  from maxlm.interop import layout, tensor_map
  from maxlm.train import optimizer
  mask = optimizer.decay_mask(params, train.decay_embeddings)
  names = set()
  for leaf in layout.leaves(model_cfg):
    node = mask
    for key in leaf.path:
      node = node[key]
    if node:
      for i in range(leaf.shape[0]) if leaf.per_layer else [None]:
        names.update(tensor_map.hf_layer_name(i, n) if i is not None else n for n in leaf.names)
  return names


def run_maxlm(config):
  """Trains the config's run; returns metrics.jsonl's rows."""
  from maxlm.train import loop
  loop.train(config, log=lambda *_: None)
  with open(os.path.join(config.run_dir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def batches(config, steps):
  """Stage 0's global batches 0..steps-1, as `maxlm batches` makes them."""
  from maxlm.data import loader
  ds = loader.stage_dataset(loader.Data(config), 0)
  return [ds[k] for k in range(steps)]


def reference_lr(train, total, step):
  """The schedule as docs/config.md states it: a linear warmup from lr / warmup_steps at step
  0 to lr at step warmup_steps, then cosine to lr * min_lr_ratio at step `total`, or WSD: lr
  until its last round(total * decay_fraction) steps of the whole run (at least 1, none of
  them before warmup has reached lr), which fall linearly to lr * min_lr_ratio at the last."""
  peak, floor = train.lr, train.lr * train.min_lr_ratio
  warmup = min(train.warmup_steps, max(total - 1, 0))
  if step < warmup:
    return peak / warmup + (peak - peak / warmup) * step / warmup
  if train.schedule == "cosine":
    t, rest = step - warmup, max(total - warmup, 1)
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * min(t, rest) / rest))
  decaying = min(max(round(total * train.decay_fraction), 1), total - 1 - warmup)
  first_decaying = total - decaying
  if step < first_decaying:
    return peak
  return peak + (floor - peak) * (step - first_decaying + 1) / decaying


def attention_mask(segment_ids_BxL, dtype):
  """[B, 1, L, L] additive: 0 where query i sees key j (j <= i, same non-zero segment), the
  dtype's minimum elsewhere; a padding position (segment 0) sees itself only (its loss is
  masked, and a row with no visible key would make NaNs)."""
  import torch
  seg = torch.as_tensor(segment_ids_BxL)
  length = seg.shape[1]
  causal = torch.ones(length, length, dtype=torch.bool).tril()
  same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)
  seen = (same & causal) | torch.eye(length, dtype=torch.bool)
  return torch.where(seen, 0.0, torch.finfo(dtype).min).to(dtype)[:, None]


def torch_decayed(model, decay_embeddings):
  """The usual AdamW decay group: every matrix (norm scales are vectors), the embedding table
  and head only when `decay_embeddings`."""
  skip = () if decay_embeddings else ("model.embed_tokens.weight", "lm_head.weight")
  return {n for n, p in model.named_parameters() if p.ndim >= 2 and n not in skip}


def run_torch(folder, train, total, batches_, fingerprints=None, decayed=None):
  """Trains transformers' Llama from `folder` on `batches_` (weight decay on `decayed`, by
  default `torch_decayed`); returns (per-step rows, final {name: numpy array}, decayed)."""
  import torch
  import transformers
  from maxlm.parallel import distributed
  transformers.utils.logging.disable_progress_bar()
  model = transformers.LlamaForCausalLM.from_pretrained(
      str(folder), dtype=torch.float32, attn_implementation="eager")
  model.train()
  named = dict(model.named_parameters())
  decayed = torch_decayed(model, train.decay_embeddings) if decayed is None else decayed
  groups = [{"params": [p for n, p in named.items() if n in decayed],
             "weight_decay": train.weight_decay},
            {"params": [p for n, p in named.items() if n not in decayed], "weight_decay": 0.0}]
  opt = torch.optim.AdamW(groups, lr=train.lr, betas=(train.b1, train.b2), eps=train.eps)
  sched = torch.optim.lr_scheduler.LambdaLR(
      opt, lambda k: reference_lr(train, total, k) / train.lr)
  rows = []
  for k, batch in enumerate(batches_):
    if fingerprints is not None and distributed.fingerprint(batch, k) != fingerprints[k]:
      raise AssertionError(f"batch {k} is not the one maxlm trained on (fingerprint)")
    lr = opt.param_groups[0]["lr"]
    logits = model(input_ids=torch.as_tensor(batch["inputs"]).long(),
                   position_ids=torch.as_tensor(batch["positions"]).long(),
                   attention_mask=attention_mask(batch["segment_ids"], torch.float32),
                   use_cache=False).logits
    labels = np.where(batch["loss_mask"] > 0, batch["targets"], -100)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             torch.as_tensor(labels).long().reshape(-1),
                                             ignore_index=-100)
    opt.zero_grad()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), train.clip)
    opt.step()
    sched.step()
    rows.append({"loss": float(loss.detach()), "grad_norm": float(norm), "lr": lr})
  return rows, {n: p.detach().numpy().copy() for n, p in named.items()}, decayed


def rel(a, b):
  return abs(a - b) / max(abs(b), 1e-30)


def compare(ours, theirs, clip, run_dir=None, final=None):
  """The per-step table and the worst relative differences (maxlm vs torch)."""
  steps = [{"step": k, "maxlm_loss": o["loss"], "torch_loss": t["loss"],
            "rel_loss_diff": rel(o["loss"], t["loss"]), "maxlm_grad_norm": o["grad_norm"],
            "torch_grad_norm": t["grad_norm"],
            "rel_grad_norm_diff": rel(o["grad_norm"], t["grad_norm"]),
            "maxlm_lr": o["lr"], "torch_lr": t["lr"], "rel_lr_diff": rel(o["lr"], t["lr"])}
           for k, (o, t) in enumerate(zip(ours, theirs))]
  out = {"steps": len(steps),
         "max_rel_loss_diff": max(s["rel_loss_diff"] for s in steps),
         "max_rel_grad_norm_diff": max(s["rel_grad_norm_diff"] for s in steps),
         "max_rel_lr_diff": max(s["rel_lr_diff"] for s in steps),
         "clipped_steps": sum(s["torch_grad_norm"] > clip for s in steps)}
  if run_dir is not None:
    from maxlm.interop import run_reader
    reader = run_reader.RunCheckpoint(run_dir, log=lambda *_: None)
    diffs = {n: float(np.linalg.norm(reader.get(n) - final[n]) / np.linalg.norm(final[n]))
             for n in reader.names()}
    worst = max(diffs, key=diffs.get)
    out.update(max_rel_param_diff=diffs[worst], worst_param=worst)
  out["per_step"] = steps
  return out


def run(steps, work, data_dir=None, log=print):
  """Everything above, in `work`; returns compare()'s dict."""
  data_dir = data_dir or prepare_data(work)
  folder = os.path.join(work, "step0")
  probe = make_config(data_dir, os.path.join(work, "unused"), steps)
  params, model_cfg = write_step0(probe, folder)
  config = make_config(data_dir, os.path.join(work, "run"), steps, init_from=folder)
  shutil.rmtree(config.run_dir, ignore_errors=True)  # a run left by an earlier call would resume
  log(f"maxlm: training {steps} steps from {folder}")
  ours = run_maxlm(config)
  log(f"torch: {steps} steps")
  theirs, final, decayed = run_torch(folder, config.train, steps, batches(config, steps),
                                     [r["fingerprint"] for r in ours])
  ours_decayed = maxlm_decayed(params, model_cfg, config.train)
  return {"decay_masks_equal": ours_decayed == decayed, "decayed_tensors": len(decayed),
          **compare(ours, theirs, config.train.clip, config.run_dir, final)}


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--steps", type=int, default=20)
  ap.add_argument("--json", action="store_true")
  ap.add_argument("--data", help="a prepared data dir (default: the demo corpus, prepared)")
  ap.add_argument("--work", help="where to write (default: a temporary folder)")
  args = ap.parse_args()
  log = (lambda *_: None) if args.json else print
  with tempfile.TemporaryDirectory(prefix="parity-torch-") as tmp:
    result = run(args.steps, args.work or tmp, args.data, log)
  if args.json:
    print(json.dumps(result, indent=1))
    return
  print(f"{'step':>4} {'maxlm loss':>12} {'torch loss':>12} {'rel':>9} {'maxlm |g|':>10} "
        f"{'torch |g|':>10} {'rel':>9} {'rel lr':>9}")
  for s in result["per_step"]:
    print(f"{s['step']:>4} {s['maxlm_loss']:>12.6f} {s['torch_loss']:>12.6f} "
          f"{s['rel_loss_diff']:>9.2e} {s['maxlm_grad_norm']:>10.5f} "
          f"{s['torch_grad_norm']:>10.5f} {s['rel_grad_norm_diff']:>9.2e} "
          f"{s['rel_lr_diff']:>9.2e}")
  print(f"worst over {result['steps']} steps ({result['clipped_steps']} clipped): loss "
        f"{result['max_rel_loss_diff']:.2e}, grad norm {result['max_rel_grad_norm_diff']:.2e}, "
        f"lr {result['max_rel_lr_diff']:.2e}; final parameters {result['max_rel_param_diff']:.2e}"
        f" ({result['worst_param']}); decay masks "
        f"{'equal' if result['decay_masks_equal'] else 'DIFFER'} ({result['decayed_tensors']} "
        "tensors)")


if __name__ == "__main__":
  main()
