"""A per-device memory estimate for a stage of a config on n devices, before renting them.

Counted, per device, from the config alone:
  state        float32 parameters, their gradients, and AdamW's two moments (16 bytes per
               parameter), each divided over the mesh axes its logical axes map to;
  activations  what the backward pass keeps: with `remat: full` each layer's input
               ([rows, L, d_model] in the compute dtype) plus one layer's working set while it
               is recomputed; `dots` / `dots_no_batch` keep the matmul outputs of every layer
               too; `none` keeps every layer's working set. A layer's working set is taken as
               float32 [rows, L, 4 d_model + 3 d_ff + 2 (heads + kv heads) head_dim];
  logits       one `loss_chunk` of float32 logits and their gradient.
It ignores XLA's temporary buffers and fragmentation, so a config should leave ~25% of the
device's memory free beyond it (tests/test_launch.py checks the shipped configs that way).
"""

import math

import numpy as np

from maxlm.parallel import mesh as mesh_lib
from maxlm import config as config_lib


def estimate(config, s, n_devices, vocab):
  """{part: bytes per device} and "total" for stage s of config on n_devices."""
  from maxlm.model import build
  stage, m = config.stages[s], config.model
  shape = dict(zip(config_lib.MESH_AXES, mesh_lib.mesh_shape(stage.mesh, n_devices)))
  ways = lambda name: int(np.prod([shape[a] for a in config.rules.get(name, ())] or [1]))
  per_device = 0
  for _, dims, names in build.param_axes(config, vocab):
    per_device += math.prod(dims) / math.prod(ways(n) if n else 1 for n in names)
  rows = stage.batch // config.train.grad_accum / ways("batch")
  length = stage.seq_len / ways("length")
  act = np.dtype(m.dtype).itemsize if m.dtype != "bfloat16" else 2
  width = 4 * m.d_model + 3 * m.d_ff + 2 * (m.n_heads + m.n_kv_heads) * m.head_dim
  working = rows * length * width * 4
  kept = {"full": rows * length * m.d_model * act,
          "dots": rows * length * width * act, "dots_no_batch": rows * length * width * act,
          "none": working}[m.remat]
  parts = {"state": 16 * per_device,
           "activations": m.n_layers * kept + (working if m.remat != "none" else 0),
           "logits": 2 * 4 * min(m.loss_chunk, rows * length) * vocab}
  return {**parts, "total": sum(parts.values())}
