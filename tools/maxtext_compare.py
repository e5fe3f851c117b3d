"""MaxText beside maxlm on the TPU compiler: the same Llama-shaped 150M model (d_model 768, 12
layers, 12 query / 4 KV heads of 64, d_ff 2048, vocabulary 32768, untied output head), the same
step (2048-token packed rows, 32 rows a chip = global batch 256, fsdp 8, full remat, bfloat16
compute over float32 parameters, AdamW) compiled for the same target (a v5e-8 slice, 2x4) by
libtpu's XLA:TPU compiler on this CPU-only machine. Nothing runs on a chip.

MaxText: its own AOT entry point, `python -m maxtext.trainers.pre_train.train_compile
<maxtext>/configs/base.yml compile_topology=v5e-8 ...`, run by --maxtext-python (a venv with
`pip install "maxtext[tpu]==0.2.5"`; MaxText needs Python >= 3.12). train_compile prints
`Cost analysis: {...}` and `Memory analysis: CompiledMemoryStats(...)` after compiling; both are
parsed from its stdout. Cases: attention=flash (its splash kernel), attention=dot_product (dense
scores), and flash with num_vocab_tiling=4 (its chunked loss, 16K tokens a chip a chunk, as our
loss_chunk=512 at 32 rows of 2048).

maxlm: `maxlm compile configs/tpu_v5e8_150m.yaml --target tpu:v5e:2x4 --json` with the shape
spelled out as overrides, stages.0.attention=splash (beside flash) and =reference (beside
dot_product: dense [L, L] scores; it does not fit a v5e chip at this batch, and the
compiler's out-of-memory line is reported); loss_chunk 512 as the config ships.

Both sides are counted the same way: bytes a chip = arguments + outputs not aliased to a donated
argument + XLA's temporaries (compiled.memory_analysis()). The cost model's `flops` and
`optimal_seconds` are XLA's own estimate, not a measurement, and partial on both sides: a scanned
layer loop's body is counted once (not 12 times), and a Pallas kernel without a cost_estimate
(splash) is invisible to it. A negative optimal_seconds is printed as "negative"; maxlm's JSON
drops a non-positive one, shown as "n/a". The two sides use different jax/libtpu releases (each
its own: the versions are in the JSON line).

  python tools/maxtext_compare.py [--maxtext-python /tmp/maxtext-venv/bin/python]
      [--cases maxtext/flash,maxtext/dot_product,maxtext/flash+tiling4,maxlm/splash,maxlm/reference]
      [--log-dir DIR]
"""

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "tpu_v5e8_150m.yaml")
GIB = 2**30
SHAPE = dict(d_model=768, n_layers=12, n_heads=12, n_kv_heads=4, head_dim=64, d_ff=2048,
             vocab=32768, seq_len=2048, rows_per_chip=32, chips=8)
MAXTEXT_CASES = {"flash": ["attention=flash"], "dot_product": ["attention=dot_product"],
                 "flash+tiling4": ["attention=flash", "num_vocab_tiling=4"]}
MAXLM_CASES = {"splash": ["stages.0.attention=splash"],
               "reference": ["stages.0.attention=reference"]}
DEFAULT_CASES = ("maxtext/flash", "maxtext/dot_product", "maxtext/flash+tiling4",
                 "maxlm/splash", "maxlm/reference")
_MEMORY = re.compile(r"(\w+_size_in_bytes)=(-?\d+)")
_OOM = re.compile(r"HLO temporaries \((\S+)\) exceeds available HBM \((\S+)\)")


def maxtext_args(extra):
  s = SHAPE
  return ["compile_topology=v5e-8", "compile_topology_num_slices=1",
          f"base_emb_dim={s['d_model']}", f"base_num_decoder_layers={s['n_layers']}",
          f"base_num_query_heads={s['n_heads']}", f"base_num_kv_heads={s['n_kv_heads']}",
          f"head_dim={s['head_dim']}", f"base_mlp_dim={s['d_ff']}", f"vocab_size={s['vocab']}",
          f"max_target_length={s['seq_len']}", f"per_device_batch_size={s['rows_per_chip']}",
          f"ici_fsdp_parallelism={s['chips']}", "remat_policy=full", "dataset_type=synthetic",
          "packing=true", *extra]


