import json
import math

import pytest

from maxlm import MaxlmError, config as config_lib
from maxlm.train import trace
from maxlm.train import metrics

from smallrun import maxlm, small_config


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_dir):
  """A demo-like run (two sources, FIM, two stages) with micro-batches, a z-loss and a skip;
  keep=2 so early steps are replayed from the initial parameters."""
  from maxlm.train import loop
  tmp = tmp_path_factory.mktemp("trace")
  cfg = config_lib.load(str(small_config(tmp, data_dir, grad_accum=2, keep=2,
                                         spike_window=2, spike_sigmas=0.5)),
                        ["model.z_loss=1e-3", "data.skip_steps=[[7, 8]]", "stages.0.batch=16",
                         "stages.1.batch=16"])
  loop.train(cfg, log=LOGGED.append)
  return cfg.run_dir


LOGGED = []  # what the fixture's training printed


@pytest.mark.parametrize("step", [0, 4, 7, 9, 10])
def test_documents_add_up_to_the_logged_loss_of_the_step(run, step):
  logged = {r["step"]: r for r in metrics.read_jsonl(run)}[step]
  t = trace.trace(run, step, log=lambda *_: None)
  assert t["exact"] and t["loss"] == logged["loss"]
  assert t["from_checkpoint"] <= step
  docs = t["documents"]
  tokens = sum(d["loss_tokens"] for d in docs)
  assert tokens == t["loss_tokens"] == logged["loss_tokens"]
  mean = math.fsum(d["loss"] * d["loss_tokens"] for d in docs if d["loss_tokens"]) / tokens
  assert mean == pytest.approx(logged["loss"], rel=2e-6)
  assert all(d["source"] in ("prose", "code") and 0 <= d["start"] < d["end"] for d in docs)
  losses = [d["loss"] for d in docs if d["loss"] is not None]
  assert losses == sorted(losses, reverse=True)
  rows = t["rows"]
  assert len(rows) == 16 and sum(r["loss_tokens"] for r in rows) == tokens


def test_which_checkpoint_a_step_is_replayed_from(run):
  kept = sorted(int(p.name) for p in (__import__("pathlib").Path(run) / "checkpoints").iterdir()
                if p.name.isdigit())
  assert kept == [9, 11]
  assert trace.trace(run, 10, log=lambda *_: None)["from_checkpoint"] == 9
  assert trace.trace(run, 4, log=lambda *_: None)["from_checkpoint"] == 0
  with pytest.raises(MaxlmError, match="global steps 0..10"):
    trace.trace(run, 11, log=lambda *_: None)


def test_trace_and_eval_commands_print_json(run, here):
  proc = maxlm("trace", run, "--step", 9, "--json")
  assert proc.returncode == 0, proc.stderr
  t = json.loads(proc.stdout)
  assert set(t) >= {"step", "loss", "documents"} and t["step"] == 9 and t["exact"]
  assert set(t["documents"][0]) >= {"source", "doc_id", "start", "end", "loss_tokens", "loss"}
  flagged = [r["step"] for r in metrics.read_jsonl(run) if "spike" in r]
  proc = here("trace", run, "--spikes", "--json")
  assert proc.returncode == 0 and [s["step"] for s in json.loads(proc.stdout)["spikes"]] == flagged
  assert flagged, "the tight spike rule flags a step of this run"
  proc = maxlm("eval", run, "--json")
  assert proc.returncode == 0, proc.stderr
  e = json.loads(proc.stdout)
  assert sorted(e["sources"]) == ["code", "prose"] and e["step"] == 11
  for entry in [*e["sources"].values(), e["all"]]:
    assert set(entry) - {"trained"} == {"documents", "tokens", "bytes", "nll", "loss", "bpb",
                                        "small"}
    assert entry["bpb"] == pytest.approx(entry["nll"] / math.log(2) / entry["bytes"], rel=1e-12)
    assert entry["loss"] == pytest.approx(entry["nll"] / entry["tokens"], rel=1e-12)
    assert entry["small"]  # this test data holds out a few hundred tokens per source
  assert all(entry["trained"] for entry in e["sources"].values())
  assert e["seq_len"] == 64 and e["small_tokens"] == 10_000
  last = [r for r in metrics.read_jsonl(run) if "val_loss" in r][-1]
  for name, entry in e["sources"].items():  # the text the run evaluated, at the same L
    assert (entry["tokens"], entry["bytes"]) == (last[f"val_tokens/{name}"],
                                                 last[f"val_bytes/{name}"])
  proc = here("eval", run)
  assert proc.returncode == 0 and "small held-out set" in proc.stdout, proc.stderr
  proc = maxlm("trace", run, "--step", -1)
  assert proc.returncode == 2 and "global steps 0..10" in proc.stderr


def test_every_evaluation_logs_every_source_in_metrics_and_tensorboard(run):
  import pathlib
  evals = [r for r in metrics.read_jsonl(run) if "val_loss" in r]
  assert evals
  for r in evals:
    for name in ("prose", "code"):
      assert math.isfinite(r[f"val_loss/{name}"]) and math.isfinite(r[f"val_bpb/{name}"]), r
  small = [line for line in LOGGED if line.startswith("small held-out set")]
  assert len(small) == 1 and "code (" in small[0] and "prose (" in small[0], LOGGED
  by_stage = {r["stage"]: r for r in evals}
  assert sorted(by_stage) == [0, 1], "an evaluation at L=32 and one at L=64"
  for name in ("prose", "code"):  # the same text scored at both lengths
    assert by_stage[0][f"val_tokens/{name}"] == by_stage[1][f"val_tokens/{name}"] > 0
    assert by_stage[0][f"val_bytes/{name}"] == by_stage[1][f"val_bytes/{name}"] > 0
  (events,) = pathlib.Path(run).glob("events.out.tfevents.*")
  tags = set().union(*(scalars for _, scalars in metrics.read_events(str(events))))
  assert {"val_loss/prose", "val_loss/code", "val_bpb/prose", "val_bpb/code"} <= tags
