"""Limits of the generation API that the launcher checks a config against before anything
starts; kept here, free of torch, so `run/checks.py` reads the same constant the server enforces."""

MAX_N = 1024
"""Most samples per prompt (sampling_params.n): more is refused rather than queued."""
