"""BuddyRing placement (paper §4.2, Appendix A.1), split by algorithm:

- :mod:`.config`: :class:`BuddyRingConfig`, every parameter in one frozen, validated object;
- :mod:`.problem`: one batch (legal groups, per-group loads) and the ranking key;
- :mod:`.beam`: the staged Pareto beam with its greedy filler placement;
- :mod:`.repair`: local repair of a complete placement;
- :mod:`.packing`: packing with fixed group sizes (loads in tolerance units, local search);
- :mod:`.minshard`: min-shard candidates; :mod:`.capsearch`: the cap-directed search;
- :mod:`.pareto`: dominance filter, ranks and crowding distance of the beam;
- :mod:`.search`: :func:`buddyring` / :func:`buddyring_search`, the entry points.
"""
from liquidcp_jax.placement.buddyring.config import BuddyRingConfig
from liquidcp_jax.placement.buddyring.search import BuddyRingResult, buddyring, buddyring_search

__all__ = ["BuddyRingConfig", "BuddyRingResult", "buddyring", "buddyring_search"]
