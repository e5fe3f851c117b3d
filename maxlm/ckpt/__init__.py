"""The checkpoint format on disk: Orbax saving and reading of a run's checkpoints
(`checkpoint.py`) and the per-array checksums that prove one intact (`integrity.py`). A floor
below train/ and interop/: the run that writes checkpoints and `maxlm export`, which reads
them, both stand on it; it imports nothing of maxlm but io."""
