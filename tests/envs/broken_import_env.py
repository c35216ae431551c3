"""A module that raises while it is imported (tests/envs/test_env_checks.py)."""

from areal_flow.envs.base import Environment

undefined_name  # noqa: B018 - the user's bug


class Env(Environment):
    pass
