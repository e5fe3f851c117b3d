import os
import tempfile

# Mesh tests need 8 simulated devices; set before anything imports jax.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# One compilation cache for this session, shared with the maxlm subprocesses tests start.
os.environ.setdefault("MAXLM_COMPILE_CACHE", tempfile.mkdtemp(prefix="maxlm-test-jax-cache-"))

import pytest  # noqa: E402

from maxlm import cli  # noqa: E402

cli.enable_compile_cache()


@pytest.fixture(autouse=True)
def _quiet_tqdm(monkeypatch):
  monkeypatch.setenv("TQDM_DISABLE", "1")


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory):
  """A prepared data dir from the demo's embedded corpus (prose and code), smaller."""
  from maxlm.data import corpus, prepare
  root = tmp_path_factory.mktemp("demo_data")
  raw = corpus.build(str(root / "raw"), bytes_per_source=300_000)
  prepare.prepare(raw, str(root / "data"), vocab_size=1024, progress=False)
  return root / "data"
