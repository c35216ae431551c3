"""Agents written against OpenAI's client, trained as they are: the chat-template checker
(`check_template`); the gateway and agent runner follow (docs/agents.md)."""
