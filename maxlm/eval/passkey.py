"""Passkey retrieval: can the model find a key hidden at a given depth of a long context?

A prompt of `length` positions (powers of two up to the stage's L) is [BOS] + haystack with a
needle inserted at `depth` percent of it + the question + the key:

  needle:   "The pass key is 73914. Remember it. The pass key is 73914."
  question: "What is the pass key? The pass key is"      answer: " 73914" (the needle's ids)

all encoded with the run's own tokenizer. The haystack is real held-out text: the held-out
documents of every text source (chat, preference pairs and sources named `passkey*` left out),
each source's in its fixed evaluation order (maxlm/eval/windows.py), concatenated, read from a
seeded offset (wrapping round when a haystack is longer than the held-out text). The key and
the offset come from numpy's generator seeded by (seed, length, depth, sample): the same seed
gives the same prompts.

Exact retrieval is what greedy decoding would produce: the prompt is run once, and a key counts
only if at every answer position the most likely token (argmax) is the key's next token given
the key's earlier tokens, which is the condition for greedy decoding to emit the key's tokens
(tested against maxlm/eval/generate.py). Prompts are packed as segments into rows of the
stage's L, so one forward pass scores many.
"""

import typing

import numpy as np

from maxlm.data import assemble, store
from maxlm.eval import windows

DEPTHS = (0, 25, 50, 75, 100)
SHORTEST = 128  # the needle, question and key take ~40 tokens
NEEDLE = ("The pass key is", ". Remember it. The pass key is", ".")
QUESTION = "\nWhat is the pass key? The pass key is"


class Prompt(typing.NamedTuple):
  length: int  # positions the prompt fills (its ids are one more: the last is only a target)
  depth: int  # percent of the haystack before the needle
  key: int
  ids: list  # [BOS] + haystack[:at] + needle + haystack[at:] + question + answer
  needle_at: int  # index in ids of the needle's first token
  answer: int  # the last `answer` ids are the key's


def lengths_up_to(seq_len, shortest=SHORTEST):
  """Powers of two from `shortest` up to seq_len."""
  out, n = [], shortest
  while n <= seq_len:
    out.append(n)
    n *= 2
  return out


def haystack_tokens(data, split=store.VAL):
  """The held-out text's token ids, source after source, each in its evaluation order."""
  index, parts = data.index, []
  for s, name in enumerate(index.sources):
    if name.startswith("passkey"):
      continue
    for doc in windows.source_order(index, s, split):
      if not index.is_chat[doc]:
        parts.append(np.asarray(data.store.read(doc, 0, int(index.length[doc])), np.int64))
  return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def needle_ids(encode, key):
  key_ids = encode(f" {key}")
  head, middle, tail = (encode(t) for t in NEEDLE)
  return head + key_ids + middle + key_ids + tail, key_ids


def build(encode, bos, stream, lengths, depths=DEPTHS, samples=4, seed=0):
  """[Prompt] for every length x depth x sample; encode(text) -> ids (the run's tokenizer)."""
  question = encode(QUESTION)

  def make(rng):
    key = int(rng.integers(10_000, 100_000))
    needle, answer = needle_ids(encode, key)
    return [needle], question, answer, key
  return lay_out(make, 1, bos, stream, lengths, depths, samples, seed)


def lay_out(make, chained, bos, stream, lengths, depths, samples, seed, tag=()):
  """[Prompt] for every length x depth x sample of a retrieval task: make(rng) -> (needles,
  question ids, answer ids, key); the first needle sits at `depth` of the haystack, the next
  `chained - 1` follow it in order at random later places, the rest anywhere. The generator
  is seeded by (seed, length, depth index, sample, *tag)."""
  if not len(stream):
    raise ValueError("no held-out text to build haystacks from")
  prompts = []
  for length in lengths:
    for d, depth in enumerate(depths):
      for i in range(samples):
        rng = np.random.default_rng([seed, length, d, i, *tag])
        needles, question, answer, key = make(rng)
        hay_len = length - sum(map(len, needles)) - len(question) - len(answer)
        if hay_len < 0:
          raise ValueError(f"a retrieval prompt of {length} positions cannot hold its needles "
                           f"and question ({length - hay_len} tokens)")
        start = int(rng.integers(0, len(stream)))
        hay = stream[(start + np.arange(hay_len)) % len(stream)].tolist()
        at = round(depth / 100 * hay_len)
        places = [at] + sorted(rng.integers(at, hay_len + 1, chained - 1).tolist()) + \
            rng.integers(0, hay_len + 1, len(needles) - chained).tolist()
        ids, first = _insert([bos], hay, needles, places)
        prompts.append(Prompt(length, depth, key, ids + question + answer, first, len(answer)))
  return prompts


def _insert(head, hay, needles, places):
  """(head + hay with needles[j] inserted before hay[places[j]] (ties keep needle order),
  index of needles[0]'s first token)."""
  order = sorted(range(len(needles)), key=lambda j: (places[j], j))
  ids, done, first = list(head), 0, None
  for j in order:
    ids += hay[done:places[j]]
    done = places[j]
    if j == 0:
      first = len(ids)
    ids += needles[j]
  return ids + hay[done:], first


