"""The recipe's graph of model function calls: build, validate, place, print."""

from areal_flow.graph.dag import Graph, GraphError, build_graph, graph_from_config  # noqa: F401
from areal_flow.graph.node import Node  # noqa: F401
from areal_flow.graph.placement import Placement, place  # noqa: F401
