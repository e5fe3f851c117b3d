import os

# Mesh tests need 8 simulated devices; set before anything imports jax.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _quiet_tqdm(monkeypatch):
  monkeypatch.setenv("TQDM_DISABLE", "1")
