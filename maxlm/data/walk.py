"""The file walk of `maxlm prepare`: which files under the inputs are read, in what order, and
why the others are not.

Folders are walked with an explicit stack (no recursion: 1200 nested folders are fine), entries
in name order, so the file order is stable and the same as a sorted recursive listing. Symlinked
files and folders are followed. Below an input, nothing is dropped without a count: each skipped
entry is counted under a reason, with a few example paths (all of them with --verbose):

  hidden         a name starting with "." (the folder is not entered)
  vcs            .git, .hg, .svn, .bzr, .jj
  symlink_loop   a link to a folder that is being walked already (by (st_dev, st_ino)), or a
                 link that resolves to itself
  dangling_link  a link whose target does not exist
  already_seen   a file or folder reached before by another path (links, hard links, an input
                 given twice): read once
  special_file   a fifo, socket or device (reading a fifo would block)
  unreadable     a folder that cannot be listed or a file that cannot be opened

Files of a kind prepare does not read (`kind_of(path)` is None) are counted by suffix in
`skipped_files`, "(none)" for a name without one, with their paths in `skipped_file_examples`
(a few per suffix, all with --verbose); `--as-text GLOB` makes prepare read such files as text.
An input given on the command line is read whatever its name; a missing one or one that is not
a regular file or folder (a pipe would be consumed by the tokenizer pass) is an error, and so
is an input whose source name (a file's stem, a folder's name) is blank (`source_name`).

File names that are not UTF-8 are shown with \\xNN escapes (`display`), so ids, sources and the
printout are always valid text.
"""

import errno
import os
import stat

from maxlm import MaxlmError

SKIP_REASONS = ("hidden", "vcs", "symlink_loop", "dangling_link", "already_seen", "special_file",
                "unreadable")
VCS = frozenset((".git", ".hg", ".svn", ".bzr", ".jj"))


def display(path):
  return os.fsencode(path).decode("utf-8", "backslashreplace")


def iter_files(inputs, report, kind_of):
  """(path, display path, default source) of every file to read, in a stable order.

  `kind_of(path)` is None for files prepare does not read; `report.skip(reason, where)` and
  `report.skip_file(suffix, where)` count what is left out.
  """
  seen = set()
  for given in map(str, inputs):
    st = _input_stat(given)
    source = input_source(given, st)
    if stat.S_ISREG(st.st_mode):
      if _first_time(st, seen, display(given), report):
        yield given, display(given), source
    else:
      for path in _walk(given, st, seen, report, kind_of):
        yield path, display(path), source


def check_inputs(inputs):
  """Raises the error `iter_files` would for a missing or unusable input, before any work."""
  for given in map(str, inputs):
    input_source(given, _input_stat(given))


def input_source(given, st):
  """The source an input names: a file's stem, a folder's name."""
  if stat.S_ISREG(st.st_mode):
    return source_name(_stem(display(given)), f"input {given}")
  return source_name(display(os.path.basename(os.path.abspath(given))), f"input {given}")


def source_name(name, where):
  """`name`, refused in one line when blank or whitespace only (a folder named '   ', a file
  '   .txt'): a source must be told apart, in the manifest, --lang SOURCE= and --kind SOURCE=."""
  if not name.strip():
    raise MaxlmError(f"{where}: its source name {name!r} is blank; rename it (a source is named "
                     "by its file's stem, its input folder's name or a record's \"source\")")
  return name


def _input_stat(given):
  try:
    st = os.stat(given)
  except FileNotFoundError:
    raise MaxlmError(f"input not found: {given}") from None
  except OSError as e:
    raise MaxlmError(f"input {given} cannot be read: {e.strerror}") from None
  if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
    raise MaxlmError(f"input {given} is not a regular file or folder (a pipe or device?); "
                     "write it to a file first")
  return st


def _walk(root, root_st, seen, report, kind_of):
  if not _first_time(root_st, seen, display(root), report):
    return
  stack = [(root, None, _key(root_st))]  # (folder to list, its parent's chain, its key)
  while stack:
    entry = stack.pop()
    if isinstance(entry, str):
      yield entry
      continue
    folder, parent, key = entry
    chain = (key, parent)
    try:
      with os.scandir(folder) as listing:
        names = sorted(e.name for e in listing)
    except OSError:
      report.skip("unreadable", display(folder))
      continue
    todo = []
    for name in names:
      item = _visit(os.path.join(folder, name), name, chain, seen, report, kind_of)
      if item is not None:
        todo.append(item)
    stack.extend(reversed(todo))


def _visit(path, name, chain, seen, report, kind_of):
  """What to do with one folder entry: a file path to read, a folder to list, or None."""
  where = display(path)
  if name in VCS:
    return report.skip("vcs", where)
  if name.startswith("."):
    return report.skip("hidden", where)
  try:
    st = os.stat(path)
  except FileNotFoundError:
    return report.skip("dangling_link" if os.path.islink(path) else "unreadable", where)
  except OSError as e:
    return report.skip("symlink_loop" if e.errno == errno.ELOOP else "unreadable", where)
  if stat.S_ISDIR(st.st_mode):
    key = _key(st)
    if key in seen:
      return report.skip("symlink_loop" if _on_chain(key, chain) else "already_seen", where)
    seen.add(key)
    return path, chain, key
  if not stat.S_ISREG(st.st_mode):
    return report.skip("special_file", where)
  if kind_of(path) is None:
    return report.skip_file(os.path.splitext(display(name))[1] or "(none)", where)
  return path if _first_time(st, seen, where, report) else None


def _first_time(st, seen, where, report):
  key = _key(st)
  if key in seen:
    report.skip("already_seen", where)
    return False
  seen.add(key)
  return True


def _key(st):
  return st.st_dev, st.st_ino


def _on_chain(key, chain):
  while chain is not None:
    if chain[0] == key:
      return True
    chain = chain[1]
  return False


def _stem(path):
  return os.path.splitext(os.path.basename(path))[0]


def read_lines(path, where, report):
  """The file's lines (bytes, without the newline), streamed; an unreadable file, or a read
  error part way, is counted as unreadable."""
  try:
    with open(path, "rb") as f:
      for line in f:
        yield line.rstrip(b"\n")
  except OSError:
    report.skip("unreadable", where)


def read(path, where, report):
  """The file's bytes, or None (counted as unreadable) if it cannot be opened or read."""
  try:
    with open(path, "rb") as f:
      return f.read()
  except OSError:
    report.skip("unreadable", where)
    return None