def maxlm_overrides(extra):
  s = SHAPE
  return [f"model.d_model={s['d_model']}", f"model.n_layers={s['n_layers']}",
          f"model.n_heads={s['n_heads']}", f"model.n_kv_heads={s['n_kv_heads']}",
          f"model.head_dim={s['head_dim']}", f"model.d_ff={s['d_ff']}",
          f"model.vocab_size={s['vocab']}", "model.remat=full", "model.dtype=bfloat16",
          f"stages.0.seq_len={s['seq_len']}", f"stages.0.batch={s['rows_per_chip'] * s['chips']}",
          "stages.0.mesh.data=1", f"stages.0.mesh.fsdp={s['chips']}", *extra]


def memory_bytes(stats):
  """{arguments, outputs, aliased, temporaries, total} from memory_analysis()'s fields."""
  out = {"arguments": stats["argument_size_in_bytes"], "outputs": stats["output_size_in_bytes"],
         "aliased": stats["alias_size_in_bytes"], "temporaries": stats["temp_size_in_bytes"]}
  return {**out, "total": out["arguments"] + out["outputs"] - out["aliased"]
          + out["temporaries"]}


def parse_maxtext(stdout):
  """{"compiled", "cost"} from train_compile's `Cost analysis:` and `Memory analysis:` lines."""
  cost_line = mem_line = None
  for line in stdout.splitlines():
    if line.startswith("Cost analysis:"):
      cost_line = line[len("Cost analysis:"):].strip()
    elif line.startswith("Memory analysis:"):
      mem_line = line
  if mem_line is None:
    raise RuntimeError("train_compile printed no 'Memory analysis:' line")
  compiled = memory_bytes({k: int(v) for k, v in _MEMORY.findall(mem_line)})
  return {"compiled": compiled, "cost": _cost_fields(cost_line)}


def _cost_fields(text):
  """flops, bytes accessed and optimal_seconds (kept when negative) from a printed cost dict
  (or a one-element list of one)."""
  if not text or text == "None":
    return {}
  text = re.sub(r"\b(nan|inf)\b", "None", text)
  analysis = ast.literal_eval(text)
  if isinstance(analysis, list):
    analysis = analysis[0] if analysis else {}
  keys = {"flops": "flops", "bytes accessed": "bytes_accessed",
          "optimal_seconds": "optimal_seconds"}
  return {ours: analysis[theirs] for theirs, ours in keys.items()
          if analysis.get(theirs) is not None}


