"""`maxlm config DATA_DIR`: a starting config for a user's own prepared data.

Written from the data dir's manifest, so nothing is left out and nothing must be renamed: every
source with training text is in `data.mix`, by its share of training tokens (or equally),
fill-in-the-middle goes to the sources whose documents are mostly code (the kinds the quality
steps counted; without them, to none), the run gets a run_dir of its own (runs/NAME, never
in the data dir), data.dir is absolute (the config works from any folder), and each stage's
token budget comes from the data (`--epochs` passes over its training tokens,
split between the stages), so a stage's steps follow from its batch. Sources of preference
pairs are left out of an lm mix (they would teach the rejected answers too) and named in a
comment. The text is YAML with comments saying what to change; it is loaded back through
maxlm/config.py before it is written, so what it writes always loads.
"""

import dataclasses
import json
import os
import re

from maxlm import MaxlmError, config as config_lib, outputs
from maxlm.data import store

CPU_SIZES = ("tiny", "demo")  # float32, no remat, 128-position tiles: configs/demo.yaml's
LR = {"tiny": 3e-3, "demo": 3e-3, "150m": 6e-4, "1b": 3e-4, "8b": 3e-4}
TILE = 128
MAX_EPOCHS = 4  # a source repeated more often than this is noted in the config


@dataclasses.dataclass(frozen=True)
class Options:
  size: str = "demo"  # a named size of maxlm/config.py's MODEL_SIZES
  seq_lens: tuple[int, ...] = (256, 1024)  # one stage each, growing
  tokens_per_step: int = 4096  # positions per optimizer step, at every stage
  epochs: float = 1.0  # passes over the training tokens, all stages together
  mix: str = "tokens"  # tokens | equal
  run_dir: str | None = None  # default: default_run_dir(data_dir)


def check(opts):
  if opts.size not in config_lib.MODEL_SIZES:
    raise MaxlmError(f"--size {opts.size!r}: expected one of "
                     f"{', '.join(config_lib.MODEL_SIZES)}")
  if not opts.seq_lens or list(opts.seq_lens) != sorted(set(opts.seq_lens)):
    raise MaxlmError(f"--seq-len {','.join(map(str, opts.seq_lens))}: expected growing "
                     "lengths, e.g. 256,1024")
  for L in opts.seq_lens:
    if L < TILE or L % TILE or L > opts.tokens_per_step:
      raise MaxlmError(f"--seq-len {L}: each length must be a multiple of {TILE} and at most "
                       f"--tokens-per-step ({opts.tokens_per_step})")
  if not 0 < opts.epochs < 1e6:
    raise MaxlmError(f"--epochs must be a number in (0, 1e6), got {opts.epochs}")
  if opts.mix not in ("tokens", "equal"):
    raise MaxlmError(f"--mix {opts.mix!r}: expected tokens or equal")


def sources(manifest):
  """{name: training tokens} of the sources an lm stage can train on, and the names of those
  holding preference pairs."""
  usable, paired = {}, []
  for name, src in manifest["sources"].items():
    if src.get("pairs"):
      paired.append(name)
    elif src["tokens"] - src.get("heldout_tokens", 0) > 0:
      usable[name] = src["tokens"] - src.get("heldout_tokens", 0)
  return usable, paired


def code_sources(manifest, names):
  """The sources whose input documents were mostly code, as the quality steps counted them."""
  counted = manifest.get("funnel", {}).get("sources", {})
  out = []
  for name in names:
    kinds = counted.get(name, {}).get("kinds", {})
    if kinds and kinds.get("code", 0) * 2 > sum(kinds.values()):
      out.append(name)
  return out


def default_run_dir(data_dir):
  """runs/NAME for a data dir NAME or NAME/data (never a folder holding anything else), or
  runs/NAME-run when that would be the data dir itself."""
  path = os.path.normpath(os.path.abspath(data_dir))
  name = os.path.basename(path)
  if name == "data" and os.path.basename(os.path.dirname(path)):
    name = os.path.basename(os.path.dirname(path))
  run_dir = os.path.join("runs", name or "run")
  return f"{run_dir}-run" if _inside(run_dir, data_dir) else run_dir


def _inside(path, folder):
  """Whether `path` is `folder` or lies in it (local paths)."""
  path, folder = os.path.abspath(path), os.path.abspath(folder)
  return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _data_path(data_dir):
  """The data dir as the config names it: absolute, so the config works from any folder."""
  return data_dir if "://" in data_dir else os.path.abspath(data_dir)


def _exposure_notes(usable, mix, budget):
  """A comment line per source the mix would repeat more than MAX_EPOCHS times."""
  total_share = sum(mix.values())
  notes = []
  for name, share in mix.items():
    epochs = budget * share / total_share / usable[name]
    if epochs > MAX_EPOCHS:
      notes.append(f"# note: {name} would be seen ~{epochs:,.0f} times ({usable[name]:,} "
                   "training tokens); lower its share or add text to it")
  return notes


