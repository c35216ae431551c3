"""Resumable checkpoints: their directory layout, completeness and compatibility (docs/reliability.md)."""
