"""A per-device memory estimate for a stage of a config on n devices, before renting them
(`maxlm memory CONFIG`), and XLA's own accounting of the compiled train step to check it.

Counted per device, from the config alone (D d_model, F d_ff, h and k the query and KV heads a
device holds, hd head_dim, N = rows x positions a device holds per micro-batch):
  params       float32 parameters, each divided over the mesh axes its logical axes map to;
  optimizer    AdamW's two float32 moments, sharded as their parameters (8 bytes a parameter);
  gradients    float32, as the parameters; twice with grad_accum > 1 (the running sum too);
  activations  what the backward pass keeps of every layer, by `model.remat`, in the compute
               dtype: `none` every intermediate, 7D + 3(h + k)hd + 5F a position; `full` the
               layer's input, D; `dots` / `dots_no_batch` the matmul outputs, 2D + (h+2k)hd + 2F;
  working      the backward pass's live set for one layer (recomputed first under remat), in
               elements W_F F + W_A (h + k)hd + W_D D a position, the W fitted per policy
               to XLA's accounting (below), of `FIT`'s bytes an element for the platform (4
               on a CPU, 2.75 on TPU, 1.75 on GPU: those keep much in the compute dtype),
               plus under fsdp one layer's gathered weights, and on GPU an MoE layer's tile
               copies (`_tile_copies`);
  attention    temporaries beyond that: `reference` attention's [rows, h, L, L] float32 scores
               (kept per layer under remat none); under context parallelism the all-gathered K
               and V, and q, k, v and the output (and their gradients) at full length, which
               the zigzag permutation of the sequence (attention/context.py) makes;
               the tiled implementations' O(L x tile) blocks are within `working`;
  logits       the loss's chunk of float32 logits [rows, loss_chunk, vocab] (`FIT`'s copies: 3
               on a CPU, 1.5 on TPU and GPU)
               and d(hidden) [N, D]; it peaks at another moment than `working` + `attention`, so
               the total counts the larger of the two.
Stages whose objective holds a frozen reference model (dpo; grpo with beta > 0) add a float32
copy of the parameters (counted in `params`); the objective is the stage's own.
Mixture of experts: `params` (and the optimizer and gradients) count ALL experts of every
MoE layer, which a device holds whatever route its tokens take; the activation terms take F as
the width a position goes through, averaged over layers ((top_k + shared) x the expert width
in an MoE layer, `mlp_width`), plus the routing copies (2 top_k D + E a position). FLOPs and
MFU count only the active parameters instead (maxlm/model/build.py); `param_counts` gives both.
Hyper-connections (`model.mhc.streams` N) widen the residual to N x D and keep float32 copies
of it per layer (`_streams_saved`). Sparse-attention stages' indexer is not counted.

The check: `tools/bench_memory.py` compiles the train step on fake CPU devices for sizes, remat
policies and fsdp / tensor / context splits and compares (tests/test_train_memory.py holds a few
cases within 25%); `tools/bench_compile_memory.py` does the same against the real TPU and GPU
compilers (maxlm/compile/) on 15 cases each, and `--fit` refits `FIT` for one (docs/performance.md
states the ratios). `maxlm compile` is the word where they disagree; leave headroom
(tests/test_launch.py asks the shipped configs to fit in 75% of a device).
"""

import math
import typing

import numpy as np

from maxlm import MaxlmError, config as config_lib
from maxlm.parallel import mesh as mesh_lib

# the backward pass's live set per position (float32 elements): (W_F, W_A, W_D) per remat
# policy, fitted to XLA's accounting by tools/bench_memory.py
WORKING = {"none": (10.0, 2.0, 6.0), "full": (9.0, 4.0, 9.0), "dots": (8.0, 4.0, 4.0),
           "dots_no_batch": (8.0, 4.0, 4.0)}


class Fit(typing.NamedTuple):
  working_bytes: float  # bytes an element of the backward pass's live set
  logit_copies: float  # float32 copies of the loss's logits chunk live at its peak


