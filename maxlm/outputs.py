"""What a local folder is (a run dir, a data dir, an export) and the check that an output path
lands on nothing the user needs.

Folders are recognised by their markers, never by their names:
  run dir   config.yaml with checkpoints/, metrics.jsonl or lease.json beside it
  data dir  manifest.json, index.json or tokens-00000.bin (what `maxlm prepare` writes)
  export    maxlm-export.json (the digests `maxlm export` writes), or for exports made before
            it, config.json with a "maxlm" section beside generation_config.json; and nothing
            in the folder but the files an export writes

`check_output` (an output folder) resolves the path through symlinks and `..` first, so
`RUN/../RUN/checkpoints` or a link to a data dir is what it points at. It refuses (one line) an
output that is an input of the same command, holds one, or lies inside a run dir, a data dir
or an export (which holds only its own files); and an existing non-empty folder unless
`overwrite` is given and the folder is of the kind the command writes, so `--overwrite`
replaces a previous output of the same command and nothing else. `check_file_output` does the
same for one file (a picture, an .npz of batches), which may sit at a run dir's top level
(`maxlm plot` draws RUN_DIR/curves.png) but never in its checkpoints, a data dir or an export.
"""

import contextlib
import json
import os
import pathlib
import re

from maxlm import MaxlmError, io

RUN_DIR, DATA_DIR, EXPORT = "run dir", "data dir", "export"
EXPORT_DIGESTS = "maxlm-export.json"
_EXPORT_FILES = re.compile(r"config\.json|generation_config\.json|model(-\d{5}-of-\d{5})?\."
                           r"safetensors|model\.safetensors\.index\.json|tokenizer\.model|"
                           r"tokenizer_config\.json|special_tokens_map\.json|"
                           + re.escape(EXPORT_DIGESTS))
_DATA_MARKERS = ("manifest.json", "index.json", "tokens-00000.bin")


def kind_of(folder):
  """RUN_DIR, DATA_DIR, EXPORT or None for an existing local folder."""
  if not os.path.isdir(folder):
    return None
  has = lambda name: os.path.exists(os.path.join(folder, name))  # noqa: E731
  if has("config.yaml") and (has("checkpoints") or has("metrics.jsonl") or has("lease.json")):
    return RUN_DIR
  if _data_markers(folder):
    return DATA_DIR
  if (has(EXPORT_DIGESTS) or _old_export(folder)) and all(
      _EXPORT_FILES.fullmatch(n) for n in os.listdir(folder)):
    return EXPORT
  return None


def _data_markers(folder):
  return any(os.path.exists(os.path.join(folder, n)) for n in _DATA_MARKERS)


def data_dir_holding(path):
  """The folder, `path` or one above it, that is a data dir by what `maxlm prepare` writes (a
  token shard, or a manifest.json listing sources), even beside a run's files, as a run trained
  into a data dir leaves them; else None. Stricter than the markers above: a project's own
  manifest.json or index.json above a run_dir must not stop training."""
  here = os.path.realpath(path)
  while not _prepared_here(here):
    if os.path.dirname(here) == here:
      return None
    here = os.path.dirname(here)
  return here


def _prepared_here(folder):
  if os.path.exists(os.path.join(folder, "tokens-00000.bin")):
    return True
  try:
    with open(os.path.join(folder, "manifest.json")) as f:
      return "sources" in json.load(f)
  except (OSError, ValueError, TypeError):
    return False


def export_above(path):
  """The export that holds `path` (strictly above it), else None."""
  here = os.path.realpath(path)
  while os.path.dirname(here) != here:
    here = os.path.dirname(here)
    if kind_of(here) == EXPORT:
      return here
  return None


def _old_export(folder):
  try:
    with open(os.path.join(folder, "config.json")) as f:
      return "maxlm" in json.load(f) and os.path.exists(
          os.path.join(folder, "generation_config.json"))
  except (OSError, ValueError, TypeError):
    return False


def enclosing(path):
  """(folder, kind) of the nearest run dir or data dir that is `path` or holds it, else None."""
  here = os.path.realpath(path)
  while True:
    kind = kind_of(here)
    if kind in (RUN_DIR, DATA_DIR):
      return here, kind
    if os.path.dirname(here) == here:
      return None
    here = os.path.dirname(here)


def _inside(path, folder):
  return os.path.commonpath([path, folder]) == folder


