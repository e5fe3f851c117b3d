"""The batched sampler (maxlm/eval/sample.py) against the one-sequence sampler and a full
recompute: greedy equality, batch-composition independence, seeds, EOS, top-k/top-p, mesh."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from maxlm import MaxlmError
from maxlm.config import MeshConfig
from maxlm.eval import generate, sample
from maxlm.model import build
from maxlm.parallel import mesh as mesh_lib

from smallrun import tiny_model

PROMPTS = [[1, 5, 9, 13], [1, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [1, 40, 41]]


@pytest.fixture(scope="module")
def tiny():
  cfg, mesh, model, params = tiny_model()
  return cfg, model, params


WIDTH = 16  # the full forwards below run right-padded to one length: one compile


_FORWARDS = {}


def _full_logits(model, params, seq):
  """The logits of a full forward of seq; attention is causal, so the padding after it
  changes nothing at its positions."""
  if id(model) not in _FORWARDS:
    @jax.jit
    def forward(params, tokens_1xW, n):
      segments = (jnp.arange(WIDTH) < n).astype(jnp.int32)[None]  # padding: segment 0
      h, head, _ = model.apply({"params": params}, tokens_1xW, jnp.arange(WIDTH)[None],
                               segments)
      return h[0].astype(jnp.float32) @ head.astype(jnp.float32)
    _FORWARDS[id(model)] = (model, forward)  # the model held: its id stays its own
  tokens = np.zeros((1, WIDTH), np.int32)
  tokens[0, :len(seq)] = seq
  return np.asarray(_FORWARDS[id(model)][1](params, tokens, len(seq)))[:len(seq)]


def test_greedy_rows_equal_the_one_sequence_sampler(tiny):
  _, model, params = tiny
  new = sample.sample_batch(model, params, PROMPTS, n_samples=2, max_new_tokens=10,
                            temperature=0)
  for prompt, rows in zip(PROMPTS, new):
    old = generate.sample(model, params, prompt, max_tokens=10, temperature=0)
    assert rows == [old, old]


def test_a_row_does_not_depend_on_the_other_rows(tiny):
  """Prompts of different lengths batched together sample what each samples alone (the
  padding is never attended, positions restart at 0), and more samples per prompt only add
  rows."""
  _, model, params = tiny
  kw = dict(max_new_tokens=12, temperature=1.0, top_k=20, seed=11)
  together = sample.generate_arrays(model, params, PROMPTS, n_samples=2, **kw)
  for i, prompt in enumerate(PROMPTS):
    alone = sample.generate_arrays(model, params, [prompt], n_samples=3, prompt_indices=[i],
                                   **kw)
    np.testing.assert_array_equal(alone[0][:2], together[0][2 * i:2 * i + 2])
    np.testing.assert_array_equal(alone[1][:2], together[1][2 * i:2 * i + 2])
    np.testing.assert_allclose(alone[2][:2], together[2][2 * i:2 * i + 2], rtol=1e-5)
  assert len({tuple(r) for r in together[0]}) == len(together[0])  # every row its own key


def test_a_seed_reproduces_every_sample(tiny):
  _, model, params = tiny
  runs = [sample.sample_batch(model, params, PROMPTS, n_samples=3, max_new_tokens=8,
                              temperature=1.0, seed=s) for s in (5, 5, 6, 2**64 - 1)]
  assert runs[0] == runs[1]
  assert runs[0] != runs[2] and runs[0] != runs[3]


def test_rows_stop_at_eos_and_are_padding_after_it(tiny):
  _, model, params = tiny
  kw = dict(n_samples=4, max_new_tokens=16, temperature=1.0, seed=3)
  free, _, _ = sample.generate_arrays(model, params, PROMPTS, **kw)
  eos = int(np.bincount(free[:, :8].ravel()).argmax())  # a token most rows sample early
  tokens, lengths, logprobs = sample.generate_arrays(model, params, PROMPTS, eos_id=eos, **kw)
  stopped = 0
  for row, n, lp, unstopped in zip(tokens, lengths, logprobs, free):
    np.testing.assert_array_equal(row[:n], unstopped[:n])  # the same draws up to EOS
    hits = np.flatnonzero(unstopped == eos)
    assert n == (hits[0] + 1 if len(hits) else 16)
    assert eos not in row[:n - 1]
    assert (row[n:] == sample.PAD).all() and (lp[n:] == 0).all() and (lp[:n] < 0).all()
    stopped += n < 16
  assert 0 < stopped < len(tokens)  # some rows stopped early, the others ran to the end
  lists = sample.sample_batch(model, params, PROMPTS, eos_id=eos, **kw)
  flat = [r for rows in lists for r in rows]
  assert [len(r) for r in flat] == lengths.tolist()
  assert all(r[-1] == eos for r, n in zip(flat, lengths) if n < 16)


def test_choose_draws_from_the_top_k_and_top_p_nucleus_in_proportion():
  """4000 draws (fixed keys) of one distribution: the support is exactly the kept tokens, and
  each is drawn about as often as its renormalised probability."""
  probs = np.array([0.1, 0.4, 0.2, 0.3])
  logits = jnp.log(jnp.tile(jnp.asarray(probs, jnp.float32), (4000, 1)))
  keys = jax.random.split(jax.random.key(0), 4000)
  for kw, kept in (({}, [0, 1, 2, 3]), ({"top_k": 2}, [1, 3]), ({"top_p": 0.5}, [1, 3]),
                   ({"top_p": 0.75}, [1, 2, 3]), ({"top_p": 0.01}, [1]),
                   ({"top_k": 3, "top_p": 0.5}, [1, 3])):
    drawn = np.bincount(np.asarray(sample.choose(logits, keys, 1.0, **kw)), minlength=4)
    assert np.flatnonzero(drawn).tolist() == kept, kw
    expected = np.zeros(4)
    expected[kept] = probs[kept] / probs[kept].sum()
    assert np.abs(drawn / 4000 - expected).max() < 0.03, (kw, drawn)
  hot = np.asarray(sample.choose(logits * 4, keys, 4.0))  # temperature divides the logits
  np.testing.assert_array_equal(hot, np.asarray(sample.choose(logits, keys, 1.0)))


def test_sampled_tokens_stay_in_the_support_and_logprobs_are_unscaled(tiny):
  """Against a full forward of each prefix: every token is among the top-k, and its log-prob
  is log softmax of the unscaled logits (temperature and top-k not applied)."""
  _, model, params = tiny
  tokens, lengths, logprobs = sample.generate_arrays(
      model, params, PROMPTS[:2], n_samples=2, max_new_tokens=6, temperature=1.7, top_k=3,
      seed=1)
  for r in range(4):
    prompt = PROMPTS[r // 2]
    logits = _full_logits(model, params, prompt + tokens[r, :5].tolist())
    for t in range(6):
      step = logits[len(prompt) - 1 + t]
      assert tokens[r, t] in np.argsort(step)[-3:]
      expected = step[tokens[r, t]] - np.log(np.exp(step - step.max()).sum()) - step.max()
      assert abs(logprobs[r, t] - expected) < 1e-4
  greedy = sample.sample_batch(model, params, PROMPTS, n_samples=1, max_new_tokens=6,
                               temperature=0)
  for kw in ({"top_k": 1}, {"top_p": 1e-6}):
    assert sample.sample_batch(model, params, PROMPTS, n_samples=2, max_new_tokens=6,
                               temperature=1.0, seed=9, **kw) == [r * 2 for r in greedy]


def test_rows_split_over_the_mesh_sample_the_same(tiny):
  cfg, model, params = tiny
  mesh = mesh_lib.make_mesh(MeshConfig(2, 2, 1, 1), jax.devices()[:4])
  sharded_model = build.model_for(cfg, 0, mesh)
  placed = jax.device_put(params, NamedSharding(mesh, P()))
  kw = dict(n_samples=1, max_new_tokens=8, temperature=1.0, seed=4)  # 3 rows over 4 shards
  alone = sample.generate_arrays(model, params, PROMPTS[:3], **kw)
  split = sample.generate_arrays(sharded_model, placed, PROMPTS[:3], mesh=mesh, **kw)
  np.testing.assert_array_equal(alone[0], split[0])
  np.testing.assert_array_equal(alone[1], split[1])


def test_settings_it_cannot_honour_are_one_line(tiny):
  _, model, params = tiny
  for kw, words in (({"top_p": 0.0}, "top_p must be in (0, 1]"),
                    ({"top_k": 65}, "top_k must be in [0, 64]"),
                    ({"temperature": float("nan")}, "temperature must be"),
                    ({"n_samples": 0}, "n_samples must be >= 1"),
                    ({"seed": -1}, "seed must be in [0, 2**64)")):
    args = {"n_samples": 1, "max_new_tokens": 2, "temperature": 1.0, **kw}
    with pytest.raises(MaxlmError, match=re.escape(words)):
      sample.sample_batch(model, params, PROMPTS, **args)
  with pytest.raises(MaxlmError, match="at least one token"):
    sample.sample_batch(model, params, [[1], []], n_samples=1, max_new_tokens=2,
                        temperature=0)


def test_moe_and_local_layers_sample_through_the_decoders_own_path():
  """A model with MoE layers and local-window layers: batched greedy rows equal greedy by full
  recompute, and the balancing bias passed as a collection is the one the forward pass uses."""
  from maxlm import config as config_lib
  cfg = config_lib.from_dict({
      "model": {"size": "tiny", "vocab_size": 64, "dtype": "float32", "d_model": 32,
                "n_layers": 4, "n_heads": 2, "n_kv_heads": 1, "head_dim": 16, "d_ff": 64,
                "moe": {"experts": 4, "top_k": 2, "every": 2},
                "attention": {"window": 3, "global_every": 2}},
      "stages": [{"seq_len": 32, "batch": 1, "steps": 1, "attention": "reference"}]})
  mesh = mesh_lib.make_mesh(MeshConfig(1, 1, 1, 1), jax.devices()[:1])
  model = build.model_for(cfg, 0, mesh)
  params = build.init_params(model, jax.random.key(5), mesh, cfg.rules, 32)
  rng = np.random.default_rng(0)
  bias = jax.tree_util.tree_map(lambda x: (0.5 * rng.standard_normal(x.shape)).astype(
      np.float32), build.abstract_collection(model, "moe_bias"))
  width = max(len(p) for p in PROMPTS) + 4

  @jax.jit
  def next_token(variables, ids_1xW, n):
    # The full forward of the first n tokens, right-padded to one width (one compile): the
    # attention is causal and padding (segment 0) is not routed, so position n-1 sees only
    # the sequence itself.
    segments = (jnp.arange(width) < n).astype(jnp.int32)[None]
    h, head, _ = model.apply(variables, ids_1xW, jnp.arange(width)[None], segments)
    return jnp.argmax(h[0, n - 1] @ head)

  logprobs = []
  for collections in (None, {"moe_bias": bias}):
    tokens, _, lp = sample.generate_arrays(model, params, PROMPTS, n_samples=1,
                                           max_new_tokens=4, temperature=0,
                                           collections=collections)
    logprobs.append(lp)
    variables = {"params": params, **(collections or {})}
    for prompt, row in zip(PROMPTS, tokens):
      seq = list(prompt)
      for _ in range(4):
        ids = np.zeros((1, width), np.int32)
        ids[0, :len(seq)] = seq
        seq.append(int(next_token(variables, ids, len(seq))))
      assert row.tolist() == seq[len(prompt):]
  assert not np.array_equal(*logprobs)  # the bias changed the routing


@pytest.mark.parametrize("temperature", [1e-30, 1e-38, 1e-45, 1e-300])
def test_a_vanishing_temperature_samples_the_argmax_not_nan(temperature):
  logits_NxV = jnp.array([[1.0, 3.0, 2.0, -1.0], [0.5, -2.0, 0.0, 4.0]])
  keys_N = jax.random.split(jax.random.key(0), 2)
  for top_k, top_p in ((0, 1.0), (2, 1.0), (0, 0.5)):
    np.testing.assert_array_equal(sample.choose(logits_NxV, keys_N, temperature, top_k, top_p),
                                  [1, 3])
