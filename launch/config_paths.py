"""What launch/tpu.sh must know of a config before shipping it: the config loads (a bad key
is one line here, on your machine, not on every worker), and its data.dir, run_dir and
init.from, one `key=value` a line.

  python3 launch/config_paths.py CONFIG [key=value ...]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maxlm import MaxlmError, config as config_lib  # noqa: E402


def main(argv):
  if not argv:
    print("usage: config_paths.py CONFIG [key=value ...]", file=sys.stderr)
    return 2
  try:
    cfg = config_lib.load(argv[0], argv[1:])
  except MaxlmError as e:
    print(f"launch/tpu.sh: {argv[0]}: {e}", file=sys.stderr)
    return 2
  print(f"data.dir={cfg.data.dir}")
  print(f"run_dir={cfg.run_dir}")
  print(f"init.from={cfg.init.from_}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
