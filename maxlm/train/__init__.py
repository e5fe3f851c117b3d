"""Training: optimizer and schedule, the step, checkpoints, metrics and the loop."""
