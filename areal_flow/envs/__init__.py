"""Environments for multi-turn rollouts: what answers the policy's turns (docs/agents.md)."""
