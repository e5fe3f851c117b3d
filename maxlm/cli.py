"""The `maxlm` command line: one subcommand per job, errors as one line with exit code 2."""

import os
import sys

from maxlm import signals

if __name__ == "__main__" or os.path.basename(sys.argv[0]) == "maxlm":  # not on import
  signals.install_early()

import argparse  # noqa: E402
import importlib  # noqa: E402
import warnings  # noqa: E402

from maxlm import MaxlmError, cli_data, cli_memory, cli_run, config as config_lib  # noqa: E402
from maxlm.compile import command as compile_command  # noqa: E402


def _add_config(p):
  p.add_argument("config", help="YAML file in configs/ (or its bare name, e.g. demo)")
  p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")


class _Help(argparse.RawDescriptionHelpFormatter):
  """Shows each option's default after its help, unless it has none (None, False, [])."""

  def _get_help_string(self, action):
    text = action.help or ""
    default = action.default
    if ("%(default)" in text or "default:" in text or default in (None, False, [])
        or default is argparse.SUPPRESS or not action.option_strings):
      return text
    return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
  """Every (sub)command's parser (subparsers take the parent's class): defaults in --help."""

  def __init__(self, *args, **kw):
    kw.setdefault("formatter_class", _Help)
    super().__init__(*args, **kw)

  def error(self, message):
    """One line, as every other refusal (argparse would print the whole usage first). The
    optional key=value overrides are not named among the missing (argparse names them when
    the CONFIG before them is missing)."""
    message = message.replace(", key=value", "")
    self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` shows the usage)\n")


def _describe(sub):
  """A subcommand without a description shows its one-line help atop its --help."""
  for choice in sub._choices_actions:
    parser = sub.choices[choice.dest]
    parser.description = parser.description or choice.help


def _parser():
  ap = _Parser(prog="maxlm", description="LLM pretraining on JAX. `maxlm COMMAND --help` "
               "explains a command; README.md lists them all.")
  sub = ap.add_subparsers(dest="command", required=True)
  cli_data.add_prepare_parser(sub)
  _add_data_commands(sub)
  _add_training_commands(sub)
  cli_run.add_parsers(sub)
  _add_sizing_and_demo(sub)
  _describe(sub)
  return ap


def _add_own_data_commands(sub):
  """A config made from a data dir, and the ids of its documents (handlers: cli_data)."""
  p = sub.add_parser("config", help="a starting config for a prepared data dir: every source "
                     "in the mix, FIM on code, stages sized to the data")
  p.add_argument("data_dir", help="a folder `maxlm prepare` wrote")
  p.add_argument("--out", metavar="FILE.yaml", help="write it there (default: print it)")
  p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
  p.add_argument("--size", default="demo", choices=list(config_lib.MODEL_SIZES),
                 help="the model's named size (tiny and demo get the CPU settings)")
  p.add_argument("--seq-len", default="256,1024", metavar="L,...",
                 help="one stage per length, growing; multiples of 128")
  p.add_argument("--tokens-per-step", type=int, default=4096,
                 help="positions per optimizer step (batch = this / seq_len)")
  p.add_argument("--epochs", type=float, default=1.0,
                 help="passes over the training tokens, all stages together")
  p.add_argument("--mix", default="tokens", choices=("tokens", "equal"),
                 help="each source's share: by its training tokens, or equal")
  p.add_argument("--run-dir", help="the run's folder (default: runs/NAME for data dir NAME, "
                                   "or the folder holding a data dir named data)")

  p = sub.add_parser("docs", help="a data dir's document ids, with source, tokens and kept "
                     "(train, held out) or removed (by which rule)")
  p.add_argument("data_dir", help="a folder `maxlm prepare` wrote")
  p.add_argument("--source", help="only this source's documents")
  p.add_argument("--grep", metavar="PATTERN", help="only ids matching this regular expression")
  p.add_argument("--kept", action="store_true", help="only the kept documents")
  p.add_argument("--removed", action="store_true", help="only the removed documents")
  p.add_argument("--json", action="store_true", help="one JSON object a line, not a table")


def _add_data_commands(sub):
  """The commands that read a data dir or a config's plan (their handlers: cli_data)."""
  _add_own_data_commands(sub)
  p = sub.add_parser("funnel", help="a data dir's filtering funnel as a table (and a PNG)")
  p.add_argument("data_dir", help="a folder `maxlm prepare` wrote")
  p.add_argument("--png", metavar="FILE.png", help="also draw the funnel there")

  p = sub.add_parser("show-doc", help="a kept document's cleaned text, or its input with each "
                     "removed line and the rule that removed it")
  p.add_argument("data_dir", help="a folder `maxlm prepare` wrote")
  p.add_argument("doc_id", help="the document's id (as in --rejected, show-batch, trace)")
  p.add_argument("--diff", nargs="+", metavar="INPUT",
                 help="the inputs prepare read: show the document's input lines, each removed "
                      "one marked '-' with its rule")

  p = sub.add_parser("check-data", help="re-hash every file of a data dir against its manifest")
  p.add_argument("data_dir", help="a folder `maxlm prepare` wrote")

  p = sub.add_parser("ledger", help="token accounting per stage and source, from the plan")
  _add_config(p)
  p.add_argument("--json", action="store_true", help="print the ledger as JSON, not a table")

  cli_memory.add_parser(sub, _add_config)
  compile_command.add_parser(sub, _add_config)

  p = sub.add_parser("batches", help="write global (or one host's) batches to an .npz")
  _add_config(p)
  p.add_argument("--stage", type=int, default=0, help="stage index (0 is the first)")
  p.add_argument("--step", type=int, default=0, help="first step within the stage")
  p.add_argument("--count", type=int, default=1, help="consecutive batches to write")
  p.add_argument("--hosts", type=int, default=1,
                 help="write one host's slice of the rows, as if training on H hosts")
  p.add_argument("--host-index", type=int, default=0, help="which host's slice (0..H-1)")
  p.add_argument("--out", required=True, metavar="FILE.npz",
                 help="the arrays [count, rows, L] and their provenance as JSON")

  p = sub.add_parser("show-batch", help="PNG of one row: segments, visibility, loss mask")
  _add_config(p)
  p.add_argument("--stage", type=int, default=0, help="stage index (0 is the first)")
  p.add_argument("--step", type=int, default=0, help="step within the stage")
  p.add_argument("--row", type=int, default=None,
                 help="row of the batch (default: the row with most segments)")
  p.add_argument("--out", required=True, metavar="FILE.png", help="the picture to write")
  p.add_argument("--text", action="store_true",
                 help="also print the row's segments as decoded text, each named")


def _add_training_commands(sub):
  p = sub.add_parser("train", help="train (or resume) the config's schedule in run_dir")
  _add_config(p)
  p.add_argument("--stop-after", type=int, default=None, metavar="N",
                 help="train N steps in this call, save a checkpoint and exit (for time-limited "
                      "jobs: rerun to continue)")
  p.add_argument("--force", action="store_true",
                 help="take run_dir over from a holder that is known to be dead")

  p = sub.add_parser("verify-restart", help="kill and resume a run; prove nothing changed")
  _add_config(p)
  p.add_argument("--kills", type=int, default=3,
                 help="SIGKILLs: mid-stage, at a stage boundary, during an async save, ...")
  p.add_argument("--seed", type=int, default=0, help="chooses the steps at which to kill")
  p.add_argument("--workdir", help="where the three runs go (default: a new temporary folder)")
  p.add_argument("--corrupt", action="store_true",
                 help="also flip bytes in the latest checkpoint before the last resume")
  p.add_argument("--processes", type=int, default=1,
                 help="run each training as N local processes joined by jax.distributed "
                      "(on CPU over gloo), and kill all of them at once")


def _add_sizing_and_demo(sub):
  p = sub.add_parser("sweep", help="choose a model size: iso-FLOP runs, fits, plot and a "
                                    "recommended config (docs/sizing.md)")
  _add_config(p)
  p.add_argument("--budgets", required=True, metavar="C,...",
                 help="training FLOPs per iso-FLOP curve, e.g. 1e13,3e13,1e14")
  p.add_argument("--sizes", default="auto", metavar="auto|NAME|DxL,...",
                 help="model sizes per budget: auto (two decades around the expected "
                      "optimum), named sizes, or D_MODELxN_LAYERS such as 128x4 (default: auto)")
  p.add_argument("--out", required=True, help="folder for the runs, sweep.json, isoflop.png "
                                              "and recommended.yaml; rerun to resume")
  p.add_argument("--workers", type=int, default=1, help="points trained at once (default: 1)")
  p.add_argument("--target-flops", type=float, default=None,
                 help="budget of recommended.yaml (default: the largest budget x 10)")
  p.add_argument("--lr", type=float, default=None,
                 help="one learning rate for every point (default: 1e-3 * sqrt(256 / d_model))")
  p.add_argument("--eval-tokens", type=int, default=None,
                 help="held-out tokens per source scored at each point's end "
                      "(default: the config's train.eval_tokens)")

  p = sub.add_parser("demo", help="the quickstart, on the CPU in a few minutes",
                     description=DEMO_DESCRIPTION)
  p.add_argument("--config", default="demo", help="the config to train (configs/NAME.yaml)")


DEMO_DESCRIPTION = """\
The quickstart, end to end on this machine's CPU (reruns reuse what is finished):
  1. builds a corpus from text already here: the standard library's .py files (source code)
     and installed packages' docs (prose), in runs/demo/raw
  2. trains a tokenizer and prepares the token store (runs/demo/data), printing the funnel
  3. prints the token ledger of the demo schedule and draws one batch (runs/demo/batch.png)
  4. trains the 3-stage demo config (L = 128 -> 256 -> 1024), SIGKILLs it once and resumes,
     checking the recomputed steps are bit for bit the same
  5. reports loss and bits per byte on held-out documents, per source
  6. prints three samples
  7. writes runs/demo/curves.png"""


def cmd_train(args):
  from maxlm.train import loop
  cfg = config_lib.load(args.config, args.overrides)
  if args.stop_after is not None and args.stop_after < 1:
    raise MaxlmError(f"--stop-after must be >= 1, got {args.stop_after}")
  summary = loop.train(cfg, stop_after=args.stop_after, force=args.force)
  print(f"run_dir: {cfg.run_dir} (metrics.jsonl, TensorBoard events, checkpoints/)")
  return summary


def cmd_verify_restart(args):
  from maxlm.train import verify
  if args.kills < 0:
    raise MaxlmError(f"--kills must be >= 0, got {args.kills}")
  if not verify.verify(args.config, args.overrides, args.kills, args.seed, args.workdir,
                       corrupt=args.corrupt, processes=args.processes):
    print("restart changed the trajectory", file=sys.stderr)
    return 1
  print("bitwise identical")


def cmd_sweep(args):
  from maxlm import sweep
  sweep.sweep(args.config, args.overrides, sweep.parse_budgets(args.budgets), args.sizes,
              args.out, workers=args.workers, target=args.target_flops, lr=args.lr,
              eval_tokens=args.eval_tokens)


def cmd_demo(args):
  from maxlm import demo
  demo.run(args.config)


COMMANDS = {"prepare": cli_data.cmd_prepare, "funnel": cli_data.cmd_funnel,
            "show-doc": cli_data.cmd_show_doc,
            "check-data": cli_data.cmd_check_data, "config": cli_data.cmd_config,
            "docs": cli_data.cmd_docs,
            "ledger": cli_data.cmd_ledger, "memory": cli_memory.cmd_memory,
            "compile": compile_command.cmd_compile,
            "batches": cli_data.cmd_batches,
            "show-batch": cli_data.cmd_show_batch, "train": cmd_train,
            "plot": cli_run.cmd_plot, "verify-restart": cmd_verify_restart,
            "eval": cli_run.cmd_eval, "trace": cli_run.cmd_trace,
            "generate": cli_run.cmd_generate, "export": cli_run.cmd_export,
            "sweep": cmd_sweep, "demo": cmd_demo}


COMPILE_CACHE_BYTES = 4 << 30


def enable_compile_cache():
  """Keeps compiled steps in ~/.cache/maxlm/jax (MAXLM_COMPILE_CACHE=DIR to move it, =off to
  disable), so a resume, a rerun of the demo or a verify-restart child skips recompiling:
  a 3-stage CPU run starts in 13 s instead of 34 s. Bounded at 4 GiB, least recently used out
  first; the bound also makes JAX take a file lock around each read and write, so processes
  sharing the directory (several on one host, a verify-restart child) never read an entry
  another is still writing."""
  where = os.environ.get("MAXLM_COMPILE_CACHE", os.path.expanduser("~/.cache/maxlm/jax"))
  if where == "off":
    return
  import jax
  jax.config.update("jax_compilation_cache_dir", where)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
  jax.config.update("jax_compilation_cache_max_size", COMPILE_CACHE_BYTES)


def _parse(parser, argv):
  """parse_args, with key=value overrides accepted after options too (`maxlm train CFG
  --stop-after 5 train.lr=1e-3`): argparse ends a positional list at the first option."""
  args, extra = parser.parse_known_args(argv)
  late = [a for a in extra if "=" in a and not a.startswith("-")]
  if late and hasattr(args, "overrides"):
    args.overrides = [*args.overrides, *late]
    extra = [a for a in extra if a not in late]
  if extra:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
  return args


def main(argv=None):
  warnings.filterwarnings("ignore", category=DeprecationWarning)
  args = _parse(_parser(), argv)
  _import_early(args.command)
  with signals.running(args.command, watch=args.command not in _SAVES_ON_SIGNALS):
    return _dispatch(args)


_SAVES_ON_SIGNALS = ("train", "verify-restart")  # their own handlers save, or stop children


_HEAVY_IMPORTS = {  # what each command imports first: done while Ctrl-C still exits at once,
    # since a KeyboardInterrupt inside a C extension's import can crash the interpreter later
    "train": ("maxlm.train.loop",), "verify-restart": ("maxlm.train.loop",),
    "eval": ("maxlm.train.open_run",), "trace": ("maxlm.train.trace",),
    "generate": ("maxlm.train.open_run", "maxlm.eval.generate"),
    "demo": ("maxlm.demo",), "prepare": ("maxlm.data.prepare",),
    "ledger": ("maxlm.data.loader",), "batches": ("maxlm.data.loader",),
    "show-batch": ("maxlm.data.loader", "maxlm.data.show"), "plot": ("maxlm.train.plot",),
    "sweep": ("maxlm.sweep",), "export": ("maxlm.interop.export",),
    "compile": ("maxlm.compile.stage",)}


def _import_early(command):
  if command != "compile":  # its executables are for another machine: nothing to reuse here
    enable_compile_cache()
  for name in _HEAVY_IMPORTS.get(command, ()):
    try:
      importlib.import_module(name)
    except ImportError:  # reported, with its message, when the command imports it
      pass


def os_error_line(e):
  """An operating system error as the one line a user can act on (what failed, on which path,
  the fix), or None for any other exception. Libraries that wrap it (safetensors, TensorStore)
  keep only the words "os error 28" or "os_error_code='28'", found here in their message."""
  import errno
  import re
  if isinstance(e, OSError) and e.errno:
    code, where = e.errno, " -> ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
    text = f"{e.strerror or e} (errno {code})" + (f": {where}" if where else "")
  else:
    found = re.search(r"os error (\d+)|os_error_code='(\d+)'", str(e))
    if not found:
      return None
    code = int(found[1] or found[2])
    text = f"{os.strerror(code)} (errno {code}): {type(e).__name__}: {str(e).splitlines()[0]}"
  fixes = {errno.ENOSPC: "free space there or write elsewhere",
           errno.EDQUOT: "free space there or write elsewhere",
           errno.EROFS: "the file system is read-only: write elsewhere",
           errno.EACCES: "check its permissions or write elsewhere",
           errno.EPERM: "check its permissions or write elsewhere"}
  return text + (f"; {fixes[code]}" if code in fixes else "")


def _stdout_gone():
  """Whether stdout is a pipe whose reader has gone (`maxlm show-doc ... | head`)."""
  import select
  try:
    poll = select.poll()
    poll.register(sys.stdout.fileno(), select.POLLOUT)
    return any(mask & select.POLLERR for _, mask in poll.poll(0))
  except (OSError, ValueError, AttributeError):
    return False


def _quiet_broken_pipe():
  """Ends as `cat` does when its reader goes: no message, status 128 + SIGPIPE; stdout points
  at /dev/null so the interpreter's last flush has nowhere to fail."""
  import signal
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, sys.stdout.fileno())
  os.close(devnull)
  return 128 + signal.SIGPIPE


def _dispatch(args):
  try:
    code = COMMANDS[args.command](args)
  except MaxlmError as e:
    print(f"maxlm {args.command}: error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print(f"maxlm {args.command}: interrupted", file=sys.stderr)
    return 130
  except BrokenPipeError as e:
    if not _stdout_gone():
      print(f"maxlm {args.command}: error: {os_error_line(e)}", file=sys.stderr)
      return 2
    return _quiet_broken_pipe()
  except Exception as e:  # a crash: one line, the traceback only on request
    if os.environ.get("MAXLM_DEBUG"):
      raise
    line = os_error_line(e)
    if line:  # the machine's condition (a full disk, a read-only folder), not a bug
      print(f"maxlm {args.command}: error: {line}", file=sys.stderr)
      return 2
    print(f"maxlm {args.command}: internal error: {type(e).__name__}: {e} "
          f"(set MAXLM_DEBUG=1 for the traceback)", file=sys.stderr)
    return 1
  return code if isinstance(code, int) else 0


if __name__ == "__main__":
  sys.exit(main())
