"""Which implementations run, for a stage and a platform: the one rule that the model, the checks
before compiling (train/stage.py `validate`), the memory estimate and `maxlm compile` ask.

  choose(stage, platform) -> Choice(attention, sparse, grouped, interpret)
  mqa_block(name, block_q) -> queries per block of V4's attention (0: its dense reference)
  sparse_name(model_cfg, stage, choice) -> what a report calls its sparse attention

`platform` is where the step runs ("cpu", "tpu" or "gpu"), a parameter and never read from jax
here, so a CPU machine can ask what a TPU slice would run. The attention names a stage may give
are config.ATTENTION_IMPLS (the config checks its keys against the same list).

A stage refuses the Pallas kernels (splash, gpu) on a CPU: interpreted, they are tests, not a
run. `attention_impl` alone (what `model.attention.attention` asks per call) allows every kernel
on a CPU, interpreted, for the kernel tests and benches.
"""

import typing

from maxlm import MaxlmError
from maxlm.config import ATTENTION_IMPLS
from maxlm.model import auto_rule

PLATFORMS = ("cpu", "tpu", "gpu")
_TILE = {"splash": 128, "gpu": 16}  # rows of any length are padded to a tile of these
_PALLAS = ("splash", "gpu", "splash_causal", "gpu_mha")


class Choice(typing.NamedTuple):
  attention: str  # reference | blockwise | splash | gpu | splash_causal | gpu_mha
  sparse: str  # dense | indexer_warmup | tokens | blocks | context (sparse_impl)
  grouped: str  # MoE's grouped matmul: tiled | ragged_dot_tiles | megablox
  interpret: bool  # Pallas kernels interpreted (a CPU) rather than compiled


def attention_impl(name, platform, seq_len=None, docs_per_row=None):
  """The attention implementation `name` runs on `platform`; `auto` follows auto_rule."""
  if name == "auto":
    return auto_rule.choose(platform, seq_len, docs_per_row)
  if name not in ATTENTION_IMPLS:
    raise MaxlmError(f"attention impl {name!r}: expected one of {', '.join(ATTENTION_IMPLS)}")
  if name in ("gpu", "gpu_mha") and platform not in ("gpu", "cpu"):
    raise MaxlmError(f"attention impl 'gpu' needs a GPU; this job runs on {platform} "
                     "(set stages.N.attention=auto)")
  if name in ("splash", "splash_causal") and platform not in ("tpu", "cpu"):
    raise MaxlmError(f"attention impl 'splash' needs a TPU; this job runs on {platform} "
                     "(set stages.N.attention=auto)")
  return name


def sparse_impl(sparse, context_parallel):
  """How a stage's sparse settings attend: dense, indexer_warmup (dense attention, the indexer
  learning beside it), or sparse over top-k tokens, top-k blocks, or blocks under context
  parallelism."""
  mode = "dense" if sparse is None else sparse.mode
  if mode != "sparse":
    return mode
  if context_parallel:
    return "context"
  return "blocks" if sparse.select == "block" else "tokens"


def mqa_block(name, block_q):
  """Queries per block of DeepSeek-V4's attention (model.mqa, compressed_blocks.py) for a stage
  whose attention is `name`; 0: the dense reference (compressed.attend), asked for by name."""
  return 0 if name == "reference" else block_q


def attention_name(model_cfg, stage, choice):
  """What a report calls the attention a stage runs: `choice.attention`, or for DeepSeek-V4's
  attention (model.mqa) mqa_blocks / mqa_reference."""
  if not model_cfg.mqa.enabled:
    return choice.attention
  return "mqa_blocks" if mqa_block(stage.attention, stage.block_q) else "mqa_reference"


def sparse_name(model_cfg, stage, choice):
  """What a report calls a stage's sparse attention: `choice.sparse`, or for DeepSeek-V4's
  attention the stage's mode, which its CSA layers follow (maxlm/model/mqa.py)."""
  return stage.sparse.mode if model_cfg.mqa.enabled else choice.sparse


def grouped_impl(platform):
  """MoE's grouped matmul (maxlm/model/grouped.py) on `platform`."""
  return {"tpu": "megablox", "cpu": "tiled", "gpu": "ragged_dot_tiles"}[platform]


def choose(stage, platform, where="stage"):
  """The Choice for `stage` (config.StageConfig) on `platform`, or one line (MaxlmError) naming
  the key to change; `where` names the stage in it (stages.0)."""
  if platform not in PLATFORMS:
    raise MaxlmError(f"platform {platform!r}: expected one of {', '.join(PLATFORMS)}")
  attention = attention_impl(stage.attention, platform, stage.seq_len)
  multiple = _TILE.get(attention)
  if multiple and min(stage.block_q, 128 if attention == "gpu" else stage.block_q) % multiple:
    raise MaxlmError(f"{where}.block_q={stage.block_q}: the {attention} kernel's tiles must be "
                     f"multiples of {multiple}")
  if platform == "cpu" and attention in _PALLAS:
    raise MaxlmError(f"{where}.attention={attention} needs a "
                     f"{'GPU' if attention.startswith('gpu') else 'TPU'}; this machine has only "
                     f"a CPU (set {where}.attention=auto)")
  return Choice(attention, sparse_impl(stage.sparse, stage.mesh.context > 1),
                grouped_impl(platform), platform == "cpu")