# hyper-connections (model.mhc): stream copies of D kept per position and layer by remat
# policy, and live in the backward pass's working set, fitted to XLA:CPU's accounting of
# configs/demo.yaml with 4 streams (tests/test_train_memory.py)
MHC_SAVED = {"none": 13.0, "dots": 7.0, "dots_no_batch": 7.0}
MQA_SCORE_COPIES = 3  # fitted to XLA:CPU on configs/v4_tiny.yaml (docs/model.md)
MHC_WORKING = {"none": 1.2, "full": 9.0, "dots": 1.2, "dots_no_batch": 1.2}

# what each compiler keeps, fitted to its accounting over the same cases: XLA:CPU by
# tools/bench_memory.py (it computes in float32); XLA:TPU and XLA:GPU by
# tools/bench_compile_memory.py --fit, which keep part of the live set in the compute dtype and
# fewer copies of the logits
FIT = {"cpu": Fit(4.0, 3), "tpu": Fit(2.75, 1.5), "gpu": Fit(1.75, 1.5)}
PARTS = ("params", "optimizer", "gradients", "activations", "working", "attention", "logits")


def estimate(config, s, n_devices, vocab, platform=None):
  """{part: bytes per device} for stage s of config on n_devices, and "total"."""
  import jax
  from maxlm.model import build, impl as impl_lib
  from maxlm.model import expert_parallel
  stage, m = config.stages[s], config.model
  shape = dict(zip(config_lib.MESH_AXES, mesh_lib.mesh_shape(stage.mesh, n_devices)))
  if m.moe.experts:
    expert_parallel.check_split(m.moe.experts, shape["expert"])
  ways = lambda name: int(np.prod([shape[a] for a in config.rules.get(name, ())] or [1]))
  axes = build.param_axes(config, vocab)
  count = sum(math.prod(dims) / math.prod(ways(n) if n else 1 for n in names)
              for _, dims, names in axes)
  layer_weights = _layers_gathered(axes, config.rules, shape) / m.n_layers
  rows = stage.batch // config.train.grad_accum / ways("batch")
  length = stage.seq_len / ways("length")
  n = rows * length
  cdt = 2 if m.dtype == "bfloat16" else 4
  d, f, hd = m.d_model, mlp_width(m) / ways("act_mlp"), m.head_dim
  h, k = m.n_heads / ways("act_heads"), m.n_kv_heads / ways("act_kv_heads")
  saved = {"none": 7 * d + 3 * (h + k) * hd + 5 * f, "full": d,
           "dots": 2 * d + (h + 2 * k) * hd + 2 * f}[m.remat.replace("dots_no_batch", "dots")]
  saved += _routing(m) if m.remat != "full" else 0
  saved_f32 = _streams_saved(m, d)
  w_f, w_a, w_d = WORKING[m.remat]
  platform = platform or jax.default_backend()
  fit = FIT[platform]
  impl = impl_lib.attention_impl(stage.attention, platform, stage.seq_len)
  scores = rows * h * length * stage.seq_len * 4 if impl == "reference" and shape[
      "context"] == 1 else 0
  if m.mqa.enabled:
    scores = _mqa_scores(m, rows, h, length, stage.seq_len,
                         impl_lib.mqa_block(stage.attention, stage.block_q))
  kv = zigzag = 0
  if shape["context"] > 1:  # K and V all-gathered; q, k, v and the output (and their
    kv = 2 * rows * stage.seq_len * k * hd * cdt  # gradients) permuted at full length
    zigzag = 2 * rows * stage.seq_len * 2 * (h + k) * hd * cdt
  kept = (scores + kv) if m.remat == "none" else 0
  copies = 2 if holds_reference(config, s) else 1
  parts = {"params": 4 * count * copies, "optimizer": 8 * count,
           "gradients": 4 * count * (2 if config.train.grad_accum > 1 else 1),
           "activations": m.n_layers * (n * (saved * cdt + saved_f32 * 4) + kept),
           "working": (n * (w_f * f + w_a * (h + k) * hd + w_d * d
                            + MHC_WORKING[m.remat] * m.mhc.streams * d) * fit.working_bytes
                       + 4 * layer_weights
                       + _tile_copies(m, impl_lib.grouped_impl(platform), n, cdt)),
           "attention": scores + kv + zigzag,
           "logits": (fit.logit_copies * rows * min(m.loss_chunk, length) * vocab
                      / ways("act_vocab") * 4 + n * d * cdt)}
  peak = max(parts["working"] + parts["attention"], parts["logits"])
  state = parts["params"] + parts["optimizer"] + parts["gradients"]
  return {**parts, "state": state, "total": state + parts["activations"] + peak}


