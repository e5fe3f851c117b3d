"""Frontier shapes planned on this machine: `maxlm compile` for each row of ROWS below.

Each row (config, stage, target) is compiled by libtpu's real XLA:TPU compiler for the named v5p
slice, in its own `maxlm compile ... --stage S --json` subprocess under `/usr/bin/time -v`, one
at a time and at low priority (nice 10). Per row it prints:

  - GiB a chip: the compiler's own accounting of the step (arguments + outputs - aliased +
    temporaries), against the chip's HBM (v5p: 95 GiB), and whether it fits;
  - compile s: the seconds `maxlm compile` reports for lowering and compiling the step;
  - host RSS: the compile's peak resident memory on this machine (time -v's maximum RSS);
  - per (config, stage), the largest slice that compiled within this machine's limits.

A compile whose process tree passes --rss-limit GiB or --time-limit seconds is killed and
recorded as over the limit: that slice is beyond what this machine can plan.

Why depth does not cost compile time: `model.scan_layers` (the default) builds one layer and
runs it under `jax.lax.scan` with the layers' weights stacked on a leading axis, so the HLO the
compiler partitions, schedules and fuses holds one layer body whatever n_layers is: 126 layers
are one loop of 126 trips, not 126 copies to optimize. What grows compile time is the layer's
own program (width, MoE dispatch, context-parallel attention) and the slice's device count
(the SPMD partitioner's work), which is why the rows start at 256 chips and go up only when
the smaller slice compiled within this machine's limits. A compile the compiler refuses for
HBM (RESOURCE_EXHAUSTED: temporaries exceed the chip) fails in seconds and is shown as failed.

  python tools/frontier_compile.py            # a table
  python tools/frontier_compile.py --json     # a JSON list, one object a row
  python tools/frontier_compile.py --only moe # rows whose config name contains "moe"
  python tools/frontier_compile.py --rows 0,2 # rows 0 and 2 of ROWS
"""

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time

import psutil

GIB = 2 ** 30
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (config, stage index, target): smallest slice first; 8x8x4 = 256 chips, 8x8x8 = 512,
# 8x16x8 = 1024 (libtpu's v5p topology names)
ROWS = [
    ("configs/frontier_200b_dense.yaml", 0, "tpu:v5p:8x8x4"),
    ("configs/frontier_200b_dense.yaml", 1, "tpu:v5p:8x8x4"),
    ("configs/frontier_moe_v4flash.yaml", 0, "tpu:v5p:8x8x4"),
    ("configs/frontier_moe_v4flash.yaml", 1, "tpu:v5p:8x8x4"),
    ("configs/frontier_200b_dense.yaml", 0, "tpu:v5p:8x8x8"),
    ("configs/frontier_moe_v4flash.yaml", 0, "tpu:v5p:8x8x8"),
    ("configs/frontier_200b_dense.yaml", 0, "tpu:v5p:8x16x8"),
]


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", action="store_true", help="print a JSON list, one object a row")
  parser.add_argument("--only", default="", help="rows whose config path contains this")
  parser.add_argument("--rows", default="", help="row indices of ROWS to run, e.g. 0,2 (all)")
  parser.add_argument("--rss-limit", type=float, default=20.0,
                      help="GiB of host memory a compile may use before it is killed")
  parser.add_argument("--time-limit", type=float, default=1500.0,
                      help="seconds a compile may take before it is killed")
  return parser.parse_args(argv)


def tree_rss(proc):
  """Resident bytes of proc and all its descendants (0 once they are gone)."""
  total = 0
  try:
    for p in [proc] + proc.children(recursive=True):
      total += p.memory_info().rss
  except psutil.Error:
    pass
  return total


def watch(popen, rss_limit, time_limit):
  """Waits for popen; kills its tree past the limits. Returns (reason killed or "", wall s)."""
  start, proc, reason = time.monotonic(), psutil.Process(popen.pid), ""
  while popen.poll() is None:
    wall = time.monotonic() - start
    rss = tree_rss(proc)
    if rss > rss_limit * GIB:
      reason = f"host RSS passed {rss_limit:g} GiB"
    elif wall > time_limit:
      reason = f"compile passed {time_limit:g} s"
    if reason:
      for p in proc.children(recursive=True) + [proc]:
        try:
          p.kill()
        except psutil.Error:
          pass
      popen.wait()
      break
    time.sleep(1.0)
  return reason, time.monotonic() - start


