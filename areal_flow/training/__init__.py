"""Training engines: one data-parallel rank of a model that computes logprobs, runs train steps and saves."""
