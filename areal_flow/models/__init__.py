"""Models for the CPU default recipe: the character tokenizer, the tiny Qwen2 and its bootstrap."""
