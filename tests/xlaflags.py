"""XLA flags for this test session and for the processes its tests start.

The suite's models are tiny, so XLA:CPU spends most of a test compiling, not running:
- LLVM at -O0 (`--xla_backend_optimization_level=0`) compiles the same programs about 1.5x
  faster end to end, measured on test_train.py and test_long_1m.py;
- XLA:CPU's older loop emitters instead of its MLIR fusion emitters
  (`--xla_cpu_use_fusion_emitters=false`) cut a further 34-43% (test_model_window.py with
  test_model_transformer.py: 94 -> 62 s; test_model_moe.py, test_model_attention.py and
  test_train_optimizer.py: 77 -> 44 s, one after the other on one machine).
Results are those of the same program: every bitwise comparison in the suite compares runs made
under the same flags.
"""

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def flags(devices=None):
  """XLA_FLAGS for a process with `devices` fake CPU devices (None: one, as a user has)."""
  count = [] if devices is None else [f"--xla_force_host_platform_device_count={devices}"]
  return " ".join([*count, FAST_COMPILE])
