"""Reference attention, the one place for it: float64 NumPy anchors (:mod:`.float64`: packed
batches, selected rows, segment tables, decode) and the portable XLA twins of the kernels
(:mod:`.xla_twins`: segment attention and its backward, float32, any backend)."""
from liquidcp_jax.reference.float64 import (attention_reference, attention_reference_rows,
                                            attention_reference_vjp, decode_reference, rel_error,
                                            segment_attention_reference,
                                            segment_attention_reference_vjp, segment_visibility)
from liquidcp_jax.reference.xla_twins import xla_segment_attention, xla_segment_attention_bwd

__all__ = ["attention_reference", "attention_reference_rows", "attention_reference_vjp",
           "decode_reference", "rel_error", "segment_attention_reference",
           "segment_attention_reference_vjp", "segment_visibility", "xla_segment_attention",
           "xla_segment_attention_bwd"]
