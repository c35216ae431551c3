"""Per-step metrics: a JSONL file every run writes, optionally wandb, and plots."""
