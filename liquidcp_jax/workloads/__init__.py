"""Workloads: sequence-length samplers for the training datasets; Mooncake decode snapshots."""
from liquidcp_jax.workloads.samplers import (DATASETS, LengthDistribution, format_tokens,
                                             get_distribution, parse_tokens, sample_batch)
from liquidcp_jax.workloads.mooncake import (ACCEPT_PROBS, Replay, Snapshot, Trace, build_snapshots,
                                             generate_trace, load_default_trace, load_trace, replay,
                                             snapshot_stats)

__all__ = ["DATASETS", "LengthDistribution", "format_tokens", "get_distribution", "parse_tokens", "sample_batch",
           "ACCEPT_PROBS", "Replay", "Snapshot", "Trace", "build_snapshots", "generate_trace",
           "load_default_trace", "load_trace", "replay", "snapshot_stats"]