def compile_row(config, stage, target, args):
  """Compiles one row in a subprocess; returns its measurements as a dict."""
  cmd = ["/usr/bin/time", "-v", "nice", "-n", "10", sys.executable, "-m", "maxlm.cli",
         "compile", config, "--target", target, "--stage", str(stage), "--json"]
  with subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        text=True) as popen:
    out_err = {}
    readers = [threading.Thread(target=lambda k=k, f=f: out_err.__setitem__(k, f.read()))
               for k, f in (("out", popen.stdout), ("err", popen.stderr))]
    for r in readers:
      r.start()
    killed, wall = watch(popen, args.rss_limit, args.time_limit)
    for r in readers:
      r.join()
  row = {"config": os.path.basename(config), "stage": stage, "target": target,
         "wall_s": round(wall, 1), "host_rss_gib": max_rss_gib(out_err.get("err", ""))}
  if killed:
    return {**row, "status": "over machine limit", "error": killed}
  return {**row, **report_fields(out_err.get("out", ""), out_err.get("err", ""))}


def max_rss_gib(stderr):
  """The peak resident memory `/usr/bin/time -v` printed, in GiB (None if it printed none)."""
  found = re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr)
  return round(int(found[1]) * 1024 / GIB, 2) if found else None


def report_fields(stdout, stderr):
  """The row's numbers from `maxlm compile --json`, or its error line."""
  try:
    report = json.loads(stdout)
  except ValueError:
    lines = [l for l in stderr.splitlines() if l.strip() and not l.startswith("\t")
             and "Command exited" not in l]
    error = (lines[-1] if lines else "no output")[:400]
    hbm = re.search(r"HLO temporaries \(([\d.]+)G\) exceeds available HBM", error)
    if hbm:  # the compiler refuses a step that cannot fit, before it compiles it all
      return {"status": "does not fit", "fits": False, "temporaries_gb": float(hbm[1]),
              "error": error}
    return {"status": "failed", "error": error}
  stage = report["stages"][0]
  return {"status": "compiled", "stage_name": stage.get("name"), "seq_len": stage.get("seq_len"),
          "chips": report.get("devices"),
          "chip_gib": round(stage["compiled"]["total"] / GIB, 2),
          "hbm_gib": round(stage["hbm_bytes"] / GIB, 2), "fits": bool(stage["fits"]),
          "estimate_gib": round(stage["estimate_total"] / GIB, 2)
          if stage.get("estimate_total") else None,
          "compile_s": round(stage["compile_s"], 1)}


def largest_compiled(rows):
  """(config, stage) -> the most chips among its rows that compiled."""
  best = {}
  for row in rows:
    if row["status"] == "compiled":
      key = (row["config"], row["stage"])
      best[key] = max(best.get(key, 0), row["chips"])
  return best


def print_table(rows):
  head = ("config", "stage", "slice", "chips", "GiB a chip", "HBM", "fits", "compile s",
          "host RSS GiB")
  print(" | ".join(head))
  for row in rows:
    if row["status"] == "compiled":
      cells = (row["config"], row["stage_name"], row["target"], row["chips"], row["chip_gib"],
               row["hbm_gib"], "yes" if row["fits"] else "no", row["compile_s"],
               row["host_rss_gib"])
    else:
      over = f">{row['temporaries_gb']} G temporaries" if "temporaries_gb" in row else "-"
      cells = (row["config"], row["stage"], row["target"], "-", over, "-",
               "no" if row["status"] == "does not fit" else "-",
               f"{row['status']}: {row['error']}", row["host_rss_gib"])
    print(" | ".join(str(c) for c in cells))
  for (config, stage), chips in sorted(largest_compiled(rows).items()):
    print(f"largest slice compiled here: {config} stage {stage}: {chips} chips")


def main(argv=None):
  args = parse_args(argv)
  rows = []
  wanted = {int(i) for i in args.rows.split(",") if i.strip()}
  for i, (config, stage, target) in enumerate(ROWS):
    if args.only in config and (not wanted or i in wanted):
      rows.append(compile_row(config, stage, target, args))
      print(f"# row {i}: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
  if args.json:
    for (config, stage), chips in largest_compiled(rows).items():
      for row in rows:
        if (row["config"], row["stage"]) == (config, stage):
          row["largest_compiled_chips"] = chips
    print(json.dumps(rows, indent=1))
  else:
    print_table(rows)


if __name__ == "__main__":
  main()