def rows_of(prompts, seq_len):
  """Prompt indices packed first-fit into rows of seq_len positions."""
  return windows.pack([(p.length, i) for i, p in enumerate(prompts)], seq_len)


def row_batch(prompts, rows, seq_len, batch_rows):
  """(batch of assemble.FIELDS [batch_rows, L], where [batch_rows, W]: the positions whose
  targets are answer tokens, prompt after prompt in row order, padded with 0)."""
  batch = {f: np.zeros((batch_rows, seq_len), np.int32) for f in assemble.FIELDS}
  width = max(sum(prompts[i].answer for i in row) for row in rows)
  where = np.zeros((batch_rows, width), np.int32)
  for r, row in enumerate(rows):
    at, w = 0, 0
    for k, i in enumerate(row, 1):
      p = prompts[i]
      n = len(p.ids) - 1
      batch["inputs"][r, at:at + n] = p.ids[:-1]
      batch["targets"][r, at:at + n] = p.ids[1:]
      batch["segment_ids"][r, at:at + n] = k
      batch["positions"][r, at:at + n] = np.arange(n)
      where[r, w:w + p.answer] = at + n - p.answer + np.arange(p.answer)
      at, w = at + n, w + p.answer
  return batch, where


def score(predict, prompts, seq_len, batch_rows, progress=None):
  """{length: {depth: accuracy}} (str keys, for JSON) with predict(batch, where) -> the argmax
  ids [rows, W] at the positions `where`; prompts are packed into rows of seq_len, or of the
  longest prompt's length where it is longer (extrapolation past the stage's L); `progress`:
  a name to show a progress bar of the forward passes under (on stderr), or None for none."""
  import tqdm
  row_len = max(seq_len, *(p.length for p in prompts))  # longer prompts: rows of their own
  rows = rows_of(prompts, row_len)
  hits = {}
  for first in tqdm.tqdm(range(0, len(rows), batch_rows), desc=progress, unit="batch",
                         disable=progress is None):
    group = rows[first:first + batch_rows]
    batch, where = row_batch(prompts, group, row_len, batch_rows)
    got = np.asarray(predict(batch, where))
    for r, row in enumerate(group):
      w = 0
      for i in row:
        p = prompts[i]
        want = p.ids[-p.answer:]
        hits.setdefault((p.length, p.depth), []).append(
            got[r, w:w + p.answer].tolist() == want)
        w += p.answer
  grid = {}
  for (length, depth), ok in sorted(hits.items()):
    grid.setdefault(str(length), {})[str(depth)] = float(np.mean(ok))
  return grid


def as_metrics(grid, task="passkey"):
  """metrics.jsonl keys of a task's grid: TASK/LENGTH/DEPTH, and TASK/LENGTH (the mean over
  depths)."""
  out = {}
  for length, row in grid.items():
    for depth, accuracy in row.items():
      out[f"{task}/{length}/{depth}"] = accuracy
    out[f"{task}/{length}"] = float(np.mean(list(row.values())))
  return out


def make_predict(model, rules):
  """predict(params, batch, where, moe_bias=None) -> argmax ids [B, W] at positions `where`
  [B, W] (jit it); `moe_bias` routes as training did (maxlm/model/moe_state.py)."""
  import flax.linen as nn
  import jax.numpy as jnp
  from maxlm.model import sharding
  sp = model.settings.sparse
  indexed = sp is not None and sp.mode != "dense"

  def predict(params, batch, where, moe_bias=None):
    variables = {"params": params, **({"moe_bias": moe_bias} if moe_bias is not None else {})}
    with nn.logical_axis_rules(sharding.rules_list(rules)):
      result = model.apply(variables, batch["inputs"], batch["positions"],
                           batch["segment_ids"], mutable=["sparse"] if indexed else False)
    h, head, _ = result[0] if indexed else result
    h_sel = jnp.take_along_axis(h, where[..., None], axis=1)
    return jnp.argmax(h_sel.astype(jnp.float32) @ head.astype(jnp.float32), axis=-1)
  return predict


def save_png(grid, path, title=""):
  """A depth x length heatmap of the accuracies."""
  import io as _io

  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from maxlm import io
  lengths = sorted(grid, key=int)
  depths = sorted({d for row in grid.values() for d in row}, key=int)
  acc = np.array([[grid[n].get(d, np.nan) for n in lengths] for d in depths])
  fig, ax = plt.subplots(figsize=(1.2 + 0.8 * len(lengths), 1.2 + 0.5 * len(depths)))
  im = ax.imshow(acc, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
  for y in range(len(depths)):
    for x in range(len(lengths)):
      ax.text(x, y, f"{acc[y, x]:.2f}", ha="center", va="center", fontsize=8)
  ax.set_xticks(range(len(lengths)), lengths)
  ax.set_yticks(range(len(depths)), [f"{d}%" for d in depths])
  ax.set_xlabel("prompt length (tokens)")
  ax.set_ylabel("key depth")
  ax.set_title(title or "passkey retrieval (exact, greedy)", fontsize=9)
  fig.colorbar(im, ax=ax, label="accuracy")
  fig.tight_layout()
  buf = _io.BytesIO()
  fig.savefig(buf, format="png", dpi=100)
  plt.close(fig)
  io.write_bytes(path, buf.getvalue())
