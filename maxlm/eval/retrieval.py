"""Retrieval tasks harder than one passkey, in the passkey grid's format (maxlm/eval/passkey.py:
the same haystack of real held-out text, Prompt tuples, exact greedy scoring), after RULER's
multi-key and variable-tracking tasks:

  multikey  four needles "The pass key for NAME is KEY." (distinct names and keys) hidden in the
            haystack, the asked one at `depth`, the others anywhere; the question names one:
            "What is the pass key for NAME? The pass key for NAME is" -> " KEY". A model that
            copies the last number it saw, or the first, fails whenever another needle is
            there.
  vartrack  a chain "VAR A = KEY." at `depth`, then "VAR B = A.", "VAR C = B.", "VAR D = C." at
            later random places, and a distractor chain of two with another number; the
            question asks for the last link: "Which number does VAR D hold? VAR D holds" ->
            " KEY". The answer is never next to the question's name.

TASKS maps each task's name to its builder, each with passkey.build's signature. Names, keys
and places come from numpy's generator seeded by (seed, length, depth, sample, task).
"""

import numpy as np

from maxlm.eval import passkey

NAMES = ("apple", "river", "candle", "violet", "harbor", "copper", "meadow", "falcon")
VARS = ("QX", "ZR", "KT", "MB", "WJ", "PV", "HN", "DL", "FS", "GC")
NEEDLES = 4  # multikey: needles in a prompt
HOPS = 4  # vartrack: assignments in the asked chain


def multikey(encode, bos, stream, lengths, depths=passkey.DEPTHS, samples=4, seed=0):
  """[Prompt] of the multi-key task for every length x depth x sample."""
  def make(rng):
    names = rng.choice(NAMES, NEEDLES, replace=False).tolist()
    keys = rng.choice(np.arange(10_000, 100_000), NEEDLES, replace=False).tolist()
    needles = [encode(f"The pass key for {n} is") + encode(f" {k}") + encode(".")
               for n, k in zip(names, keys)]
    question = encode(f"\nWhat is the pass key for {names[0]}? The pass key for {names[0]} is")
    return needles, question, encode(f" {keys[0]}"), keys[0]
  return _prompts(make, 1, encode, bos, stream, lengths, depths, samples, seed)


def vartrack(encode, bos, stream, lengths, depths=passkey.DEPTHS, samples=4, seed=0):
  """[Prompt] of the variable-tracking task for every length x depth x sample."""
  def make(rng):
    names = rng.choice(VARS, HOPS + 2, replace=False).tolist()
    key, other = rng.choice(np.arange(10_000, 100_000), 2, replace=False).tolist()
    chain = [f"VAR {names[0]} = {key}."] + [f"VAR {names[i]} = {names[i - 1]}."
                                             for i in range(1, HOPS)]
    distractor = [f"VAR {names[HOPS]} = {other}.", f"VAR {names[HOPS + 1]} = {names[HOPS]}."]
    last = names[HOPS - 1]
    question = encode(f"\nWhich number does VAR {last} hold? VAR {last} holds")
    return ([encode(" " + t) for t in chain + distractor], question, encode(f" {key}"), key)
  return _prompts(make, HOPS, encode, bos, stream, lengths, depths, samples, seed)


def _prompts(make, chained, encode, bos, stream, lengths, depths, samples, seed):
  """Prompts whose first needle sits at `depth`; the next `chained - 1` needles follow it in
  order at random later places, the rest anywhere."""
  if not len(stream):
    raise ValueError("no held-out text to build haystacks from")
  prompts = []
  for length in lengths:
    for d, depth in enumerate(depths):
      for i in range(samples):
        rng = np.random.default_rng([seed, length, d, i, chained])
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
        prompts.append(passkey.Prompt(length, depth, key, ids + question + answer, first,
                                      len(answer)))
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


TASKS = {"passkey": passkey.build, "multikey": multikey, "vartrack": vartrack}