def run_logged(cmd, cwd, env, log_path, timeout):
  """Run cmd, its stdout and stderr to log_path (when given); (stdout, seconds), or
  RuntimeError with the compiler's out-of-memory line or the tail of the output."""
  t0 = time.perf_counter()
  proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
  if log_path:
    with open(log_path, "w") as f:
      f.write(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
  if proc.returncode and not proc.stdout.rstrip().endswith("}"):  # a report is still a report
    oom = _OOM.search(proc.stdout + proc.stderr)
    if oom:
      raise RuntimeError(f"does not compile: HLO temporaries {oom[1]} > HBM {oom[2]} a chip")
    tail = (proc.stdout + proc.stderr)[-3000:]
    raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {proc.returncode}:\n{tail}")
  return proc.stdout, round(time.perf_counter() - t0, 1)


def measure_maxtext(case, python, log_dir, timeout):
  """One MaxText case compiled by its train_compile in the venv of `python`."""
  info = json.loads(subprocess.run(
      [python, "-c", "import json, os, jax, jaxlib, maxtext, importlib.metadata as m; "
       "print(json.dumps({'package': os.path.dirname(maxtext.__file__), 'jax': jax.__version__, "
       "'libtpu': m.version('libtpu'), 'maxtext': m.version('maxtext')}))"],
      capture_output=True, text=True, check=True).stdout)
  base = os.path.join(info.pop("package"), "configs", "base.yml")
  cmd = [python, "-m", "maxtext.trainers.pre_train.train_compile", base,
         *maxtext_args(MAXTEXT_CASES[case])]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  log = os.path.join(log_dir, f"maxtext_{case}.log") if log_dir else None
  stdout, seconds = run_logged(cmd, "/tmp", env, log, timeout)
  return {"side": "maxtext", "case": case, **parse_maxtext(stdout), "versions": info,
          "compile_s": seconds, "command": " ".join(cmd[1:])}


def measure_maxlm(case, log_dir, timeout):
  """One maxlm case: `maxlm compile ... --json` by this interpreter."""
  cmd = [sys.executable, "-m", "maxlm.cli", "compile", CONFIG, *maxlm_overrides(MAXLM_CASES[case]),
         "--target", "tpu:v5e:2x4", "--json"]
  log = os.path.join(log_dir, f"maxlm_{case}.log") if log_dir else None
  stdout, seconds = run_logged(cmd, ROOT, dict(os.environ), log, timeout)
  report = json.loads(stdout.strip().splitlines()[-1])
  stage = report["stages"][0]
  from importlib import metadata
  versions = {"jax": metadata.version("jax"), "libtpu": metadata.version("libtpu")}
  return {"side": "maxlm", "case": case, "attention": stage["attention"],
          "compiled": stage["compiled"], "cost": stage["cost"],
          "analytic_flops": stage["flops"]["analytic"], "collectives": stage["collectives"],
          "versions": versions, "compile_s": seconds,
          "command": "maxlm " + " ".join(cmd[3:])}


def seconds_text(cost):
  if not cost:
    return "n/a"
  s = cost.get("optimal_seconds")
  if s is None:
    return "n/a"
  return "negative" if s < 0 else f"{s * 1e3:.1f} ms"


def table(rows):
  """The comparison, one line a case."""
  head = (f"{'side':<8} {'case':<14} {'args GiB':>9} {'temps GiB':>10} {'total GiB':>10} "
          f"{'cost flops':>11} {'optimal_seconds':>16}")
  lines = [head, "-" * len(head)]
  for r in rows:
    if "error" in r:
      lines.append(f"{r['side']:<8} {r['case']:<14} {r['error'].splitlines()[0]}")
      continue
    c = r["compiled"]
    flops = r["cost"].get("flops")
    lines.append(f"{r['side']:<8} {r['case']:<14} {c['arguments'] / GIB:9.2f} "
                 f"{c['temporaries'] / GIB:10.2f} {c['total'] / GIB:10.2f} "
                 f"{flops / 1e12 if flops else float('nan'):9.1f} T {seconds_text(r['cost']):>16}")
  return "\n".join(lines)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--maxtext-python", default="/tmp/maxtext-venv/bin/python")
  ap.add_argument("--cases", default=",".join(DEFAULT_CASES),
                  help="comma-separated side/case names (default: all five)")
  ap.add_argument("--log-dir", help="keep each compile's full output here")
  ap.add_argument("--timeout", type=int, default=1800, help="seconds a compile")
  args = ap.parse_args(argv)
  if args.log_dir:
    os.makedirs(args.log_dir, exist_ok=True)
  rows = []
  for name in args.cases.split(","):  # one at a time: each compile takes the machine's cores
    side, case = name.split("/", 1)
    try:
      if side == "maxtext":
        row = measure_maxtext(case, args.maxtext_python, args.log_dir, args.timeout)
      else:
        row = measure_maxlm(case, args.log_dir, args.timeout)
    except (RuntimeError, OSError, subprocess.SubprocessError, ValueError) as e:
      row = {"side": side, "case": case, "error": str(e)}
    rows.append(row)
    print(f"# {name} done", file=sys.stderr, flush=True)
  print(table(rows))
  print(json.dumps({"shape": SHAPE, "target": "v5e-8 (tpu:v5e:2x4)", "rows": rows}))
  failed = [r for r in rows if "error" in r and not r["error"].startswith("does not compile")]
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
