"""BuddyRing placement (paper §4.2, Appendix A.1): the staged beam search (:mod:`.search`), its
greedy filler placement (:mod:`.fillers`), min-shard candidates (:mod:`.minshard`), the
cap-directed search (:mod:`.capsearch`) and the Pareto helpers of the beam (:mod:`.pareto`)."""
from liquidcp_jax.placement.buddyring.search import BuddyRingResult, buddyring, buddyring_search

__all__ = ["BuddyRingResult", "buddyring", "buddyring_search"]
