"""maxlm's logits against transformers' on the same weights: the check that an export means
what the run trained (tests/test_interop.py and tools/bench_interop.py run it).

`random_folder` writes random maxlm parameters (large enough that every tensor matters) as a
Llama folder through the export's own writer; `maxlm_logits` runs the maxlm decoder on a packed
batch; `hf_logits` runs `AutoModelForCausalLM` on each document alone (torch, float32).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from maxlm import config as config_lib
from maxlm.data import tokenizer as tok_lib
from maxlm.interop import export, families, layout, tensor_map
from maxlm.model import build


class ParamsSource:
  """In-memory maxlm parameters as `export.write_model` reads a source."""

  def __init__(self, model_cfg, params, moe_bias=None):
    self.model_cfg, self._tensors = model_cfg, {}
    self._trees = {"params": params, "moe_bias": moe_bias}
    for leaf in layout.leaves(model_cfg, biased=moe_bias is not None):
      array = self.array(leaf)
      for row, i in enumerate(leaf.layer_ids()) if leaf.per_layer else [(None, None)]:
        for name, value in leaf.to_hf(array[row] if i is not None else array).items():
          self._tensors[tensor_map.hf_layer_name(i, name) if i is not None else name] = value

  def array(self, leaf):
    if leaf.path is None:
      return None
    return np.asarray(_at(self._trees[leaf.collection], leaf.path))

  def names(self):
    return list(self._tensors)

  def get(self, name):
    return self._tensors[name]


def _at(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def config_for(model, stages, vocab=256):
  """A Config for `model` (ModelConfig keys) and `stages` (StageConfig dicts), float32."""
  return config_lib.from_dict({"model": {"size": "tiny", "vocab_size": vocab, "dtype": "float32",
                                         "remat": "none", **model}, "stages": stages})


def random_params(config, seed=0, std=0.15):
  """Random parameters of config's model (numpy): weights ~ N(0, std), norm scales near 1."""
  model = build.model_for(config, len(config.stages) - 1)
  shapes = jax.eval_shape(lambda: build.init_params_abstract(model))
  rng = np.random.default_rng(seed)

  def draw(path, x):
    if "scale" in jax.tree_util.keystr(path):
      return (1 + 0.2 * rng.standard_normal(x.shape)).astype(np.float32)
    return (std * rng.standard_normal(x.shape)).astype(np.float32)
  return model, jax.tree_util.tree_map_with_path(draw, shapes)


def random_bias(model, seed=1, scale=0.05):
  """A random balancing bias shaped like the model's "moe_bias" collection (numpy), big
  enough to change which experts are chosen."""
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_map(
      lambda x: (scale * rng.standard_normal(x.shape)).astype(np.float32),
      build.abstract_collection(model, "moe_bias"))


def random_folder(folder, config, params, moe_bias=None):
  """Writes config.json and the weights of `params` (trained last in the last stage)."""
  meta = {"stage": len(config.stages) - 1, "stage_step": 1, "global_step": 1}
  vocab = config.model.vocab_size
  hf = families.config_json(config, meta, vocab, tok_lib.DEFAULT_SPECIAL, "float32")
  cfg = dataclasses.replace(config.model, vocab_size=vocab)
  export.write_model(str(folder), hf, tok_lib.DEFAULT_SPECIAL,
                     ParamsSource(cfg, params, moe_bias))


def maxlm_logits(model, params, tokens_BxL, segment_ids_BxL, moe_bias=None):
  """[B, L, V] float32 logits; positions restart at each segment."""
  seg = np.asarray(segment_ids_BxL)
  pos = np.zeros_like(seg)
  for r in range(seg.shape[0]):
    for s in np.unique(seg[r][seg[r] > 0]):
      idx = np.flatnonzero(seg[r] == s)
      pos[r, idx] = np.arange(len(idx))
  variables = {"params": params, **({"moe_bias": moe_bias} if moe_bias is not None else {})}
  h, head, _ = jax.jit(model.apply)(variables, jnp.asarray(tokens_BxL, jnp.int32),
                                    jnp.asarray(pos, jnp.int32), jnp.asarray(seg, jnp.int32))
  return np.asarray(h.astype(jnp.float32) @ head.astype(jnp.float32))


def hf_logits(folder, documents):
  """transformers' float32 logits for each document (a list of id lists) run alone."""
  import torch
  import transformers
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
  hf.eval()
  with torch.no_grad():
    return [hf(torch.tensor([doc], dtype=torch.long)).logits[0].numpy() for doc in documents]


def max_difference(model, params, folder, documents, seq_len, moe_bias=None):
  """The largest |maxlm - transformers| logit over `documents`, packed into one maxlm row."""
  row, seg = np.zeros(seq_len, np.int32), np.zeros(seq_len, np.int32)
  at = 0
  for i, doc in enumerate(documents):
    row[at:at + len(doc)], seg[at:at + len(doc)] = doc, i + 1
    at += len(doc)
  ours = maxlm_logits(model, params, row[None], seg[None], moe_bias)[0]
  theirs = hf_logits(folder, documents)
  at, worst = 0, 0.0
  for doc, logits in zip(documents, theirs):
    worst = max(worst, float(np.abs(ours[at:at + len(doc)] - logits).max()))
    at += len(doc)
  return worst
