"""`maxlm eval`'s long-context columns: held-out loss by position per source (always:
maxlm/eval/positions.py) and, with --passkey, the retrieval grids of --passkey-tasks and their
heatmaps (maxlm/eval/passkey.py, maxlm/eval/retrieval.py)."""

import dataclasses

from maxlm import MaxlmError, io


def add_arguments(p):
  p.add_argument("--passkey", action="store_true",
                 help="also score passkey retrieval: keys hidden at depths 0/25/50/75/100%% of "
                      "held-out text, prompts of powers of two up to the stage's L; --json adds "
                      "passkey: {length: {depth: accuracy}}; heatmap in --passkey-png")
  p.add_argument("--passkey-lengths", metavar="N,N,...",
                 help="prompt lengths in tokens (default: 128, 256, ... up to the stage's L; "
                      "up to 4x L, past L scored in rows of their own length: extrapolation)")
  p.add_argument("--passkey-samples", type=int, default=4, help="prompts per cell")
  p.add_argument("--passkey-seed", type=int, default=0, help="chooses keys and haystacks")
  p.add_argument("--passkey-png", help="heatmap file (default: RUN_DIR/passkey.png)")
  p.add_argument("--passkey-tasks", default="passkey", metavar="TASK,...",
                 help="retrieval tasks in the grid: passkey, multikey (four keys, one asked), "
                      "vartrack (a chain of variables); each in --json under its name, its "
                      "heatmap RUN_DIR/TASK.png (maxlm/eval/retrieval.py)")


@dataclasses.dataclass(frozen=True)
class Passkey:
  """What --passkey asks for: prompt lengths ("N,N,..." text; None: powers of two up to the
  stage's L), prompts per cell, the seed of keys and haystacks, the heatmap file (None:
  RUN_DIR/passkey.png)."""
  lengths: str | None = None
  samples: int = 4
  seed: int = 0
  png: str | None = None
  tasks: str = "passkey"


EXTRAPOLATE = 4  # prompts may be up to this many times the stage's L (scored in longer rows)


def lengths(requested, seq_len):
  """The passkey prompt lengths: `requested` ("N,N,...", --passkey-lengths) checked against
  the stage's L (lengths past it score extrapolation, up to EXTRAPOLATE x L, a guard against a
  typo's hours), or with None every length from passkey.lengths_up_to(seq_len)."""
  from maxlm.eval import passkey
  if not requested:
    found = passkey.lengths_up_to(seq_len)
    if not found:
      raise MaxlmError(f"--passkey: the stage's L={seq_len} is shorter than the shortest "
                       f"passkey prompt ({passkey.SHORTEST} tokens)")
    return found
  try:
    out = sorted({int(n) for n in requested.split(",")})
  except ValueError:
    raise MaxlmError(f"--passkey-lengths: expected integers separated by commas, got "
                     f"{requested!r}") from None
  bad = [n for n in out if not passkey.SHORTEST <= n <= EXTRAPOLATE * seq_len]
  if bad:
    raise MaxlmError(f"--passkey-lengths: {bad[0]} is outside [{passkey.SHORTEST}, "
                     f"{EXTRAPOLATE * seq_len}] ({EXTRAPOLATE}x the stage's L={seq_len})")
  return out


def evaluate(nll, data, config, s, mesh, model, params, budget, split, *, run_dir,
             passkey=None, moe_bias=None):
  """{"positions": {...}, "passkey": {...} when `passkey` (a Passkey) is given}; writes the
  heatmap."""
  from maxlm.eval import positions
  stage = config.stages[s]
  out = {"positions": positions.by_position(nll, data, stage.seq_len, stage.batch, budget,
                                            split)}
  if passkey is not None:
    if passkey.samples < 1:
      raise MaxlmError(f"--passkey-samples must be >= 1, got {passkey.samples}")
    from maxlm.eval import passkey as passkey_lib
    for task in task_names(passkey.tasks):
      grid = passkey_grid(passkey, data, config, s, mesh, model, params, split, moe_bias, task)
      png = (passkey.png if task == "passkey" else None) or io.join(run_dir, f"{task}.png")
      passkey_lib.save_png(grid, png, f"{run_dir}: {task}, stage {s} (L={stage.seq_len}), "
                           f"{passkey.samples} prompts per cell, seed {passkey.seed}")
      out[task], out[f"{task}_png"] = grid, png
  return out


