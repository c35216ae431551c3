"""What every process of a run shares: the run spec (paths, endpoints) and the child entrypoint."""
