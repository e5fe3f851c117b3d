"""Passkey retrieval (maxlm/eval/passkey.py): the key is where the prompt says, the haystack is
real held-out text, the same seed gives the same prompts, the grid scores what greedy decoding
would emit."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm import config as config_lib, io
from maxlm.data import loader, store, tokenizer
from maxlm.eval import generate, passkey, windows

from smallrun import tiny_model


@pytest.fixture(scope="module")
def demo(demo_data):
  cfg = config_lib.from_dict({"data": {"dir": str(demo_data)},
                              "stages": [{"seq_len": 512, "batch": 2, "steps": 1}]})
  data = loader.Data(cfg)
  sp = tokenizer.load(io.read_bytes(io.join(str(demo_data), "tokenizer.model")))
  return data, sp


def _prompts(demo, seed=0, lengths=(128, 256, 512)):
  data, sp = demo
  return passkey.build(sp.encode, data.special.bos, passkey.haystack_tokens(data), lengths,
                       samples=2, seed=seed)


def _contains(stream, part):
  """Whether `part` is a contiguous run of the (cyclic) token stream."""
  hay = np.concatenate([stream, stream]).astype(np.int64).tobytes()
  return hay.find(np.asarray(part, np.int64).tobytes()) % 8 == 0 if part else True


def test_the_key_is_where_the_prompt_says(demo):
  data, sp = demo
  for p in _prompts(demo):
    assert len(p.ids) == p.length + 1 and p.ids[0] == data.special.bos
    needle, key_ids = passkey.needle_ids(sp.encode, p.key)
    assert p.ids[p.needle_at:p.needle_at + len(needle)] == needle
    assert sp.decode(needle) == f"The pass key is {p.key}. Remember it. The pass key is {p.key}."
    assert p.ids[-p.answer:] == key_ids and sp.decode(p.ids[-p.answer:]).strip() == str(p.key)
    hay_len = p.length - len(needle) - len(sp.encode(passkey.QUESTION)) - p.answer
    assert p.needle_at - 1 == round(p.depth / 100 * hay_len)


def test_the_haystack_is_real_held_out_text(demo):
  data, sp = demo
  stream = passkey.haystack_tokens(data)
  index = data.index
  val = [d for s in range(len(index.sources)) for d in windows.source_order(index, s)
         if not index.is_chat[d]]
  assert val and all(index.split[d] == store.VAL for d in val)
  assert stream.tolist() == [t for d in val for t in data.store.read(d, 0, int(index.length[d]))]
  words = 0
  for p in _prompts(demo):
    needle, _ = passkey.needle_ids(sp.encode, p.key)
    before = p.ids[1:p.needle_at]
    after = p.ids[p.needle_at + len(needle):-p.answer - len(sp.encode(passkey.QUESTION))]
    assert _contains(stream, before + after)  # one stretch of it, cut where the needle went
    words += len(sp.decode(before + after).split())
  assert words > 1000  # text, decoded


def test_the_same_seed_gives_the_same_prompts(demo):
  a, b, c = _prompts(demo, 0), _prompts(demo, 0), _prompts(demo, 1)
  assert a == b
  assert [p.key for p in a] != [p.key for p in c] and [p.ids for p in a] != [p.ids for p in c]
  assert {(p.length, p.depth) for p in a} == {(n, d) for n in (128, 256, 512)
                                              for d in passkey.DEPTHS}


def test_the_grid_scores_each_cell_from_its_own_prompts(demo):
  prompts = _prompts(demo)
  wrong = {(256, 50)}

  def predict(batch, where):  # right everywhere but in one cell
    got = np.take_along_axis(batch["targets"], where, axis=1).copy()
    for r, row in enumerate(passkey.rows_of(prompts, 512)[first[0]:first[0] + 3]):
      w = 0
      for i in row:
        if (prompts[i].length, prompts[i].depth) in wrong:
          got[r, w] += 1
        w += prompts[i].answer
    first[0] += 3
    return got

  first = [0]
  grid = passkey.score(predict, prompts, 512, 3)
  assert set(grid) == {"128", "256", "512"}
  assert all(grid[n][d] == (0.0 if (int(n), int(d)) in wrong else 1.0)
             for n in grid for d in grid[n])


def test_exact_retrieval_is_what_greedy_decoding_emits():
  cfg, mesh, model, params = tiny_model(seq_len=64, seed=5)
  rng = np.random.default_rng(0)
  prompts = []
  for n in (20, 30):
    ids = [1] + rng.integers(11, 64, n).tolist()
    with mesh:
      greedy = generate.sample(model, params, ids, max_tokens=4, temperature=0)
    prompts.append(passkey.Prompt(n + 4, 0, 0, ids + greedy, 1, 4))
    other = greedy[:3] + [greedy[3] % 63 + 1]  # differs in the last token only
    prompts.append(passkey.Prompt(n + 4, 50, 0, ids + other, 1, 4))
  fn = jax.jit(passkey.make_predict(model, cfg.rules))
  with mesh:
    grid = passkey.score(lambda b, w: fn(params, {k: jnp.asarray(v) for k, v in b.items()},
                                         jnp.asarray(w)), prompts, 64, 2)
  assert grid == {"24": {"0": 1.0, "50": 0.0}, "34": {"0": 1.0, "50": 0.0}}
  with mesh:  # past the stage's L (extrapolation): the same prompts in rows of their own
    longer = passkey.score(lambda b, w: fn(params, {k: jnp.asarray(v) for k, v in b.items()},
                                           jnp.asarray(w)), prompts, 16, 2)
  assert longer == grid


def test_passkey_lengths_default_to_powers_of_two_up_to_the_stage_and_bad_ones_are_one_line():
  from maxlm import MaxlmError
  from maxlm.eval import long_eval
  assert long_eval.lengths(None, 1024) == [128, 256, 512, 1024]
  assert long_eval.lengths("512,128,512", 1024) == [128, 512]
  assert long_eval.lengths("4096", 1024) == [4096]  # extrapolation, up to 4x L
  for bad, match in (("64", "outside"), ("8192", "outside"), ("1k", "integers")):
    with pytest.raises(MaxlmError, match=match):
      long_eval.lengths(bad, 1024)
  with pytest.raises(MaxlmError, match="shorter than"):
    long_eval.lengths(None, 64)


def test_training_logs_the_grid_maxlm_eval_scores_and_the_plot_draws_it(demo_data, tmp_path,
                                                                          here):
  """train.eval_passkey: the grid in metrics.jsonl at each evaluation is the one `maxlm eval
  --passkey` scores on the same checkpoint with the same prompts."""
  from maxlm.train import metrics, plot
  run = tmp_path / "run"
  proc = here("train", "configs/demo.yaml", f"data.dir={demo_data}", f"run_dir={run}",
              "model.size=tiny", "stages=[{seq_len: 256, batch: 8, steps: 2}]",
              "train.eval_every=2", "train.eval_tokens=512", "train.eval_passkey.samples=1",
              "train.eval_passkey.lengths=[128, 256, 1024]",
              "train.eval_passkey.tasks=[passkey, vartrack]",
              "train.eval_passkey.extrapolate=true")
  assert proc.returncode == 0, proc.stderr
  (row,) = [r for r in metrics.read_jsonl(str(run)) if "val_loss" in r]
  logged = {k: v for k, v in row.items() if k.split("/")[0] in ("passkey", "vartrack")}
  assert {tuple(k.split("/")[:2]) for k in logged} == {
      (t, n) for t in ("passkey", "vartrack")
      for n in ("128", "256", "512")}  # 1024 > 2L; 512 = 2L, extrapolated
  proc = here("eval", run, "--passkey", "--passkey-samples", "1", "--passkey-tasks",
              "passkey,vartrack", "--passkey-lengths", "128,256,512", "--json", "--tokens",
              "512", "--stage", "0")
  assert proc.returncode == 0, proc.stderr
  out = json.loads(proc.stdout)
  assert {**passkey.as_metrics(out["passkey"]),
          **passkey.as_metrics(out["vartrack"], "vartrack")} == logged
  assert (run / "vartrack.png").read_bytes()[:4] == b"\x89PNG"
  fig = plot.figure(metrics.read_jsonl(str(run)))
  assert any(ax.get_title(loc="left").startswith("retrieval accuracy") for ax in fig.axes)
  for bad, words in (("train.eval_passkey.lengths=[64]", "train.eval_passkey.lengths.0"),
                     ("train.eval_passkey.tasks=[multi]", "train.eval_passkey.tasks.0")):
    proc = here("train", "configs/demo.yaml", bad)
    assert proc.returncode == 2 and words in proc.stderr
  typo = here("eval", run, "--passkey", "--passkey-tasks", "passkey,multi")
  assert typo.returncode == 2 and "unknown task 'multi'" in typo.stderr
  typo = here("eval", run, "--stage", "1")
  assert typo.returncode == 2 and "stages 0..0" in typo.stderr
