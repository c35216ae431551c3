"""Prompt data: the tiny arithmetic task (`arith`) and JSONL prompt datasets (`dataset`)."""
