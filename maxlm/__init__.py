"""maxlm: LLM pretraining on JAX with packed, masked, exactly resumable batches."""

__version__ = "0.1.0"


class MaxlmError(Exception):
  """An error the user can fix; the CLI prints it as one line and exits 2."""