def _mqa_scores(m, rows, h, length, seq_len, block):
  """Float32 scores of DeepSeek-V4's attention (model.mqa), in MQA_SCORE_COPIES copies. The
  dense reference (block 0): [rows, h, L, L + L / m] for the smallest rate m. By blocks
  (compressed_blocks.py), whose per-block scores the backward keeps for every block: [rows, h,
  L, b + W - 1 + the most entries a layer attends (CSA's top k, HCA's L / m')], plus a CSA
  layer's indexer scores over its entries, [rows, L, index_heads, L / m]."""
  q = m.mqa
  rates = [r for r in q.compress if r] or [seq_len + 1]
  if not block:
    return MQA_SCORE_COPIES * rows * h * length * (seq_len + seq_len // min(rates)) * 4
  entries = max([min(q.index_top_k, seq_len // r) if r == q.csa_rate else seq_len // r
                 for r in rates if r <= seq_len] or [0])
  keys = min(block, seq_len) + q.window - 1 + entries
  index = rows * length * q.index_heads * (seq_len // q.csa_rate) * 4 if q.csa_rate in rates \
      else 0
  return MQA_SCORE_COPIES * rows * h * length * keys * 4 + index


def _streams_saved(m, d):
  """Float32 elements a position keeps per layer for hyper-connections beyond the plain
  residual: under `full` the layer's input is N streams of D, not one; otherwise each of the
  layer's two connections keeps float32 copies of the streams (MHC_SAVED)."""
  n = m.mhc.streams
  if not n:
    return 0
  return (n - 1) * d if m.remat == "full" else MHC_SAVED[m.remat] * n * d


def mlp_width(m):
  """The MLP width a position goes through, averaged over layers: d_ff in a dense layer,
  (top_k + shared_experts) x the expert width in an MoE layer (tokens go to top_k experts)."""
  from maxlm.model import layers
  specs = layers.specs(m)
  moe_width = (m.moe.top_k + m.moe.shared_experts) * (m.moe.d_ff or m.d_ff)
  return sum(moe_width if spec.moe else m.d_ff for spec in specs) / len(specs)


def _routing(m):
  """Per position and layer, averaged over layers, what routing keeps beyond the MLP: the
  top_k copies of the input sorted by expert and of their outputs, and the router's scores."""
  from maxlm.model import layers
  specs = layers.specs(m)
  return sum(2 * m.moe.top_k * m.d_model + m.moe.experts for spec in specs if spec.moe) / len(
      specs)


def _tile_copies(m, grouped, n, cdt):
  """GPU MoE: the experts' gradient (maxlm/model/grouped.py `ragged_dot_tiles`) copies one
  layer's routed rows and their output gradients into tiles: top_k (D + 2F) a position."""
  if not m.moe.experts or grouped != "ragged_dot_tiles":
    return 0
  return n * m.moe.top_k * (m.d_model + 2 * (m.moe.d_ff or m.d_ff)) * cdt


def param_counts(config, vocab):
  """{"total": every parameter (all experts of every MoE layer), "active": those a token goes
  through (maxlm/model/build.py active_params: the FLOPs and MFU count these)}."""
  from maxlm.model import build
  total = sum(math.prod(dims) for _, dims, _ in build.param_axes(config, vocab))
  return {"total": total, "active": build.active_params(config.model, total)}


def _layers_gathered(axes, rules, shape):
  """Parameters of all layers a device holds once fsdp has gathered them (0 without fsdp)."""
  if shape["fsdp"] == 1:
    return 0
  ways = lambda name: int(np.prod([shape[a] for a in rules.get(name, ()) if a != "fsdp"] or [1]))
  return sum(math.prod(dims) / math.prod(ways(n) if n else 1 for n in names)
             for path, dims, names in axes if path.startswith("layer"))


def holds_reference(config, s):
  """Whether stage s's step reads a frozen reference copy of the parameters."""
  objective = config.objective_for(s)
  return objective == "dpo" or (objective == "grpo" and config.train.grpo.beta > 0)


def compiled(config, s, n_devices, vocab):
  """XLA's accounting of stage s's compiled train step, for the stage's objective (the one
  maxlm/train/stage.py builds), on the first n_devices devices (`compiled_bytes`)."""
  import jax
  if n_devices > len(jax.devices()):
    raise MaxlmError(f"--devices {n_devices}: this machine has {len(jax.devices())} "
                     "(on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N fakes more)")
  lowered, _ = lower(config, s, vocab, jax.devices()[:n_devices])
  return compiled_bytes(lowered.compile())


def lower(config, s, vocab, devices, platform=None):
  """(stage s's train step lowered for `devices` of `platform` from abstract arguments, its
  model): nothing is allocated; `maxlm compile` and `compiled` compile it."""
  import jax
  from maxlm.train import stage as stage_lib, step as step_lib
  seq_len = config.stages[s].seq_len
  mesh, model, opt, step, shardings = stage_lib.unjitted(config, s, vocab, devices, platform)
  state = jax.tree_util.tree_map(
      lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
      jax.eval_shape(lambda: step_lib.init_state_abstract(model, opt, config.seed, seq_len)),
      shardings)
  with mesh:
    return jax.jit(step, donate_argnums=0).lower(
        state, *step_inputs(config, s, mesh, state)), model


def compiled_bytes(executable):
  """{arguments, outputs, aliased, temporaries, total} bytes a device of a compiled step;
  total = arguments + outputs not aliased to the donated state + temporaries."""
  stats = executable.memory_analysis()
  out = {"arguments": stats.argument_size_in_bytes, "outputs": stats.output_size_in_bytes,
         "aliased": stats.alias_size_in_bytes, "temporaries": stats.temp_size_in_bytes}
  return {**out, "total": out["arguments"] + out["outputs"] - out["aliased"]
          + out["temporaries"]}


def step_inputs(config, s, mesh, state):
  """The abstract arguments after the state that stage s's step takes for its objective."""
  import jax
  import jax.numpy as jnp
  stage, objective = config.stages[s], config.objective_for(s)
  sharding = mesh_lib.batch_sharding(mesh, config.rules)
  rows = lambda dtype: jax.ShapeDtypeStruct((stage.batch, stage.seq_len), dtype,
                                            sharding=sharding)
  batch = {k: rows(np.int32) for k in ("inputs", "targets", "segment_ids", "positions",
                                       "loss_mask")}
  reference = state["params"] if holds_reference(config, s) else None
  if objective == "dpo":
    return {**batch, "roles": rows(np.int32)}, reference
  if objective == "grpo":
    batch.update(roles=rows(np.int32), advantages=rows(np.float32), weights=rows(np.float32))
    return batch, rows(np.float32), reference, jax.ShapeDtypeStruct((), jnp.int32)
  return (batch,)


def format_table(config, estimates, n_devices, counts=None):
  """The estimate per stage as a table, in GiB per device (and `param_counts`' line)."""
  names = [p for p in PARTS] + ["total"]
  lines = [f"per-device memory estimate on {n_devices} device(s), GiB (maxlm/train/memory.py)",
           f"{'stage':<10}{'mesh':<14}" + "".join(f"{p:>12}" for p in names)]
  for i, est in enumerate(estimates):
    stage = config.stages[i]
    shape = mesh_lib.mesh_shape(stage.mesh, n_devices)
    mesh = "x".join(str(x) for x in shape)
    lines.append(f"{stage.name or i!s:<10}{mesh:<14}"
                 + "".join(f"{est[p] / 2**30:>12.3f}" for p in names))
  lines.append("mesh is data x fsdp x expert x tensor x context; total = params + optimizer + "
               "gradients + activations + the larger of (working + attention) and logits")
  if counts is not None and counts["active"] != counts["total"]:
    lines.append(f"memory counts all {counts['total']:,} parameters (every expert of every MoE "
                 f"layer); a token goes through {counts['active']:,} of them (the active "
                 "parameters, which FLOPs and MFU count)")
  elif counts is not None:
    lines.append(f"{counts['total']:,} parameters")
  return "\n".join(lines)
