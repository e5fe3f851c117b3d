"""maxlm: LLM pretraining on JAX with packed, masked, exactly resumable batches."""

from maxlm import platforms as _platforms

__version__ = "0.1.0"

_platforms.hold_to_cpu_without_accelerators()  # before anything imports jax


class MaxlmError(Exception):
  """An error the user can fix; the CLI prints it as one line and exits 2."""
