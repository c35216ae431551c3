"""Reward functions (pure: completion text + reference -> float) and the reward worker process."""
