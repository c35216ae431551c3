"""RL algorithms as pure functions over tensors: advantages, the decoupled PPO loss, sequence packing.

Nothing in here knows about processes, configs or models; callers pass tensors and numbers.
"""
