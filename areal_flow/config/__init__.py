"""Typed run configuration: the dataclasses behind every recipe key (see schema.py)."""

from areal_flow.config.schema import (  # noqa: F401
    AlgorithmConfig,
    RolloutConfig,
    ClusterConfig,
    DatasetConfig,
    GenerationConfig,
    LauncherConfig,
    MetricsConfig,
    ModelConfig,
    NodeConfig,
    RunConfig,
    register_configs,
)
