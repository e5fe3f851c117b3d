"""Evaluation: held-out loss and bits per byte."""