def task_names(text):
  """The retrieval tasks named in "TASK,..." (maxlm/eval/retrieval.py), checked."""
  from maxlm.eval import retrieval
  names = [t.strip() for t in text.split(",") if t.strip()] if isinstance(text, str) else text
  unknown = [t for t in names if t not in retrieval.TASKS]
  if unknown or not names:
    raise MaxlmError(f"--passkey-tasks: unknown task {(unknown or [text])[0]!r}; expected "
                     f"{', '.join(retrieval.TASKS)}")
  return list(dict.fromkeys(names))


def passkey_grid(options, data, config, s, mesh, model, params, split, moe_bias=None,
                 task="passkey"):
  """{length: {depth: accuracy}} of a retrieval task with the Passkey `options` on `split`'s
  held-out text."""
  import jax
  from maxlm.eval import passkey
  stage = config.stages[s]
  prompts = passkey_prompts(lengths(options.lengths, stage.seq_len), options.samples,
                            options.seed, data, config, split, task)
  predict = passkey_predictor(jax.jit(passkey.make_predict(model, config.rules)), mesh, config)
  return passkey.score(lambda batch, where: predict(params, batch, where, moe_bias), prompts,
                       stage.seq_len, stage.batch,
                       progress=f"{task} ({len(prompts)} prompts, rows of {stage.seq_len:,})")


def passkey_prompts(prompt_lengths, samples, seed, data, config, split=None, task="passkey"):
  """The prompts of a retrieval task (maxlm/eval/retrieval.py) of these lengths on the
  held-out text."""
  from maxlm.data import store, tokenizer
  from maxlm.eval import passkey, retrieval
  split = store.VAL if split is None else split
  sp = tokenizer.load(io.read_bytes(io.join(config.data.dir, "tokenizer.model")))
  stream = passkey.haystack_tokens(data, split)
  if not len(stream):
    name = "val" if split == store.VAL else "train"
    raise MaxlmError(f"passkey: the data has no {name} text to build haystacks from")
  return retrieval.TASKS[task](sp.encode, data.special.bos, stream, prompt_lengths,
                               samples=samples, seed=seed)


def passkey_predictor(fn, mesh, config):
  """predict(params, batch, where, moe_bias) -> argmax ids on every process, from the jitted
  passkey.make_predict `fn`, each process giving its share of the rows."""
  from maxlm.parallel import distributed, mesh as mesh_lib

  def predict(params, batch, where, moe_bias=None):
    mine = distributed.host_rows({**batch, "where": where})
    where = mine.pop("where")
    with mesh:
      return distributed.gather_rows(fn(params, mesh_lib.place_batch(mine, mesh, config.rules),
                                        mesh_lib.place_rows(where, mesh, config.rules),
                                        moe_bias))
  return predict


def format_text(extra):
  """Lines for the console: loss by position per source, then the passkey grid."""
  lines = []
  for source, cells in extra["positions"].items():
    parts = ", ".join(f"{b} {e['loss']:.3f} ({e['tokens']:,})" for b, e in cells.items())
    lines.append(f"loss by position, {source}: {parts}")
  from maxlm.eval import retrieval
  for task in (t for t in retrieval.TASKS if t in extra):
    grid = extra[task]
    depths = sorted({d for row in grid.values() for d in row}, key=int)
    lines.append(f"{task + ' accuracy':<18}" + "".join(f"{d + '%':>7}" for d in depths))
    for n in sorted(grid, key=int):
      lines.append(f"  {int(n):>9,} tokens" + "".join(f"{grid[n][d]:>7.2f}" for d in depths))
    lines.append(f"wrote {extra[task + '_png']}")
  return lines
