import os
import tempfile

import xlaflags

# Mesh tests need 8 simulated devices, and compiling is most of a test's time (tests/xlaflags.py);
# set before anything imports jax.
os.environ.setdefault("XLA_FLAGS", xlaflags.flags(8))
# One compilation cache for this session, shared with the maxlm subprocesses tests start.
os.environ.setdefault("MAXLM_COMPILE_CACHE", tempfile.mkdtemp(prefix="maxlm-test-jax-cache-"))

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from maxlm import cli  # noqa: E402

cli.enable_compile_cache()


# Property tests draw the same examples on every run and machine (a suite that fails on one run
# in ten is not a check); no per-example deadline, since a loaded machine is slow, not wrong.
settings.register_profile("maxlm", derandomize=True, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("maxlm")

# The libraries our checks against outside references need (the hf, quality-check and aot
# extras: libtpu and the CUDA plugin, xla_cuda12, are the compilers tests/test_compile*.py
# compile with).
# With MAXLM_REQUIRE_REFERENCES=1 (.ci/run, the README's test command) a test that skips for
# want of one fails instead: a missing extra must not turn those checks green unseen.
REFERENCES = ("torch", "transformers", "datatrove", "datasketch", "spacy", "libtpu",
              "xla_cuda12")


def _reference_skip(report):
  """The skip's reason when it names a reference library, else None."""
  if not (report.skipped and os.environ.get("MAXLM_REQUIRE_REFERENCES") == "1"):
    return None
  reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
  return reason if any(name in reason for name in REFERENCES) else None


def _fail(report, reason):
  report.outcome = "failed"
  report.longrepr = (f"MAXLM_REQUIRE_REFERENCES=1 and this reference check skipped: {reason} "
                     "(pip install -e '.[test,quality-check,hf,aot]')")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  outcome = yield
  report = outcome.get_result()
  reason = _reference_skip(report)
  if reason is not None:
    _fail(report, reason)


@pytest.hookimpl(tryfirst=True)
def pytest_collectreport(report):
  reason = _reference_skip(report)
  if reason is not None:
    _fail(report, reason)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
  """A test file's tests run on one worker (its module fixtures built once), as `--dist
  loadfile` would, except a test marked xdist_group, which runs in its own group: each docs
  page's examples (tests/test_docs.py), minutes each, so no one worker gets all of them."""
  for item in items:
    if item.get_closest_marker("xdist_group") is None:
      item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


@pytest.fixture(autouse=True)
def _quiet_tqdm(monkeypatch):
  monkeypatch.setenv("TQDM_DISABLE", "1")


@pytest.fixture
def here(capsys):
  """maxlm(...) in this process: cli.main's exit code and what it printed, as a subprocess's
  CompletedProcess (argparse's refusals exit through SystemExit, as in a process), without a
  fresh interpreter each time; a test keeps one real process per behaviour."""
  import subprocess

  def run(*args):
    argv = [os.fsdecode(a) if isinstance(a, bytes) else str(a) for a in args]
    capsys.readouterr()
    try:
      code = cli.main(argv)
    except SystemExit as e:
      code = e.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, out.out, out.err)
  return run


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory):
  """A prepared data dir from the demo's embedded corpus (prose and code), smaller."""
  from maxlm.data import corpus, prepare
  root = tmp_path_factory.mktemp("demo_data")
  raw = corpus.build(str(root / "raw"), bytes_per_source=300_000)
  prepare.prepare(raw, str(root / "data"), prepare.Options(vocab_size=1024, progress=False))
  return root / "data"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  """A synthetic data dir (prose and code, 10% held out) for tests/smallrun.py's small_config;
  one per test module. A module that needs other data defines its own data_dir."""
  import numpy as np
  import datagen
  rng = np.random.default_rng(0)
  lengths = rng.lognormal(np.log(40), 0.8, 200).astype(int) + 1
  sources = ["prose" if i % 2 else "code" for i in range(len(lengths))]
  return datagen.write_data_dir(tmp_path_factory.mktemp("train") / "data",
                                datagen.make_docs(lengths, sources), val_fraction=0.1)
