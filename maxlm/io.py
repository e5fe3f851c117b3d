"""Whole-file reads and writes for local paths and object stores (gs://, s3://) alike.

Everything maxlm writes besides checkpoints (token shards, index, manifest, tokenizer) goes
through these functions, which use a TensorStore key-value store for every path, so a
`gs://` data dir is read and written by the same code as a local one.
"""

import functools
import os
import re
import urllib.parse

import tensorstore as ts

from maxlm import MaxlmError

_REMOTE = ("gs", "s3", "http", "https", "memory")  # memory:// lets tests take the remote path
CONTEXT = ts.Context()  # shared, so memory:// stores persist within a process


def is_local(path):
  return urllib.parse.urlparse(str(path)).scheme not in _REMOTE


def join(path, name):
  return f"{str(path).rstrip('/')}/{name}"


def read_bytes(path):
  result = _open(_parent(path)).read(_name(path)).result()
  if result.state != "value":
    raise MaxlmError(f"file not found: {path}")
  return result.value


def read_range(path, start, end):
  """Bytes [start, end) of a file, as one ranged read."""
  return _open(_parent(path)).read(_name(path), byte_range=slice(start, end)).result().value


class WriteError(MaxlmError):
  """A write that failed; `reason` is the operating system's words for why ("No space left on
  device (errno 28)"), for a caller that names the file its own way."""

  def __init__(self, path, reason):
    super().__init__(f"cannot write {path}: {reason}")
    self.reason = reason


def write_bytes(path, data):
  try:
    if is_local(path):
      os.makedirs(_parent(path), exist_ok=True)
    _open(_parent(path)).write(_name(path), data).result()
  except OSError as e:  # the folder could not be made
    raise WriteError(path, f"{e.strerror or e} (errno {e.errno})" if e.errno else str(e)) from None
  except ValueError as e:
    raise WriteError(path, describe_error(e)) from None


def process_alive(pid):
  """Whether a process with this pid runs on this host (a lock holder, a partial folder's
  writer)."""
  if pid <= 0:
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except (PermissionError, OverflowError):
    return True
  return True


def describe_error(e):
  """The operating system's words for a TensorStore I/O error ("No space left on device
  (errno 28)"), else its first line."""
  text = str(e).splitlines()[0] if str(e) else type(e).__name__
  found = re.search(r"([A-Z][\w ]+?) \[os_error_code='(\d+)'\]", text)
  return f"{found[1]} (errno {found[2]})" if found else text[:200]


def delete(path):
  _open(_parent(path)).delete_range(ts.KvStore.KeyRange(_name(path), _name(path) + "\0")).result()


def exists(path):
  return _open(_parent(path)).read(_name(path)).result().state == "value"


def _parent(path):
  return str(path).rstrip("/").rsplit("/", 1)[0] if "/" in str(path) else "."


def _name(path):
  return str(path).rstrip("/").rsplit("/", 1)[-1]


@functools.lru_cache(maxsize=64)
def _open(folder):
  url = folder if not is_local(folder) else f"file://{os.path.abspath(folder)}"
  return ts.KvStore.open(url.rstrip("/") + "/", context=CONTEXT).result()
