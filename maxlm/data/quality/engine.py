"""Running the costly per-document part of the quality steps on datatrove's executors.

The language ID, filters and MinHash signatures (`Inspector`) are the part of prepare whose
cost grows with the input; they shard by document. With `--engine datatrove`:
  1. `inspect_shard` is a datatrove pipeline step: task `rank` of `tasks` inspects the
     documents whose number (in input order) is `rank` modulo `tasks` and writes one record
     per document, in order, to `WORK/inspect/RANK.jsonl` (the cleaned text only for the
     documents that passed).
  2. `LocalPipelineExecutor(tasks, workers)` runs the tasks on this machine; on a cluster the
     same step runs under datatrove's `SlurmPipelineExecutor` or `RayPipelineExecutor`
     (docs/data.md shows how), with WORK on a shared file system; `maxlm prepare
     --engine datatrove --inspect-dir WORK` then uses the records instead of running them.
  3. `merged` reads the records back merged by document number, so dedup, the funnel and
     everything after see exactly the sequence the in-process path produces: the data dir is
     byte-identical for any engine, task count and worker count.
Why datatrove: its executors are the field's (the same code runs locally and on Slurm or
Ray, with per-task logs and completion markers), and its base install is the lightest of the
engines measured here (21 packages, against Ray's 57 and Apache Beam's 32 with a protobuf
downgrade); it is an optional extra (`pip install -e '.[cluster]'`).
"""

import dataclasses
import functools
import heapq
import json
import os

import numpy as np

from maxlm import MaxlmError
from maxlm.data.documents import Report, iter_documents, unique_ids


def inspect_shard(inputs, inspector, work, data=None, rank=0, world_size=1, as_text=()):
  """The datatrove step: inspect this task's documents and write their records in order.
  as_text: prepare's --as-text globs (they change which documents there are)."""
  del data
  os.makedirs(os.path.join(work, "inspect"), exist_ok=True)
  with open(os.path.join(work, "inspect", f"{rank:05d}.config.json"), "w") as f:
    json.dump(_config_json(inspector, as_text), f)
  report = Report(as_text=as_text)
  path = os.path.join(work, "inspect", f"{rank:05d}.jsonl")
  with open(path + ".partial", "w") as out:
    for number, doc in enumerate(unique_ids(iter_documents(inputs, report), report)):
      if number % world_size != rank:
        continue
      doc = inspector(doc)
      verdict = doc.pop("verdict")
      for key in ("sig", "bands"):
        if verdict[key] is not None:
          verdict[key] = verdict[key].tolist()
      record = {"number": number, "verdict": verdict}
      if verdict["step"] is None:
        record["text"] = doc.get("text")
      out.write(json.dumps(record) + "\n")
  os.replace(path + ".partial", path)
  yield from ()


def _config_json(inspector, as_text=()):
  settings = dataclasses.asdict(inspector.config)
  if as_text:  # absent when empty, so records written without --as-text still match
    settings["as_text"] = list(as_text)
  return json.loads(json.dumps(settings))


def done(work, tasks):
  return all(os.path.exists(os.path.join(work, "inspect", f"{r:05d}.jsonl"))
             for r in range(tasks))


def run_datatrove(inputs, inspector, work, tasks, workers, as_text=()):
  """Runs the inspect step as `tasks` datatrove tasks on `workers` local processes, unless
  WORK already holds every task's records (run elsewhere, e.g. on a Slurm cluster)."""
  if done(work, tasks):
    return
  try:
    from datatrove.executor import LocalPipelineExecutor
  except ImportError:
    raise MaxlmError("--engine datatrove needs datatrove: pip install -e '.[cluster]'") from None
  step = functools.partial(inspect_shard, list(inputs), inspector, work,
                           as_text=tuple(as_text))
  executor = LocalPipelineExecutor(pipeline=[step], tasks=tasks, workers=workers,
                                   logging_dir=os.path.join(work, "logs"), skip_completed=False)
  executor.run()
  missing = [r for r in range(tasks)
             if not os.path.exists(os.path.join(work, "inspect", f"{r:05d}.jsonl"))]
  if missing:
    raise MaxlmError(f"datatrove tasks {missing[:5]} did not finish; their logs are in "
                     f"{os.path.join(work, 'logs')}")


def merged(docs, work, tasks, inspector, as_text=()):
  """`docs` (in input order) with their verdicts read back from the tasks' records."""
  for r in range(tasks):
    with open(os.path.join(work, "inspect", f"{r:05d}.config.json")) as f:
      if json.load(f) != _config_json(inspector, as_text):
        raise MaxlmError(f"{work}: task {r} inspected with other quality settings (or "
                         "--as-text) than this prepare's; rerun the tasks with the same "
                         "settings")
  files = [open(os.path.join(work, "inspect", f"{r:05d}.jsonl")) for r in range(tasks)]
  try:
    records = heapq.merge(*(map(json.loads, f) for f in files), key=lambda r: r["number"])
    for number, (doc, record) in enumerate(zip(docs, records)):
      if record["number"] != number:
        raise MaxlmError(f"datatrove task records are out of step at document {number}")
      verdict = record["verdict"]
      for key, dtype in (("sig", np.uint32), ("bands", np.uint64)):
        if verdict[key] is not None:
          verdict[key] = np.array(verdict[key], dtype)
      if "text" in record and record["text"] is not None:
        doc = {**doc, "text": record["text"]}
      yield {**doc, "verdict": verdict}
  finally:
    for f in files:
      f.close()
