"""Agents written against the OpenAI client, trained by the recipes that name them (docs/agents.md)."""
