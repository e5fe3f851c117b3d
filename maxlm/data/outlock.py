"""One `maxlm prepare` per --out: an flock on the sibling file `.OUT.prepare-lock`.

`OutLock(out, shown)` takes it or raises a one-line MaxlmError naming the holder's pid;
`release()` removes the file and drops the lock. A lock taken on a file its last holder has
already unlinked does not count (the inode is compared). The open file is in
`workers.lock_files`, so no forked worker keeps a copy of the lock past prepare.
"""

import fcntl
import os

from maxlm import MaxlmError
from maxlm.data import workers


class OutLock:
  """The lock for the local folder `out` (a pathlib.Path); `shown` is --out as the user gave
  it, for messages."""

  def __init__(self, out, shown):
    self.path = out.parent / f".{out.name}.prepare-lock"
    try:
      out.parent.mkdir(parents=True, exist_ok=True)
      self.file = open(self.path, "a+")
      fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
      if os.stat(self.path).st_ino != os.fstat(self.file.fileno()).st_ino:
        raise BlockingIOError
    except (BlockingIOError, FileNotFoundError):
      self.file.seek(0)
      holder = self.file.read().strip() or "another process"
      self.file.close()
      raise MaxlmError(f"another maxlm prepare ({holder}) is writing --out {shown}; wait for "
                       "it to finish, or choose another --out") from None
    except OSError as e:
      raise MaxlmError(f"cannot write --out {shown}: {e.strerror or e}") from None
    workers.lock_files.add(self.file)
    self.file.seek(0)
    self.file.truncate()
    self.file.write(f"pid {os.getpid()}")
    self.file.flush()

  def release(self):
    """Removes the lock file and drops the lock; a second call does nothing."""
    if self.file is None:
      return
    try:
      os.unlink(self.path)
    except OSError:
      pass
    self.file.close()  # closing drops the flock
    self.file = None
