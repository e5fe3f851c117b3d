"""Are two runs the same, bit for bit? Every logged step's batch fingerprint and loss, and every
tensor of the final checkpoint (parameters, optimizer state, step, rng), compared with
`maxlm verify-restart`'s check (maxlm/train/verify.py). Use it to show that a change to the code
changes nothing: run the same config before and after into two run dirs, then

  python tools/same_run.py RUN_BEFORE RUN_AFTER

Exit 0 when identical; the table says what differs.
"""

import argparse
import sys

from maxlm.train import verify


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("reference", help="run dir of the reference run")
  ap.add_argument("candidate", help="run dir of the run to compare")
  args = ap.parse_args(argv)
  same = verify.compare(args.reference, [("candidate", args.candidate)], print)
  print("bitwise identical" if same else "DIFFERENT")
  return 0 if same else 1


if __name__ == "__main__":
  sys.exit(main())
