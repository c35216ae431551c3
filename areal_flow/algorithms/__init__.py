"""RL algorithms as pure functions: advantages, the decoupled PPO loss, sequence packing, and the
train node's loss inputs built from a step's samples (inputs.py).

Nothing in here knows about processes, engines, sockets or the graph; callers pass samples, tensors,
numbers and the algorithm's config, and a data-parallel all-reduce as a function where one is needed.
"""
