"""Every example in docs/ runs: ```bash blocks run in order, per page, in a folder holding
configs/ and a small prepared demo data dir; ```bash cloud blocks need a cloud or GPU machine,
so they are only syntax-checked, and those calling launch/ scripts run with --dry-run."""

import os
import re
import shutil
import subprocess

import pytest
from limits import HANG_S
import xlaflags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
FENCE = re.compile(r"^```(bash(?: cloud)?)\n(.*?)^```", re.S | re.M)


def blocks(page):
  with open(os.path.join(DOCS, page)) as f:
    return [(kind, body) for kind, body in FENCE.findall(f.read())]


PAGES = sorted(p for p in os.listdir(DOCS) if p.endswith(".md"))


def test_every_page_is_linked_and_every_fence_is_known():
  assert {"architecture.md", "batch.md", "schedule.md", "checkpoints.md", "performance.md",
          "troubleshooting.md", "launch.md"} <= set(PAGES)
  for page in PAGES:
    with open(os.path.join(DOCS, page)) as f:
      text = f.read()
    for info in re.findall(r"^```(\S.*)$", text, re.M):
      assert info in ("bash", "bash cloud"), f"{page}: unknown fence ```{info}"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, demo_data):
  work = tmp_path_factory.mktemp("docs")
  shutil.copytree(os.path.join(ROOT, "configs"), work / "configs")
  for name in ("tools", "launch"):
    os.symlink(os.path.join(ROOT, name), work / name)
  (work / "runs" / "doc").mkdir(parents=True)
  (work / "runs" / "demo").mkdir()
  os.symlink(demo_data, work / "runs" / "demo" / "data")
  return work


def run_bash(script, cwd):
  env = {**os.environ, "XLA_FLAGS": xlaflags.flags()}  # one device, as a user
  env["PYTHONPATH"] = ROOT
  return subprocess.run(["bash", "-c", "set -eux\n" + script], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=HANG_S)


@pytest.mark.slow
@pytest.mark.parametrize("page", [pytest.param(p, marks=pytest.mark.xdist_group(f"docs:{p}"))
                                  for p in PAGES if any(k == "bash" for k, _ in blocks(p))])
def test_examples_run(page, workdir):
  script = "\n".join(body for kind, body in blocks(page) if kind == "bash")
  proc = run_bash(script, workdir)
  assert proc.returncode == 0, f"{page}:\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("page", [p for p in PAGES if any(k == "bash cloud" for k, _ in
                                                           blocks(p))])
def test_cloud_examples_parse_and_launch_dry_runs_pass(page, tmp_path):
  for _, body in (b for b in blocks(page) if b[0] == "bash cloud"):
    assert subprocess.run(["bash", "-n", "-c", body]).returncode == 0, body
    for line in body.splitlines():
      if line.startswith("launch/"):
        proc = run_bash(f"{line} --dry-run", ROOT)
        assert proc.returncode == 0, f"{line}\n{proc.stderr[-2000:]}"
        assert proc.stdout.strip(), line


def test_every_page_is_linked_from_the_readme_and_cites_only_the_repository():
  with open(os.path.join(ROOT, "README.md")) as f:
    readme = f.read()
  for page in PAGES:
    assert f"(docs/{page})" in readme, f"README.md's Documentation list does not link {page}"
  texts = {"README.md": readme}
  for folder, suffix in (("docs", ".md"), ("maxlm", ".py"), ("configs", ".yaml")):
    for base, _, files in os.walk(os.path.join(ROOT, folder)):
      for name in files:
        if name.endswith(suffix):
          with open(os.path.join(base, name)) as f:
            texts[os.path.relpath(os.path.join(base, name), ROOT)] = f.read()
  for where, text in texts.items():
    assert "DESIGN.md" not in text and "../shared" not in text, (
        f"{where} cites a file outside the repository")


def test_ci_runs_the_readme_test_command_with_the_reference_libraries():
  with open(os.path.join(ROOT, "README.md")) as f:
    (quickstart,) = [body for kind, body in FENCE.findall(f.read())[:1]]
  command = quickstart.splitlines()[1]
  with open(os.path.join(ROOT, ".ci", "run")) as f:
    ci = [line for line in f.read().splitlines() if line and not line.startswith("#")]
  assert ci[-1] == command and "set -euo pipefail" in ci  # pytest's exit 5 fails it too
  assert "'.[test,quality-check,hf,aot]'" in command and "MAXLM_REQUIRE_REFERENCES=1 " in command