def text(data_dir, opts):
  """The starting config's YAML text for `data_dir`."""
  check(opts)
  manifest = store.load_manifest(data_dir)
  usable, paired = sources(manifest)
  if not usable:
    raise MaxlmError(f"{data_dir}: no source has training text (all held out, or pairs only)")
  total = sum(usable.values())
  mix = {n: (1.0 if opts.mix == "equal" else float(f"{t / total:.4g}"))
         for n, t in usable.items()}
  code = code_sources(manifest, list(usable))
  run_dir = opts.run_dir or default_run_dir(data_dir)
  if "://" not in run_dir + data_dir and _inside(run_dir, data_dir):
    raise MaxlmError(f"--run-dir {run_dir} is inside the data dir {data_dir}: a run never "
                     "writes into its data; choose another folder")
  lines = _header(data_dir, usable, total, paired, opts)
  lines += _exposure_notes(usable, mix, max(total * opts.epochs, 1))
  lines += ["seed: 0", f"run_dir: {_q(run_dir)}", "data:", f"  dir: {_q(_data_path(data_dir))}",
            "  mix:  # every source; " + ("by its share of training tokens" if opts.mix ==
                                            "tokens" else "equal shares (--mix equal)")]
  lines += [f"    {_q(n)}: {share}  # {usable[n]:,} training tokens" for n, share in mix.items()]
  lines += _fim(code)
  lines += _stages(total, opts)
  lines += _model_and_train(total, opts)
  body = "\n".join(lines) + "\n"
  _loads(body, data_dir)
  return body


def _header(data_dir, usable, total, paired, opts):
  lines = [f"# A starting config for {_q(data_dir)}, written by `maxlm config` (docs/data.md).",
           f"# {len(usable)} source(s), {total:,} training tokens; {opts.epochs:g} epoch(s) "
           "over the stages below.",
           "# Change: model.size for a larger model (then drop the CPU settings), stages.*.tokens",
           "# for more or fewer passes, data.mix to weigh sources; every key: docs/config.md."]
  if paired:
    lines.append(f"# Left out: {', '.join(paired)} hold(s) preference pairs: train them with "
                 "a dpo stage (docs/pairs.md).")
  return lines


def _fim(code):
  if not code:
    return ["  # no source is mostly code, so no fill-in-the-middle (data.fim)"]
  return [f"  fim: {{rate: 0.1, spm: 0.5, sources: [{', '.join(map(_q, code))}]}}"
          "  # the sources of code"]


def _stages(total, opts):
  """One stage per length; the last gets a quarter of the tokens, the others share the rest."""
  budget = max(int(total * opts.epochs), opts.tokens_per_step * len(opts.seq_lens))
  n = len(opts.seq_lens)
  shares = [1.0] if n == 1 else [0.75 / (n - 1)] * (n - 1) + [0.25]
  lines = ["stages:  # growing lengths; steps = tokens / (batch x seq_len), rounded up"]
  for L, share in zip(opts.seq_lens, shares):
    tokens = max(int(budget * share), opts.tokens_per_step)
    tiles = f", block_q: {TILE}, block_k: {TILE}" if opts.size in CPU_SIZES else ""
    lines.append(f"  - {{name: s{L}, seq_len: {L}, batch: {opts.tokens_per_step // L}, "
                 f"tokens: {tokens}{tiles}}}")
  return lines


def _model_and_train(total, opts):
  steps = max(1, int(total * opts.epochs) // opts.tokens_per_step)
  if opts.size in CPU_SIZES:
    model = ["# CPU settings; on an accelerator keep the defaults (docs/config.md)",
             f"model: {{size: {opts.size}, dtype: float32, remat: none, loss_chunk: 256}}"]
  else:
    model = [f"model: {{size: {opts.size}}}"]
  every = max(1, steps // 10)
  return [*model,
          f"train: {{lr: {LR[opts.size]}, warmup_steps: {max(1, min(steps // 10, 2000))}, "
          f"checkpoint_every: {every}, eval_every: {max(1, steps // 5)}}}"
          "  # about 10 checkpoints and 5 evaluations"]


def _q(value):
  """A name or path as a YAML scalar that reads back as the same string: plain when it is a
  plain word or path, else double-quoted (JSON is YAML)."""
  plain = re.fullmatch(r"[A-Za-z_./][\w./-]*", value) and value.lower() not in (
      "true", "false", "yes", "no", "on", "off", "null", "y", "n")
  return value if plain else json.dumps(value, ensure_ascii=False)


def _loads(body, data_dir):
  import yaml
  try:
    config_lib.from_dict(yaml.safe_load(body))
  except MaxlmError as e:
    raise MaxlmError(f"the config written for {data_dir} does not load ({e}); please report "
                     "it") from None


def write(data_dir, opts, out, overwrite=False):
  """Writes the config to `out` (a .yaml file; an existing one only with `overwrite`), whole
  or not at all; returns its text."""
  outputs.check_out_file("--out", out, ".yaml")
  if os.path.exists(out) and not outputs.special_file(out) and not overwrite:
    raise MaxlmError(f"--out {out} exists; pass --overwrite to replace it")
  body = text(data_dir, opts)
  with outputs.writing(out) as tmp, open(tmp, "w", encoding="utf-8") as f:
    f.write(body)
  return body
