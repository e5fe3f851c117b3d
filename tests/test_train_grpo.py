"""GRPO (maxlm/train/grpo.py, rollouts.py, rewards.py): advantages and the loss against a plain
computation, the rollout batch's shape rules (shared prompt, masked prompt, EOS learned, no
padding read, no completion sees another), KL 0 and ratio 1 at the first step against its own
reference, and a GRPO stage that resumes bit for bit."""

import importlib.util
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from maxlm import MaxlmError, config as config_lib
from maxlm.train import grpo, rewards, rollouts

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL = {"size": "tiny", "dtype": "float32", "remat": "none", "d_model": 64, "n_layers": 2,
         "n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "d_ff": 128, "loss_chunk": 64}
EOS, PAD, BOS = 2, 0, 1


def test_advantages_are_group_normalized_and_zero_for_equal_rewards():
  adv, flat = rewards.advantages([[1, 0, 0, 1], [1, 1, 1, 1], [0, 0, 0, 3]])
  assert adv[0].tolist() == [1.0, -1.0, -1.0, 1.0]  # mean 0.5, population std 0.5
  assert adv[1].tolist() == [0.0, 0.0, 0.0, 0.0] and flat == 1
  std = np.sqrt((3 * 0.75**2 + 2.25**2) / 4)
  assert np.allclose(adv[2], [-0.75 / std] * 3 + [2.25 / std])
  with np.errstate(all="raise"):  # rewards near float's limit: the same advantages, finite
    huge, flat = rewards.advantages([[1e308, -1e308, 0, 1e308], [-1e308] * 4])
    assert huge.tolist() == rewards.advantages([[1, -1, 0, 1], [-1] * 4])[0].tolist()
    assert flat == 1 and np.abs(huge[0]).max() > 0
    assert rewards.moments([[1e308, -1e308, 1e308, 1e308]]) == (0.5e308, np.sqrt(0.75) * 1e308)


def test_verifiers_exact_numeric_and_a_user_function(tmp_path, monkeypatch):
  exact = rewards.verifier("exact")
  assert exact(" <answer> c b a </answer>", "c b a", "p") == 1.0
  assert exact(" <answer>c a b</answer>", "c b a", "p") == 0.0
  assert rewards.verifier("numeric")("so 3 + 4 = 7", "7", "p") == 1.0
  (tmp_path / "myreward.py").write_text(
      "def length(completion, gold, prompt):\n  return len(completion) / 10\n"
      "def bad(completion, gold, prompt):\n  return 'yes'\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  assert rewards.verifier("myreward:length")("abcde", "g", "p") == 0.5
  with pytest.raises(MaxlmError, match="returned 'yes'; a reward is a finite number"):
    rewards.verifier("myreward:bad")("x", "g", "p")
  with pytest.raises(MaxlmError, match="cannot import nope from myreward"):
    rewards.verifier("myreward:nope")
  with pytest.raises(config_lib.ConfigError, match="train.grpo.verify: expected exact"):
    config_lib.from_dict({"stages": [{"seq_len": 32, "batch": 2, "steps": 1}],
                          "train": {"objective": "grpo", "grpo": {"verify": "fuzzy"}}})


def _reference_loss(logp, old, ref, adv, weight, mask, eps, beta):
  """The GRPO loss token by token in plain Python."""
  total, kl_sum, clipped, count = 0.0, 0.0, 0, 0
  for i in range(logp.size):
    if not mask.flat[i]:
      continue
    ratio = np.exp(logp.flat[i] - old.flat[i])
    a = adv.flat[i]
    pg = min(ratio * a, min(max(ratio, 1 - eps), 1 + eps) * a)
    x = ref.flat[i] - logp.flat[i]
    kl = np.exp(x) - x - 1
    total += weight.flat[i] * -(pg - beta * kl)
    kl_sum += kl
    clipped += (ratio < 1 - eps and a < 0) or (ratio > 1 + eps and a > 0)
    count += 1
  return total / weight.sum(), kl_sum / count, clipped / count


@pytest.mark.parametrize("norm", ["token", "sequence"])
def test_loss_matches_a_hand_computation_on_a_toy_batch(norm):
  # two completions of one prompt packed in a row: a 3-token prompt, completions of 4 and 2
  groups = [rollouts.segments([BOS, 7, 8], [[10, 11, 12, EOS], [13, EOS]])]
  batch = rollouts.pack(groups, np.array([[1.0, -1.0]]), 1, 16, PAD, norm)
  rng = np.random.default_rng(0)
  logp = -rng.random((1, 16)).astype(np.float32)
  old = logp + rng.normal(0, 0.3, (1, 16)).astype(np.float32)  # some ratios leave the clip
  ref = logp + rng.normal(0, 0.2, (1, 16)).astype(np.float32)
  mask = batch["loss_mask"]
  total, sums = grpo.token_terms(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(ref),
                                 jnp.asarray(batch["advantages"]),
                                 jnp.asarray(batch["weights"]), jnp.asarray(mask), 0.2, 0.1)
  want, kl, clip = _reference_loss(logp.astype(np.float64), old, ref, batch["advantages"],
                                   batch["weights"], mask, 0.2, 0.1)
  assert float(total) / float(sums["weight"]) == pytest.approx(want, rel=1e-5)
  assert float(sums["kl"]) / float(sums["count"]) == pytest.approx(kl, rel=1e-5)
  assert float(sums["clip_fraction"]) / float(sums["count"]) == pytest.approx(clip)
  assert 0 < clip < 1
  # token: each of the 6 completion tokens weighs 1; sequence: each completion weighs 1
  assert float(sums["weight"]) == pytest.approx(6.0 if norm == "token" else 2.0)


def test_rollout_batch_obeys_the_preference_shape_rules():
  """Shared prompt, masked prompt, EOS learned (only when sampled), no padding read, each
  completion its own segment with positions from 0."""
  prompt_a, prompt_b = [BOS, 5, 6, 7], [BOS, 9]
  comps_a = [[20, 21, EOS], [22, EOS], [23, 24, 25, 26]]  # the last was cut: no EOS
  comps_b = [[30, EOS], [31, 32, EOS], [33, EOS]]
  groups = [rollouts.segments(prompt_a, comps_a), rollouts.segments(prompt_b, comps_b)]
  adv = np.array([[0.5, -1.0, 0.25], [2.0, -2.0, 0.0]])
  batch = rollouts.pack(groups, adv, 3, 16, PAD, "token")
  seen = []
  for r in range(3):
    seg = batch["segment_ids"][r]
    for k in sorted(set(seg.tolist()) - {0}):
      at = np.nonzero(seg == k)[0]
      assert (np.diff(at) == 1).all()  # contiguous
      assert batch["positions"][r, at].tolist() == list(range(len(at)))
      inputs, targets = batch["inputs"][r, at], batch["targets"][r, at]
      mask, a = batch["loss_mask"][r, at], batch["advantages"][r, at]
      prompt = prompt_a if inputs[1:4].tolist() == prompt_a[1:] and len(inputs) > 4 else prompt_b
      assert inputs[:len(prompt)].tolist() == prompt  # the group's prompt, repeated whole
      assert (mask[:len(prompt) - 1] == 0).all() and (mask[len(prompt) - 1:] == 1).all()
      completion = targets[len(prompt) - 1:].tolist()
      seen.append(completion)
      assert (a == np.where(mask, a[-1], 0)).all()  # one advantage on the completion's tokens
    pad = seg == 0
    assert (batch["loss_mask"][r][pad] == 0).all() and (batch["weights"][r][pad] == 0).all()
    assert (batch["advantages"][r][pad] == 0).all() and (batch["inputs"][r][pad] == PAD).all()
  assert sorted(map(tuple, seen)) == sorted(map(tuple, comps_a + comps_b))
  # EOS is a learned target exactly where it was sampled; the cut completion ends without one
  eos_targets = int(((batch["targets"] == EOS) & (batch["loss_mask"] == 1)).sum())
  assert eos_targets == 5
  with pytest.raises(MaxlmError, match="do not fit the stage's batch of 1 rows x 16"):
    rollouts.pack(groups, adv, 1, 16, PAD, "token")


def _tiny(seq_len=32, batch=8):
  from maxlm.model import build
  from maxlm.parallel import mesh as mesh_lib
  from maxlm.train import optimizer, step as step_lib
  cfg = config_lib.from_dict({"model": MODEL, "stages": [{"seq_len": seq_len, "batch": batch,
                                                          "steps": 1, "attention": "reference"}],
                              "train": {"objective": "grpo", "lr": 0.01}})
  mesh = mesh_lib.make_mesh(cfg.stages[0].mesh)
  model = build.model_for(cfg, 0, mesh, 64)
  opt, schedule = optimizer.make(cfg.train, 10)
  state = step_lib.init_state(model, opt, mesh, cfg.rules, 0, seq_len)
  return cfg, mesh, model, opt, schedule, state


def _toy_batch(rows=8, seq_len=32, seed=0):
  rng = np.random.default_rng(seed)
  groups, adv = [], []
  for _ in range(rows):
    prompt = [BOS] + rng.integers(3, 64, 3).tolist()
    comps = [rng.integers(3, 64, rng.integers(1, 8)).tolist() + [EOS] for _ in range(2)]
    groups.append(rollouts.segments(prompt, comps))
    adv.append([1.0, -1.0])
  return rollouts.pack(groups, np.array(adv), rows, seq_len, PAD, "token")


def test_no_completion_sees_another():
  """Changing one completion's tokens leaves every other completion's log-probs unchanged."""
  from maxlm.parallel import mesh as mesh_lib
  from maxlm.train import dpo
  cfg, mesh, model, _, _, state = _tiny()
  batch = _toy_batch()
  seg = batch["segment_ids"]
  assert seg[0].max() >= 2
  other = {k: v.copy() for k, v in batch.items()}
  at = seg[0] == 1
  other["inputs"][0, at] = np.where(other["loss_mask"][0, at] == 1, 63, other["inputs"][0, at])
  fn = jax.jit(lambda p, b: dpo.forward(model, p, b, cfg.rules, 64)[0])
  with mesh:
    a = np.asarray(fn(state["params"], mesh_lib.place_batch(batch, mesh, cfg.rules)))
    b = np.asarray(fn(state["params"], mesh_lib.place_batch(other, mesh, cfg.rules)))
  untouched = seg != 1
  untouched[1:] = True
  assert (a[untouched] == b[untouched]).all()
  assert not (a[0, at] == b[0, at]).all()  # the changed completion's own log-probs moved


def test_first_step_has_kl_zero_against_itself_and_ratio_one():
  from maxlm.parallel import mesh as mesh_lib
  cfg, mesh, model, opt, schedule, state = _tiny()
  cfg_grpo = cfg.train.grpo
  update = jax.jit(grpo.make_update(model, opt, schedule, cfg.rules, model.cfg, 1,
                                    cfg_grpo.__class__(beta=0.5, inner_steps=2)))
  placed = mesh_lib.place_batch(_toy_batch(), mesh, cfg.rules)
  ref = jax.tree_util.tree_map(jnp.copy, state["params"])
  with mesh:
    state1, m0, old = update(state, placed, placed["advantages"], ref, jnp.int32(0))
    state2, m1, _ = update(state1, placed, old, ref, jnp.int32(1))
  assert float(m0["kl"]) == 0.0 and float(m0["ratio"]) == 1.0
  assert float(m0["clip_fraction"]) == 0.0
  assert float(m1["kl"]) > 0 and float(m1["ratio"]) != 1.0  # the policy moved
  # the learning-rate step advances once per batch of rollouts, after its last inner step
  assert int(state1["step"]) == 0 and int(state2["step"]) == 1


def test_grad_accum_equals_one_big_batch():
  from maxlm.parallel import mesh as mesh_lib
  out = []
  for accum in (1, 2):
    cfg, mesh, model, opt, schedule, state = _tiny(batch=16)
    ref = jax.tree_util.tree_map(lambda x: x * 0.9, state["params"])
    update = jax.jit(grpo.make_update(model, opt, schedule, cfg.rules, model.cfg, accum,
                                      cfg.train.grpo))
    placed = mesh_lib.place_batch(_toy_batch(16), mesh, cfg.rules)
    with mesh:
      new, m, _ = update(state, placed, placed["advantages"], ref, jnp.int32(0))
    out.append((new["params"], {k: float(v) for k, v in m.items()}))
  (p1, m1), (p2, m2) = out
  for k in ("grpo_loss", "kl", "grad_norm", "loss_tokens"):
    assert m1[k] == pytest.approx(m2[k], rel=1e-4), k
  for a, b in zip(jax.tree_util.tree_leaves(p1), jax.tree_util.tree_leaves(p2)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_step_prompts_and_seeds_depend_only_on_seed_and_step():
  a = rollouts.step_prompts(10, 4, 0, 0, 3)
  assert a == rollouts.step_prompts(10, 4, 0, 0, 3) and len(set(a)) == 4
  epoch = [i for k in range(5) for i in rollouts.step_prompts(10, 4, 0, 0, k)][:10]
  assert sorted(epoch) == list(range(10))  # an epoch visits every prompt once
  assert rollouts.step_prompts(10, 4, 1, 0, 3) != a
  assert rollouts.rollout_seed(0, 5) == rollouts.rollout_seed(0, 5) != rollouts.rollout_seed(0, 6)


def test_stage_objective_overrides_train_objective():
  cfg = config_lib.from_dict({"stages": [{"seq_len": 32, "batch": 2, "steps": 1},
                                         {"seq_len": 32, "batch": 2, "steps": 1,
                                          "objective": "grpo"}]})
  assert [cfg.objective_for(i) for i in range(2)] == ["lm", "grpo"]
  with pytest.raises(config_lib.ConfigError, match="stages.0.objective: expected lm, dpo or"):
    config_lib.from_dict({"stages": [{"seq_len": 32, "batch": 2, "steps": 1,
                                      "objective": "ppo"}]})


# --- a GRPO stage end to end: the recipe's task (tools/rl_task.py), resumed bit for bit ---

def _tool(name):
  spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
  tool = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(tool)
  return tool


def _config(path, run_dir, data_dir, **extra):
  raw = {"seed": 0, "run_dir": str(run_dir), "data": {"dir": str(data_dir)},
         "stages": [{"seq_len": 128, "batch": 8, "steps": 6, "attention": "blockwise",
                     "block_q": 32, "block_k": 32}],
         "model": MODEL, "train": {"lr": 0.01, "warmup_steps": 2, "checkpoint_every": 100,
                                   "eval_every": 0, "keep": 5}}
  for key, value in extra.items():
    raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
  path.write_text(yaml.safe_dump(raw))
  return config_lib.load(str(path))


@pytest.fixture(scope="module")
def task(tmp_path_factory, demo_data):
  """The reversal task prepared with the demo tokenizer, and a model trained on it briefly."""
  from maxlm.data import prepare
  from maxlm.train import loop
  tmp = tmp_path_factory.mktemp("grpo")
  sft, rl, held = _tool("rl_task").task(n_sft=200, n_heldout=16)
  for name, rows in (("sft", sft), ("prompts", rl), ("heldout", held)):
    (tmp / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  prepare.prepare([str(tmp / "sft.jsonl"), str(tmp / "prompts.jsonl")], str(tmp / "data"),
                  prepare.Options(tokenizer_file=str(demo_data / "tokenizer.model"),
                                  val_fraction=0.0, progress=False))
  loop.train(_config(tmp / "sft.yaml", tmp / "sft", tmp / "data"), log=lambda *a: None)
  return tmp


def _grpo(task, name, **train):
  return _config(task / f"{name}.yaml", task / name, task / "data",
                 init={"from": str(task / "sft")},
                 stages=[{"seq_len": 128, "batch": 8, "steps": 4, "attention": "blockwise",
                          "block_q": 32, "block_k": 32}],
                 train={"objective": "grpo", "lr": 0.003, "checkpoint_every": 2,
                        "eval_every": 2, "grpo": {"group": 4, "prompts": 4,
                                                  "max_new_tokens": 16, "inner_steps": 2,
                                                  "eval_prompts": str(task / "heldout.jsonl"),
                                                  "eval_samples": 2, **train}})


def _rows(run_dir):
  return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


@pytest.mark.slow
def test_grpo_stage_runs_logs_rollouts_and_resumes_bitwise(task):
  from maxlm.train import loop, stage as stage_lib
  loop.train(_grpo(task, "grpo"), log=lambda *a: None)
  rows = _rows(task / "grpo")
  assert [r["step"] for r in rows] == [0, 1, 2, 3]
  assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the first step's policy is the ref
  for key in ("reward_mean", "reward_std", "zero_std_groups", "clip_fraction",
              "completion_len", "gen_s", "train_s", "prompt_tokens/rl"):
    assert key in rows[0], key
  assert "eval_pass@1" in rows[1] and "eval_pass@1" not in rows[0]
  rollout_rows = [json.loads(line) for line in open(task / "grpo" / "rollouts.jsonl")]
  assert len(rollout_rows) == 4 * 4 * 4
  assert set(rollout_rows[0]) == {"step", "prompt_id", "completion", "reward"}
  # stopped after step 2 (the process ends; its state is only what the checkpoint holds),
  # resumed: the same rollouts and losses, bit for bit
  cfg2 = _grpo(task, "grpo2")
  assert loop.train(cfg2, stop_after=2, log=lambda *a: None)["stopped"]
  stage_lib.clear_cache()
  loop.train(cfg2, log=lambda *a: None)
  again = _rows(task / "grpo2")
  for key in ("loss", "kl", "reward_mean", "grad_norm", "fingerprint", "eval_pass@1"):
    assert [r.get(key) for r in again] == [r.get(key) for r in rows], key
  assert open(task / "grpo2" / "rollouts.jsonl").read() == open(
      task / "grpo" / "rollouts.jsonl").read()


@pytest.mark.slow
def test_beta_needs_a_reference(task):
  from maxlm.train import loop
  cfg = _config(task / "noref.yaml", task / "noref", task / "data",
                train={"objective": "grpo", "grpo": {"group": 2, "prompts": 2}})
  with pytest.raises(MaxlmError, match="train.grpo.beta > 0 needs a reference model"):
    loop.train(cfg, log=lambda *a: None)


@pytest.mark.slow
def test_sft_then_grpo_in_one_schedule(task):
  """stages.N.objective: an LM stage, then a GRPO stage, in one run."""
  from maxlm.train import loop
  stage = {"seq_len": 128, "batch": 8, "steps": 2, "attention": "blockwise", "block_q": 32,
           "block_k": 32}
  cfg = _config(task / "both.yaml", task / "both", task / "data",
                init={"from": str(task / "sft")},
                stages=[stage, {**stage, "objective": "grpo"}],
                train={"lr": 0.001, "grpo": {"group": 2, "prompts": 4, "max_new_tokens": 16}})
  loop.train(cfg, log=lambda *a: None)
  rows = _rows(task / "both")
  assert [("reward_mean" in r, r["stage"]) for r in rows] == [(False, 0), (False, 0),
                                                               (True, 1), (True, 1)]
  assert len(open(task / "both" / "rollouts.jsonl").readlines()) == 2 * 4 * 2


def test_a_user_verifier_that_misbehaves_is_one_line_naming_the_key(tmp_path, monkeypatch):
  (tmp_path / "userverify.py").write_text(
      "def boom(c, g, p):\n  raise ValueError('boom')\n"
      "def huge(c, g, p):\n  return 10**400\n"
      "def np32(c, g, p):\n  import numpy\n  return numpy.float32(0.5)\n"
      "not_a_function = 3\n")
  (tmp_path / "badimport.py").write_text("raise RuntimeError('at import')\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  assert rewards.verifier("userverify:np32")("c", "g", "p") == 0.5
  for spec, words in (("userverify:boom", "raised ValueError: boom"),
                      ("userverify:huge", "a reward is a finite number"),
                      ("userverify:not_a_function", "is not a function"),
                      ("badimport:f", "RuntimeError: at import"),
                      ("os:system", "raised TypeError")):
    with pytest.raises(MaxlmError) as e:
      rewards.verifier(spec)("completion", "gold", "prompt")
    assert str(e.value).startswith(f"train.grpo.verify={spec}") and words in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("line, words", [("{not json", "not JSON"),
                                         ('{"id": "a", "prompt": "p", "gold": "g"}', "source"),
                                         ("[1, 2]", "id, source, prompt, gold")])
def test_a_broken_prompts_file_names_its_line(tmp_path, line, words):
  from maxlm.data import prepare
  good = json.dumps({"id": "x", "source": "rl", "prompt": "p", "gold": "g"})
  (tmp_path / prepare.PROMPTS).write_text(good + "\n" + line + "\n")
  with pytest.raises(MaxlmError) as e:
    rollouts.read_prompts(str(tmp_path), {"rl": 1.0})
  assert f"{prepare.PROMPTS}:2:" in str(e.value) and words in str(e.value)
