"""Per-step metrics: a JSONL file every run writes, optionally TensorBoard and wandb (backends.py), and plots."""
