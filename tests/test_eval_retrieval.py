"""Multi-key and variable-tracking retrieval (maxlm/eval/retrieval.py): prompts of the stated
length with the asked needle at the stated depth, answers that follow from the prompt, and a
model that copies the last number it read fails them where it passes the plain passkey."""

import re

import numpy as np
import pytest

from maxlm import io
from maxlm.data import tokenizer
from maxlm.eval import retrieval

import realtext


@pytest.fixture(scope="module")
def sp_and_stream(demo_data):
  sp = tokenizer.load(io.read_bytes(io.join(str(demo_data), "tokenizer.model")))
  text = " ".join(t for _, t in realtext.pydoc_topics(5))
  return sp, np.array(sp.encode(text), np.int64)


def _build(sp_and_stream, task, seed=0, lengths=(256, 512)):
  sp, stream = sp_and_stream
  return [(p, sp.decode(p.ids[1:-p.answer]), sp.decode(p.ids[-p.answer:]))
          for p in retrieval.TASKS[task](sp.encode, 1, stream, lengths, samples=3, seed=seed)]


@pytest.mark.parametrize("task", list(retrieval.TASKS))
def test_prompts_have_their_length_and_the_asked_needle_at_its_depth(sp_and_stream, task):
  sp, _ = sp_and_stream
  built = _build(sp_and_stream, task)
  assert len(built) == 2 * 5 * 3
  for p, _, answer in built:
    assert len(p.ids) == p.length + 1 and answer.strip() == str(p.key)
    needle = sp.decode(p.ids[p.needle_at:p.needle_at + 12])
    assert re.match(r"\s*(The pass key|VAR [A-Z]{2} = )", needle), needle
    assert abs(p.needle_at / p.length - p.depth / 100) < 0.4  # the needles take some room
  assert [p.ids for p, _, _ in built] == [p.ids for p, _, _ in _build(sp_and_stream, task)]
  assert [p.ids for p, _, _ in built] != [p.ids for p, _, _ in _build(sp_and_stream, task, 1)]


def test_multikey_asks_one_of_four_distinct_keys(sp_and_stream):
  for p, text, _ in _build(sp_and_stream, "multikey"):
    found = dict(re.findall(r"The pass key for (\w+) is (\d{5})\.", text))
    asked = re.search(r"What is the pass key for (\w+)\?", text)[1]
    assert len(found) == retrieval.NEEDLES == len(set(found.values()))
    assert found[asked] == str(p.key)


def test_vartrack_answer_follows_the_chain_and_not_the_distractor(sp_and_stream):
  for p, text, _ in _build(sp_and_stream, "vartrack"):
    links = dict(re.findall(r"VAR ([A-Z]{2}) = (\w+)\.", text))
    name = re.search(r"Which number does VAR ([A-Z]{2}) hold\?", text)[1]
    hops = 0
    while not links[name].isdigit():
      name, hops = links[name], hops + 1
    assert links[name] == str(p.key) and hops == retrieval.HOPS - 1
    assert len([v for v in links.values() if v.isdigit()]) == 2  # the key and the distractor's


def test_copying_the_last_number_passes_the_passkey_but_not_the_harder_tasks(sp_and_stream):
  def copy_last(task):
    built = _build(sp_and_stream, task, lengths=(512,))
    return np.mean([re.findall(r"\d{5}", text)[-1] == str(p.key) for p, text, _ in built])
  assert copy_last("passkey") == 1.0
  assert copy_last("multikey") < 0.6 and copy_last("vartrack") < 0.6
