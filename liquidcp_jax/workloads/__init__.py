"""Workloads: sequence-length samplers for the training datasets."""
from liquidcp_jax.workloads.samplers import (DATASETS, LengthDistribution, get_distribution,
                                             parse_tokens, sample_batch)

__all__ = ["DATASETS", "LengthDistribution", "get_distribution", "parse_tokens", "sample_batch"]
