"""The model sizes of a sweep: shapes, their parameter counts, and the automatic grid.

N counts every parameter, embeddings included, as Chinchilla (Hoffmann et al., 2022) did; the
sweep says so in its output, because at laptop scale the embedding table is most of a model
and the optimal D/N then comes out far above the often quoted 20.

The automatic grid, per budget C:
  1. the expected optimum is N* = sqrt(C / (6 * 20)) (D/N = 20);
  2. the window is [N*/10, 10 N*] (two decades), clipped below by the smallest shape of the
     ladder and above by the largest N that still gets `min_steps` optimizer steps, then
     shifted up if the clipping left less than two decades;
  3. `points` targets are spaced evenly in log N across the window, and each takes the ladder
     shape nearest in log N (each shape at most once per budget).
The ladder is one family of shapes, so that neighbouring sizes differ in scale, not in kind:
widths 8..2048 (the narrowest for tiny budgets, where the embedding table bounds N from
below), depth growing linearly with width up to 6 layers at 256 (the 1 x 32 ... 6 x 256
family of laptop-scale sweeps), then as its square root (12 layers at 1024, 17 at 2048).
"""

import dataclasses
import math
import re

from maxlm import MaxlmError
from maxlm.config import MODEL_SIZES

CHINCHILLA_TOKENS_PER_PARAM = 20
WIDTHS = (8, 12, 16, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256, 320, 384, 512, 640, 768, 1024,
          1280, 1536, 2048)


@dataclasses.dataclass(frozen=True)
class Shape:
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  d_ff: int
  name: str = ""

  @property
  def label(self):
    return self.name or f"{self.d_model}x{self.n_layers}"

  def model_keys(self):
    return {k: getattr(self, k) for k in ("d_model", "n_layers", "n_heads", "n_kv_heads",
                                          "head_dim", "d_ff")}


def shape_for(d_model, n_layers):
  """A Llama-style shape: heads of 32 below width 128 and of 64 above, half as many KV heads
  (grouped-query attention) where that divides, and an MLP three times the width."""
  head_dim = 32 if d_model < 128 else 64
  head_dim = min(head_dim, d_model)
  if d_model % head_dim:
    head_dim = math.gcd(d_model, head_dim)
  n_heads = d_model // head_dim
  n_kv = n_heads // 2 if n_heads % 2 == 0 else n_heads
  return Shape(d_model, n_layers, n_heads, n_kv, head_dim, 3 * d_model)


def n_params(shape, vocab_size, tied, model=None, active=False):
  """Every parameter of the decoder (maxlm/model/transformer.py), embeddings included. With
  `model` (the base config's model section) the shape's layers follow its model.moe: an MoE
  layer counts the router and all experts, or with `active` only those a token goes through
  (router, top_k routed and the shared experts: the N whose 6 N D is a run's FLOPs)."""
  d, hd = shape.d_model, shape.head_dim
  attention = d * hd * (2 * shape.n_heads + 2 * shape.n_kv_heads)
  mlp = 3 * d * shape.d_ff
  per_layer = attention + mlp + 2 * d  # two RMSNorm scales
  embeddings = vocab_size * d * (1 if tied else 2)
  total = shape.n_layers * per_layer + embeddings + d  # + the final norm
  if model is None or not model.moe.experts:
    return total
  from maxlm.model import build, layers
  cfg = dataclasses.replace(model, **shape.model_keys())
  moe_layers = sum(spec.moe for spec in layers.specs(cfg))
  return total + moe_layers * (build.mlp_weights(cfg, True, active) - mlp)


def depth_for(d_model):
  if d_model <= 256:
    return max(1, round(d_model / 40))
  return round(6 * math.sqrt(d_model / 256))


def ladder():
  return [shape_for(d, depth_for(d)) for d in WIDTHS]


def parse_sizes(text):
  """`NAME,...` (named sizes of maxlm/config.py) or `D_MODELxN_LAYERS,...` -> [Shape]."""
  shapes = []
  for item in (s.strip() for s in text.split(",")):
    if item in MODEL_SIZES:
      shapes.append(Shape(**MODEL_SIZES[item], name=item))
      continue
    match = re.fullmatch(r"(\d+)\s*[x×*]\s*(\d+)", item)
    if not match or not int(match[1]) or not int(match[2]):
      raise MaxlmError(f"--sizes: {item!r} is neither a named size ({', '.join(MODEL_SIZES)}) "
                       f"nor D_MODELxN_LAYERS such as 128x4")
    shapes.append(shape_for(int(match[1]), int(match[2])))
  if len({s.label for s in shapes}) < len(shapes):
    raise MaxlmError(f"--sizes: {text!r} names a size twice")
  return shapes


def auto_grid(budget, vocab_size, tied, tokens_per_step, points=6, min_steps=25):
  """The shapes for one budget (steps 1-3 of the module docstring), smallest first."""
  shapes = sorted(ladder(), key=lambda s: n_params(s, vocab_size, tied))
  sizes = [n_params(s, vocab_size, tied) for s in shapes]
  largest = budget / (6 * min_steps * tokens_per_step)  # D = C / 6N >= min_steps batches
  usable = [(s, n) for s, n in zip(shapes, sizes) if n <= largest]
  if len(usable) < 3:
    raise MaxlmError(f"budget {budget:.3g} FLOPs is too small: fewer than 3 model sizes get "
                     f"{min_steps} steps of {tokens_per_step} tokens (raise the budget or "
                     f"lower the first stage's batch or seq_len)")
  expected = math.sqrt(budget / (6 * CHINCHILLA_TOKENS_PER_PARAM))
  low, high = max(expected / 10, usable[0][1]), min(expected * 10, usable[-1][1])
  if high < low * 100:  # keep two decades where the clipping allows
    high = min(low * 100, usable[-1][1])
    low = max(high / 100, usable[0][1])
  chosen = []
  for i in range(points):
    target = math.log(low) + (math.log(high) - math.log(low)) * i / max(points - 1, 1)
    free = [(s, n) for s, n in usable if s not in chosen]
    if not free:
      break
    chosen.append(min(free, key=lambda sn: abs(math.log(sn[1]) - target))[0])
  return sorted(set(chosen), key=lambda s: n_params(s, vocab_size, tied))
