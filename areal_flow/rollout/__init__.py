"""Rollout workers: turn admitted prompt groups into generated samples, one request per sample."""
