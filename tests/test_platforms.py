"""maxlm/platforms.py: on a host without accelerators jax is held to its CPU, so libtpu (the
`aot` extra) neither logs its search for TPU chips on every command nor takes their lock."""

import os
import subprocess
import sys

import pytest

from maxlm import platforms


@pytest.mark.parametrize("preset, accelerator, want", [
    (None, False, "cpu"), ("tpu,cpu", False, "tpu,cpu"), (None, True, None)])
def test_jax_is_held_to_the_cpu_only_where_nothing_else_is(monkeypatch, preset, accelerator,
                                                           want):
  for name in ("JAX_PLATFORMS", "ALLOW_MULTIPLE_LIBTPU_LOAD"):
    monkeypatch.delenv(name, raising=False)
  if preset:
    monkeypatch.setenv("JAX_PLATFORMS", preset)
  monkeypatch.setattr(platforms, "_has_accelerator", lambda: accelerator)
  platforms.hold_to_cpu_without_accelerators()
  assert os.environ.get("JAX_PLATFORMS") == want
  assert (os.environ.get("ALLOW_MULTIPLE_LIBTPU_LOAD") == "1") == (want == "cpu" and not preset)


def test_a_command_with_the_tpu_kernels_imported_says_nothing_on_stderr():
  """With libtpu installed, importing the splash kernels and starting jax logged a dozen lines
  about TPU_ACCELERATOR_TYPE and worker hostnames before this."""
  pytest.importorskip("libtpu")
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS",
                                                           "ALLOW_MULTIPLE_LIBTPU_LOAD")}
  proc = subprocess.run([sys.executable, "-c", "import maxlm.model.attention, jax; "
                         "print(jax.devices()[0].platform)"], env=env, capture_output=True,
                        text=True)
  assert proc.returncode == 0 and proc.stdout.strip() == "cpu" and proc.stderr == "", proc.stderr
