"""What `attention=auto` runs, per stage: one documented rule, its thresholds in one place.

  CPU: `blockwise`, except rows of at most CPU_REFERENCE_MAX_LEN positions, where the dense
       `reference` is faster. Measured: `python tools/bench_auto_rule.py --json`
       (docs/performance.md, "Choosing the attention kernel").
  GPU: `gpu` (segment-skipping Triton), except from GPU_BLOCKWISE_FROM = (length, documents
       per row) on, where `blockwise` would be faster.
  TPU: `splash` (segment-skipping splash) up to TPU_SPLASH_MAX_LEN; longer rows `blockwise`
       (splash's block mask info grows as (L / block)^2 in scalar memory).

The GPU and TPU thresholds are NOT measured yet: the segment-skipping kernels have only run in
Pallas interpret mode on CPU. `bash tools/gpu_kernels_check.sh` measures the GPU ones (new
kernel vs jax's Triton `mha` vs blockwise at 4K/16K/64K with 1 and 32 documents per row) and
prints the value to put here. `documents per row` is the stage's mean when the caller knows it
(None: unknown, treated as packed rows of many documents).
"""

# Measured on the project's 2-core CPU (tools/bench_auto_rule.py, 8 rows, tiles of 128):
# reference is 1.3-1.7x faster at L = 64 and 128 (one tile: blockwise is all overhead), 1.2-1.7x
# slower at 256, and 2.4-15x slower at 1024.
CPU_REFERENCE_MAX_LEN = 128

# TO BE MEASURED on an H200 (tools/gpu_kernels_check.sh, key "auto_rule"): None means the new
# kernel is expected to be at least as fast as blockwise everywhere (it skips the same tiles).
GPU_BLOCKWISE_FROM = None  # e.g. (65536, 32): blockwise for L >= 65536 with >= 32 documents

# TO BE MEASURED on a TPU: the longest row whose mask info fits scalar memory at block 512.
TPU_SPLASH_MAX_LEN = 65536


def choose(platform, seq_len=None, docs_per_row=None):
  if platform == "gpu":
    if GPU_BLOCKWISE_FROM is not None and seq_len is not None:
      length, docs = GPU_BLOCKWISE_FROM
      if seq_len >= length and (docs_per_row is None or docs_per_row >= docs):
        return "blockwise"
    return "gpu"
  if platform == "tpu":
    return "splash" if seq_len is None or seq_len <= TPU_SPLASH_MAX_LEN else "blockwise"
  if seq_len is not None and seq_len <= CPU_REFERENCE_MAX_LEN:
    return "reference"
  return "blockwise"
