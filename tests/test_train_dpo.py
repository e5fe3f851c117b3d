"""DPO (maxlm/train/dpo.py): the loss against a plain reference, and the done-when run: pairs
from the demo corpus (prompt = a document's opening, chosen = its true continuation, rejected =
the same words shuffled), DPO from a briefly pretrained demo model, reward accuracy >= 0.9 with
a rising margin, resumed bit for bit."""

import importlib.util
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from maxlm import config as config_lib
from maxlm.data import corpus, pairs, prepare
from maxlm.train import dpo

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL = {"size": "tiny", "dtype": "float32", "remat": "none", "d_model": 64, "n_layers": 2,
         "n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "d_ff": 128, "loss_chunk": 64}


def _batch(rows):
  """A batch from rows of [(length, mask_from, role)] segments, with random log-probs."""
  L = 24
  out = {f: np.zeros((len(rows), L), np.int32) for f in ("segment_ids", "loss_mask", "roles")}
  for r, segs in enumerate(rows):
    at = 0
    for k, (n, mask_from, role) in enumerate(segs, 1):
      out["segment_ids"][r, at:at + n] = k
      out["loss_mask"][r, at + mask_from:at + n] = 1
      out["roles"][r, at:at + n] = role
      at += n
  return out


def _reference_sums(logp, batch):
  """Per pair (chosen, rejected) summed answer log-probs, by walking the segments in Python."""
  found = []
  for r in range(logp.shape[0]):
    seg, mask, role = batch["segment_ids"][r], batch["loss_mask"][r], batch["roles"][r]
    sums = {k: float((logp[r] * mask)[seg == k].sum()) for k in set(seg.tolist()) - {0}}
    roles = {k: int(role[seg == k][0]) for k in sums}
    for k in sums:
      if roles[k] == pairs.CHOSEN:
        assert roles[k + 1] == pairs.REJECTED
        found.append((sums[k], sums[k + 1]))
  return found


def test_pair_logprobs_and_loss_match_a_plain_computation():
  rows = [[(5, 2, 1), (6, 2, 2), (4, 0, 0)], [(3, 1, 0), (7, 3, 1), (5, 3, 2)], [(2, 1, 0)]]
  batch = _batch(rows)
  rng = np.random.default_rng(0)
  logp = -rng.random((3, 24)).astype(np.float32)
  ref = -rng.random((3, 24)).astype(np.float32)
  pol = dpo.pair_logprobs(jnp.asarray(logp), batch)
  rf = dpo.pair_logprobs(jnp.asarray(ref), batch)
  want, want_ref = _reference_sums(logp, batch), _reference_sums(ref, batch)
  got = [(float(pol[0][b, s]), float(pol[1][b, s])) for b, s in zip(*np.nonzero(pol[2]))]
  assert len(got) == 2 and np.allclose(got, want, atol=1e-5)
  beta, eps = 0.3, 0.1
  total, sums = dpo.dpo_terms(pol, rf, beta, eps)
  zs = [beta * ((c - rc) - (r - rr)) for (c, r), (rc, rr) in zip(want, want_ref)]
  ls = lambda x: -math.log1p(math.exp(-x))
  loss = sum(-(1 - eps) * ls(z) - eps * ls(-z) for z in zs)
  assert float(total) == pytest.approx(loss, rel=1e-5)
  assert float(sums["reward_accuracy"]) == sum(z > 0 for z in zs)
  assert float(sums["reward_margin"]) == pytest.approx(sum(zs), rel=1e-5)
  assert float(sums["pairs"]) == 2


def test_token_logprobs_equal_log_softmax_in_any_chunking():
  rng = np.random.default_rng(1)
  h = jnp.asarray(rng.normal(size=(2, 10, 8)), jnp.float32)
  head = jnp.asarray(rng.normal(size=(8, 17)), jnp.float32)
  t = jnp.asarray(rng.integers(0, 17, (2, 10)), jnp.int32)
  want = jnp.take_along_axis(jax.nn.log_softmax(h @ head, -1), t[..., None], -1)[..., 0]
  for chunk in (3, 4, 10, 64):
    assert np.allclose(dpo.token_logprobs(h, head, t, chunk), want, atol=1e-5)


def test_dpo_needs_init_from_and_a_known_objective():
  stages = [{"seq_len": 32, "batch": 2, "steps": 1}]
  with pytest.raises(config_lib.ConfigError, match="train.objective=dpo needs init.from"):
    config_lib.from_dict({"stages": stages, "train": {"objective": "dpo"}})
  with pytest.raises(config_lib.ConfigError, match="train.objective: expected lm, dpo or grpo"):
    config_lib.from_dict({"stages": stages, "train": {"objective": "ppo"}})
  with pytest.raises(config_lib.ConfigError, match="train.dpo.beta"):
    config_lib.from_dict({"stages": stages, "init": {"from": "x"},
                          "train": {"objective": "dpo", "dpo": {"beta": 0}}})


def demo_pairs(raw_files, path):
  """tools/demo_pairs.py's pairs (the recipe docs/pairs.md runs), written to `path`."""
  spec = importlib.util.spec_from_file_location("demo_pairs", ROOT / "tools" / "demo_pairs.py")
  tool = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(tool)
  path.write_text("".join(json.dumps(r) + "\n" for r in tool.demo_pairs(raw_files)))
  return path


def _config(path, data_dir, run_dir, **extra):
  raw = {"seed": 0, "run_dir": str(run_dir), "data": {"dir": str(data_dir), "shuffle_rows": 8,
                                                      "block_rows": 32},
         "stages": [{"seq_len": 128, "batch": 8, "steps": 40, "attention": "blockwise",
                     "block_q": 32, "block_k": 32}],
         "model": MODEL, "train": {"lr": 0.01, "warmup_steps": 2, "checkpoint_every": 100,
                                   "eval_every": 0, "keep": 5}}
  for key, value in extra.items():
    raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
  path.write_text(yaml.safe_dump(raw))
  return config_lib.load(str(path))


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
  """A demo model pretrained 40 steps, and a data dir of demo pairs with its tokenizer."""
  from maxlm.train import loop
  tmp = tmp_path_factory.mktemp("dpo")
  raw = corpus.build(str(tmp / "raw"), bytes_per_source=200_000)
  prepare.prepare(raw, str(tmp / "data"), prepare.Options(vocab_size=512, progress=False))
  cfg = _config(tmp / "pre.yaml", tmp / "data", tmp / "pre")
  loop.train(cfg, log=lambda *a: None)
  src = demo_pairs(raw, tmp / "pairs.jsonl")
  prepare.prepare([str(src)], str(tmp / "pairs"),
                  prepare.Options(tokenizer_file=str(tmp / "data" / "tokenizer.model"),
                                  val_fraction=0.0, progress=False, max_pair_len=128))
  return tmp


def _rows(run_dir):
  return [json.loads(l) for l in open(run_dir / "metrics.jsonl")]


@pytest.mark.slow
def test_dpo_on_demo_pairs_learns_the_preference_and_resumes_bitwise(pretrained):
  from maxlm.train import loop
  tmp = pretrained
  extra = dict(init={"from": str(tmp / "pre")},
               stages=[{"seq_len": 128, "batch": 8, "steps": 16, "attention": "blockwise",
                        "block_q": 32, "block_k": 32}],
               train={"lr": 0.003, "warmup_steps": 2, "checkpoint_every": 8, "eval_every": 0,
                      "objective": "dpo", "dpo": {"beta": 0.1}})
  cfg = _config(tmp / "dpo.yaml", tmp / "pairs", tmp / "dpo", **extra)
  loop.train(cfg, log=lambda *a: None)
  rows = _rows(tmp / "dpo")
  assert len(rows) == 16 and all(r["pairs"] > 0 for r in rows)
  assert rows[0]["reward_margin"] == pytest.approx(0.0, abs=1e-4)  # policy == reference
  acc = [r["reward_accuracy"] for r in rows]
  margin = [r["reward_margin"] for r in rows]
  assert np.mean(acc[-4:]) >= 0.9, acc
  assert np.mean(margin[-4:]) > np.mean(margin[1:5]) > 0, margin
  assert rows[-1]["dpo_loss"] < math.log(2) - 0.05
  # killed after step 8 (stop_after), resumed: the same losses, bit for bit
  cfg2 = _config(tmp / "dpo2.yaml", tmp / "pairs", tmp / "dpo2", **extra)
  assert loop.train(cfg2, stop_after=8, log=lambda *a: None)["stopped"]
  loop.train(cfg2, log=lambda *a: None)
  again = _rows(tmp / "dpo2")
  for key in ("dpo_loss", "reward_margin", "chosen_logp", "rejected_logp", "grad_norm"):
    assert [r[key] for r in again] == [r[key] for r in rows], key


def test_dpo_without_pairs_in_the_batch_is_a_zero_not_a_nan():
  """A pretraining data dir has no pairs: every DPO metric is over zero pairs (no NaN)."""
  batch = _batch([[(5, 1, 0), (6, 1, 0)]])
  logp = jnp.zeros((1, 24))
  total, sums = dpo.dpo_terms(dpo.pair_logprobs(logp, batch), dpo.pair_logprobs(logp, batch),
                              0.1, 0.0)
  assert float(total) == 0.0 and float(sums["pairs"]) == 0.0


def test_generate_verifies_prompts_against_gold(pretrained, tmp_path, capsys):
  """`maxlm generate --prompts --verify`: greedy answers used as gold score pass@1 = 1; a wrong
  gold scores 0; the same seed gives the same answers."""
  from maxlm import cli
  run = str(pretrained / "pre")
  f = tmp_path / "p.jsonl"
  rows = [{"id": "a", "prompt": "def ", "gold": "nothing"},
          {"id": "b", "prompt": [{"role": "user", "content": "import"}], "gold": "x"}]
  f.write_text("".join(json.dumps(r) + "\n" for r in rows))
  args = ["generate", run, "--prompts", str(f), "--verify", "exact", "--max-tokens", "6",
          "--temperature", "0", "--samples", "2", "--json"]
  cli.main(args)
  first = json.loads(capsys.readouterr().out)
  assert first["pass@1"] == 0.0 and first["pass@2"] == 0.0
  answers = [r["answers"][0] for r in first["prompts"]]
  assert all(r["answers"][0] == r["answers"][1] for r in first["prompts"])  # greedy
  f.write_text("".join(json.dumps({**r, "gold": a}) + "\n" for r, a in zip(rows, answers)
                       if a is not None))
  cli.main(args)
  again = json.loads(capsys.readouterr().out)
  assert again["pass@1"] == 1.0 and again["pass@2"] == 1.0
  assert cli.main(["generate", run, "--prompt", "x", "--prompts", str(f)]) == 2
  assert "give --prompt TEXT or --prompts FILE.jsonl" in capsys.readouterr().err


def test_pairs_under_lm_and_dpo_without_pairs_are_refused(pretrained):
  from maxlm import MaxlmError
  from maxlm.train import stage as stage_lib
  cfg = _config(pretrained / "lm.yaml", pretrained / "pairs", pretrained / "lm")
  with pytest.raises(MaxlmError, match=r"stages.0 trains on preference pairs \(source 'pairs'\) "
                     r"with train.objective=lm"):
    stage_lib.validate(cfg)
  cfg = _config(pretrained / "dpo-nopairs.yaml", pretrained / "data", pretrained / "x",
                init={"from": str(pretrained / "pre")}, train={"objective": "dpo"})
  with pytest.raises(MaxlmError, match=r"stages.0: train.objective=dpo, but no source in its "
                     "mix holds preference pairs"):
    stage_lib.validate(cfg)


def test_dpo_step_with_grad_accum_equals_one_big_batch():
  from maxlm.model import build
  from maxlm.parallel import mesh as mesh_lib
  from maxlm.train import optimizer, step as step_lib
  spec = importlib.util.spec_from_file_location("bench_dpo", ROOT / "tools" / "bench_dpo.py")
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  cfg = config_lib.from_dict({"model": MODEL, "init": {"from": "x"},
                              "stages": [{"seq_len": 64, "batch": 16, "steps": 1,
                                          "attention": "reference"}],
                              "train": {"objective": "dpo"}})
  mesh = mesh_lib.make_mesh(cfg.stages[0].mesh)
  model = build.model_for(cfg, 0, mesh, 64)
  opt, schedule = optimizer.make(cfg.train, 10)
  batch = bench.pair_rows(16, 64, 2, 64, np.random.default_rng(0))  # 8 devices: 16 rows
  out = []
  for accum in (1, 2):
    state = step_lib.init_state(model, opt, mesh, cfg.rules, 0, 64)
    ref = jax.tree_util.tree_map(lambda x: x * 0.9, state["params"])  # a reference != policy
    step = jax.jit(dpo.make_train_step(model, opt, schedule, cfg.rules, model.cfg, accum, 0.5,
                                       0.1))
    with mesh:
      new, m = step(state, mesh_lib.place_batch(batch, mesh, cfg.rules), ref)
    out.append((new["params"], {k: float(v) for k, v in m.items()}))
  (p1, m1), (p2, m2) = out
  assert m1["pairs"] == m2["pairs"] == 32
  for k in ("dpo_loss", "reward_margin", "reward_accuracy", "chosen_logp", "grad_norm"):
    assert m1[k] == pytest.approx(m2[k], rel=1e-4, abs=1e-6), k
  assert m1["reward_margin"] != 0.0
  for a, b in zip(jax.tree_util.tree_leaves(p1), jax.tree_util.tree_leaves(p2)):
    assert np.allclose(a, b, atol=1e-6)
