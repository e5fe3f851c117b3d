"""How long a test lets a subprocess run before calling it hung.

A test's subprocess timeout only turns a hang into a failure; it never judges speed. So it is
one generous limit, far above what any of our subprocesses takes on a 2-core machine running
other work (the slowest, a docs page, takes ~150 s idle and went past 900 s at a load average of
20), and CI's own job limit stays the last guard.
"""

HANG_S = 3600
