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

TASKS maps each task's name to its builder, each with passkey.build's signature; all lay their
needles out through passkey.lay_out. Names, keys and places come from numpy's generator seeded
by (seed, length, depth, sample, the task's chain length).
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
  return passkey.lay_out(make, 1, bos, stream, lengths, depths, samples, seed, (1,))


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
  return passkey.lay_out(make, HOPS, bos, stream, lengths, depths, samples, seed, (HOPS,))


TASKS = {"passkey": passkey.build, "multikey": multikey, "vartrack": vartrack}