def check_output(flag, out, kind, inputs=(), overwrite=False):
  """Refuses `out` (given as `flag`) unless writing a `kind` folder there loses nothing; returns
  its resolved path. `inputs`: (name, path) the same command reads."""
  real = os.path.realpath(out)
  for name, given in inputs:
    source = os.path.realpath(given)
    how = ("is" if real == source else "lies inside" if _inside(real, source) else
           "holds" if _inside(source, real) else None)
    if how:
      raise MaxlmError(f"{flag} {out} {how} {name} {given}, which this command reads: write "
                       "elsewhere")
  found = enclosing(real)
  if found and not (found[0] == real and found[1] == kind):
    where = "is" if found[0] == real else "lies inside"
    raise MaxlmError(f"{flag} {out} {where} the {found[1]} {found[0]}: refusing to write "
                     "there; choose a folder outside any run dir or data dir")
  _refuse_inside_export(flag, out, real)
  if os.path.lexists(real) and not os.path.isdir(real):
    raise MaxlmError(f"{flag} {out} is a file, not a folder: choose another path")
  if os.path.isdir(real) and os.listdir(real):
    if not overwrite:
      raise MaxlmError(f"{flag} {out} exists and is not empty: choose another folder, or pass "
                       f"--overwrite to replace it (only a previous {kind}) once the new one is "
                       "complete")
    if kind_of(real) != kind:
      names = sorted(os.listdir(real))
      odd = [n for n in names if kind != EXPORT or not _EXPORT_FILES.fullmatch(n)] or names
      raise MaxlmError(f"{flag} {out} is not a previous {kind} of maxlm (it holds {odd[0]!r}): "
                       "--overwrite replaces only that; choose a new or empty folder")
  return real


def _refuse_inside_export(flag, given, real):
  above = export_above(real)
  if above:
    raise MaxlmError(f"{flag} {given} lies inside the export {above}: refusing to write there "
                     "(an export holds only its own files); choose a place outside it")


def check_file_output(flag, path, inputs=()):
  """Refuses a file output (a PNG, an .npz) that resolves to an input of the command, into a
  data dir, or into a run dir's checkpoints; returns its resolved path. A run dir's top level
  stays writable: `maxlm plot` draws RUN_DIR/curves.png by default."""
  real = os.path.realpath(path)
  for name, given in inputs:
    if real == os.path.realpath(given):
      raise MaxlmError(f"{flag} {path} is {name}, which this command reads: write elsewhere")
  if os.path.isdir(real):
    raise MaxlmError(f"{flag} {path} is a folder; give a file name")
  found = enclosing(os.path.dirname(real))
  if found and (found[1] == DATA_DIR or _inside(real, os.path.join(found[0], "checkpoints"))):
    part = "the data dir" if found[1] == DATA_DIR else "the checkpoints of the run dir"
    raise MaxlmError(f"{flag} {path} lies inside {part} {found[0]}: refusing to write there; "
                     "choose another place")
  _refuse_inside_export(flag, path, real)
  return real


def check_out_file(flag, path, suffix):
  """The file a command writes ends in its format's suffix (the library would otherwise append
  one, a file other than the one named, or refuse the name), and lands on nothing the user
  needs (check_file_output below)."""
  if path is None:
    return
  if not path.lower().endswith(suffix):
    raise MaxlmError(f"{flag} {path}: give a file name ending in {suffix} (the file written is "
                     f"{suffix[1:].upper()})")
  if io.is_local(path):
    check_file_output(flag, path)


@contextlib.contextmanager
def writing(path):
  """A temporary name beside `path` (same suffix) to write, renamed to `path` once written:
  whole or not at all, and a full disk or read-only folder is one line naming `path`. A path
  that is not a regular file (/dev/stdout, a fifo) is written as it is, never replaced."""
  tmp = f"{path}.tmp-{os.getpid()}{os.path.splitext(path)[1]}"
  if special_file(path):
    tmp = path
  try:
    ensure_parent(path)
    yield tmp
    if tmp != path:
      os.replace(tmp, path)
  except OSError as e:
    raise MaxlmError(f"cannot write {path}: {e.strerror or e}"
                     + (f" (errno {e.errno})" if e.errno else "")) from None
  finally:
    if tmp != path and os.path.exists(tmp):
      os.remove(tmp)


def special_file(path):
  """Whether `path` exists and is not a regular file (a device, a fifo, /dev/stdout)."""
  import stat
  try:
    return not stat.S_ISREG(os.stat(path).st_mode) and not os.path.isdir(path)
  except OSError:
    return False


def ensure_parent(path):
  pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
