"""What a compiled step says about itself beyond its bytes a device (maxlm/train/memory.py
`compiled_bytes`, shared with `maxlm memory --compiled`): the collectives in the optimized
module (count and bytes by kind), and the FLOPs a device (on TPU with the cost model's step
time).

Collectives are read from the optimized HLO text, one instruction a line: an `all-gather`,
`reduce-scatter`, `all-reduce`, `all-to-all` or `collective-permute` (their `-start` forms
included) counts once, its bytes those of its result shape. XLA's cost model counts a scanned
layer loop's body once and a Pallas kernel not at all (a kernel without a cost estimate is
unknown to it), so its FLOPs are reported beside our analytic count, not instead of it.
"""

import re

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
               "f8e4m3fn": 1, "f8e5m2": 1}
_OP = re.compile(r"=\s*(\(.*?\)|\S+)\s+(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_SHAPE = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")
# XLA:TPU's refusal of a program larger than a chip, e.g. "Ran out of memory in memory space hbm.
# ... the total memory required for HLO temporaries (104.87G) exceeds available HBM (95.74G)"
_OOM = re.compile(r"RESOURCE_EXHAUSTED.*?temporaries \((\d+(?:\.\d+)?)([KMGT])\)", re.S)
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def out_of_memory(message):
  """{"temporaries", "total"} bytes from the compiler's refusal of a step larger than a chip
  (the temporaries it needed; the arguments are unknown then and counted 0), else None."""
  m = _OOM.search(message)
  if m is None:
    return None
  need = int(float(m[1]) * _UNITS[m[2]])
  return {"arguments": 0, "outputs": 0, "aliased": 0, "temporaries": need, "total": need,
          "refused": True}


def shape_bytes(text):
  """Bytes of an HLO result shape: `bf16[8,128]{1,0}` or a tuple of such."""
  total = 0
  for dtype, dims in _SHAPE.findall(text):
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n * DTYPE_BYTES.get(dtype, 4)
  return total


def collectives(hlo_text):
  """{kind: {"count", "bytes"}} of the collectives in an optimized HLO module's text."""
  out = {kind: {"count": 0, "bytes": 0} for kind in COLLECTIVES}
  for line in hlo_text.splitlines():
    m = _OP.search(line)
    if m:
      out[m[2]]["count"] += 1
      out[m[2]]["bytes"] += shape_bytes(m[1])
  return out


def cost(compiled):
  """{"flops", "bytes_accessed", "optimal_seconds"} a device from XLA's cost model, where it has
  one (TPU), with a negative or missing time dropped; on GPU, whose plugin has no cost model,
  the flops and bytes XLA's HLO cost analysis counts in the optimized module; else {}."""
  try:
    analysis = compiled.cost_analysis()
  except Exception:  # noqa: BLE001 (GPU: "GetCostAnalysis is not supported")
    analysis = None
  if isinstance(analysis, list):
    analysis = analysis[0] if analysis else None
  if not analysis:
    analysis = _module_cost(compiled)
  if not analysis:
    return {}
  out = {"flops": analysis.get("flops"), "bytes_accessed": analysis.get("bytes accessed")}
  seconds = analysis.get("optimal_seconds")
  if seconds is not None and seconds > 0:
    out["optimal_seconds"] = seconds
  return {k: v for k, v in out.items() if v is not None}


def _module_cost(compiled):
  """XLA's HLO cost analysis of the optimized module, run by the CPU client (jax exposes it only
  privately; None where this jax lacks it)."""
  try:
    from jax._src import xla_bridge
    from jax._src.lib import _jax
    (module, *_) = compiled.runtime_executable().hlo_modules()
    return _jax.hlo_module_cost_analysis(xla_bridge.get_backend("cpu"), module)
  except Exception:  # noqa: BLE001 (a private API: its absence costs the count, not the compile)
    return None
