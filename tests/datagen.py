"""Test data: in-memory doc indexes and stores, synthetic data dirs, the batch contract checker."""

import numpy as np

from maxlm import config
from maxlm.data import prepare, store, tokenizer

SPECIAL = tokenizer.DEFAULT_SPECIAL
FIRST_TOKEN = 11  # ids below are specials


def make_docs(lengths, sources=None, seed=0, bounds=None, chats=None):
  """[(source, tokens, bound_pos, bound_level, no_loss)] with random ordinary tokens."""
  rng = np.random.default_rng(seed)
  docs = []
  for i, n in enumerate(lengths):
    toks = rng.integers(FIRST_TOKEN, 1000, n).astype(np.int32)
    pos = sorted(set((bounds or {}).get(i, ())))
    level = [2 if (p % 3 == 0) else 1 for p in pos]
    docs.append(((sources or ["src"] * len(lengths))[i], toks, pos, level,
                 (chats or {}).get(i, [])))
  return docs


def write_data_dir(path, docs, val_fraction=0.0):
  writer = prepare.DataDirWriter(str(path))
  for i, (source, toks, pos, level, no_loss) in enumerate(docs):
    writer.add(source, f"{source}-{i}", toks, pos, level, no_loss, nbytes=4 * len(toks))
  writer.finish(prepare.Report(), SPECIAL, 1000, val_fraction=val_fraction)
  return str(path)


class MemoryStore:
  """The TokenStore interface over in-memory documents (no files), for fast property tests."""

  def __init__(self, docs):
    self.tokens = [d[1] for d in docs]
    lengths = np.array([len(t) for t in self.tokens], np.int32)
    names = sorted({d[0] for d in docs})
    ptr = lambda counts: np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    self.index = store.DocIndex(
        shard=np.zeros(len(docs), np.int32),
        offset=np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64),
        length=lengths, source=np.array([names.index(d[0]) for d in docs], np.int32),
        split=np.zeros(len(docs), np.uint8), nbytes=lengths.astype(np.int64),
        bound_ptr=ptr([len(d[2]) for d in docs]),
        bound_pos=np.array([p for d in docs for p in d[2]], np.int32),
        bound_level=np.array([lv for d in docs for lv in d[3]], np.int8),
        nolos_ptr=ptr([len(d[4]) for d in docs]),
        nolos_start=np.array([a for d in docs for a, _ in d[4]], np.int32),
        nolos_end=np.array([b for d in docs for _, b in d[4]], np.int32), sources=names)

  def read(self, doc, start, end):
    return self.tokens[doc][start:end]


def make_config(stages, data=None, seed=0):
  return config.from_dict({"seed": seed, "data": {"dir": "unused", **(data or {})},
                           "stages": stages})


def check_batch_rules(batch):
  """Asserts the batch contract (docs/batch.md) on a batch dict of [rows, L] arrays."""
  for f in ("inputs", "targets", "segment_ids", "positions", "loss_mask"):
    assert batch[f].dtype == np.int32, f
  for r in range(batch["inputs"].shape[0]):
    seg, pos = batch["segment_ids"][r], batch["positions"][r]
    inp, tgt, mask = batch["inputs"][r], batch["targets"][r], batch["loss_mask"][r]
    used = int((seg > 0).sum())
    assert (seg[:used] > 0).all() and (seg[used:] == 0).all(), "padding only at the end"
    assert (inp[used:] == SPECIAL.pad).all() and (tgt[used:] == SPECIAL.pad).all()
    assert (pos[used:] == 0).all() and (mask[used:] == 0).all()
    assert set(np.unique(mask)) <= {0, 1}
    if not used:
      continue
    assert seg[0] == 1 and (np.diff(seg[:used]) >= 0).all() and (np.diff(seg[:used]) <= 1).all()
    starts = np.flatnonzero(np.diff(np.concatenate([[0], seg[:used]])))
    for a, b in zip(starts, list(starts[1:]) + [used]):
      assert (pos[a:b] == np.arange(b - a)).all(), "positions restart per segment"
      assert (tgt[a:b - 1] == inp[a + 1:b]).all(), "targets are next inputs inside a segment"


# `maxlm prepare` flags that keep every usable document (for tests about other things)
QUALITY_OFF = ("--filters", "off", "--dedup", "off", "--lang", "any")


def with_pairs(mem, pairs_at):
  """Marks documents of a MemoryStore as preference pairs: {doc: (prompt, chosen) tokens}."""
  for doc, pc in pairs_at.items():
    mem.index.pair[doc] = pc
  return mem


def check_pair_rules(batch):
  """Asserts the pair contract (docs/pairs.md): roles constant per segment; every chosen
  segment (role 1) is followed by a rejected one (role 2) in the same row, and only then; both
  open with BOS and the same prompt (their loss-free targets), end with EOS, and count the loss
  on the answer and its EOS only."""
  for r in range(batch["inputs"].shape[0]):
    seg, role = batch["segment_ids"][r], batch["roles"][r]
    n = int(seg.max())
    parts = {k: np.flatnonzero(seg == k) for k in range(1, n + 1)}
    roles = {}
    for k, at in parts.items():
      assert len(set(role[at].tolist())) == 1, "one role per segment"
      roles[k] = int(role[at[0]])
    for k in range(1, n + 1):
      if roles[k] == 2:
        assert roles.get(k - 1) == 1, "a rejected segment follows its chosen one"
      if roles[k] != 1:
        continue
      assert roles.get(k + 1) == 2, "a chosen segment is followed by its rejected one"
      views = []
      for j in (k, k + 1):
        at = parts[j]
        inp, tgt, mask = (batch[f][r][at] for f in ("inputs", "targets", "loss_mask"))
        assert inp[0] == SPECIAL.bos and tgt[-1] == SPECIAL.eos and mask[-1] == 1
        assert mask[0] == 0, "the target after BOS is prompt (a prompt has a token at least)"
        first = int(np.argmax(mask))
        assert mask[first:].all() and not mask[:first].any(), "loss on the answer only"
        views.append(inp[:first + 1])  # BOS + the prompt
      assert np.array_equal(views[0], views[1]), "chosen and rejected share their prompt"
