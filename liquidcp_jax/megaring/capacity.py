"""MegaRing capacities: every static size of a plan in one hashable object, so that a training loop
can pin one for its whole run and compile its jitted step once.

    cap = lcp.megaring.capacity_for(65536, mesh, tile_size=128)     # any batch of <= 64K tokens
    step = jax.jit(train_step)                                      # takes the plan as an argument
    for lengths, tokens in loader:                                  # tokens: [65536] (padded)
        plan = lcp.plan_megaring(lengths, mesh, capacity=cap)       # same static part, same shapes
        state = step(state, tokens, plan)                           # one trace for the whole run

A capacity fixes (the layout rule and the exchange: :mod:`.layout`'s docstring):

* ``tiles``: rows per device ``C = tiles * B`` of the packed layout (:mod:`.layout`: rows are
  tokens, so ``C`` close to the busiest device's tokens is a tight layout);
* ``send_tiles``: tiles exchanged at steps ``1 .. steps - 1`` (partner ``d ^ t``): a device sends
  the prefix of its rows that holds its groups larger than ``t`` (the layout stores groups in
  decreasing size), so the exchange needs no per-group-size sections and its shapes do not depend
  on how a batch's tokens split between group sizes;
* ``fwd_tasks``, ``bwd_pairs``: the XLA executor's task-table widths per device and step;
* ``segments``: segment slots of the Pallas paths (one-step local segments and ring segments);
* ``num_tokens``: rows of the packed arrays ``plan.shard`` takes (batches with fewer tokens pad
  the packed arrays at the end; those rows are ignored and ``plan.unshard`` returns zeros there).

:func:`capacity_for` sizes one for any batch of up to ``max_tokens`` tokens whose placement keeps
every device within ``token_tol`` of the mean (BuddyRing's tolerance); :meth:`MegaRingCapacity.fit`
takes the elementwise largest of several (e.g. a data set's plans), which sends less per step.
"""
from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class MegaRingCapacity:
    """The static sizes of a MegaRing plan (hashable; compare equal iff the plans' leaves have
    equal shapes).

    Fields:
      tile_size: ``B``.
      tiles: rows per device in tiles (``C = tiles * B``).
      send_tiles: ``(steps - 1,)`` tiles received at exchange steps ``1 .. steps - 1``
        (``steps``: the largest group size the plans may use; ``()`` for local-only plans).
      fwd_tasks, bwd_pairs: task-table widths of the XLA executor per device and step.
      segments: segment slots per device and step of the Pallas paths.
      num_tokens: rows of the packed arrays (``None``: each batch's own ``sum(lengths)``, which
        changes shapes when the token count does).
    """

    tile_size: int
    tiles: int
    send_tiles: tuple[int, ...]
    fwd_tasks: int
    bwd_pairs: int
    segments: int
    num_tokens: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "send_tiles", tuple(int(x) for x in self.send_tiles))
        for name in ("tile_size", "tiles", "fwd_tasks", "bwd_pairs", "segments"):
            v = getattr(self, name)
            if isinstance(v, bool) or int(v) != v or int(v) < 1:
                raise ValueError(f"capacity.{name} must be an int >= 1; got {v!r}")
            object.__setattr__(self, name, int(v))
        if any(x < 0 or x > self.tiles for x in self.send_tiles):
            raise ValueError(f"capacity.send_tiles must be in [0, tiles={self.tiles}]; got "
                             f"{self.send_tiles}")
        if self.num_tokens is not None:
            if int(self.num_tokens) < 1:
                raise ValueError(f"capacity.num_tokens must be None or an int >= 1; got "
                                 f"{self.num_tokens!r}")
            object.__setattr__(self, "num_tokens", int(self.num_tokens))

    @property
    def steps(self) -> int:
        """Exchange steps (the largest group size plans of this capacity may use)."""
        return len(self.send_tiles) + 1

    @property
    def rows(self) -> int:
        """``C``: rows per device."""
        return self.tiles * self.tile_size

    def exchange_rows(self) -> int:
        """Rows a device sends (and receives) per forward pass: ``sum(send_tiles) * B`` (the
        backward returns as many dK / dV rows)."""
        return sum(self.send_tiles) * self.tile_size

    @classmethod
    def fit(cls, capacities, *, num_tokens: int | None = None) -> "MegaRingCapacity":
        """The elementwise largest of ``capacities`` (``MegaRingCapacity`` or plans): a capacity
        that every one of them fits. ``num_tokens`` overrides the packed row count."""
        caps = [c.capacity if hasattr(c, "static") else c for c in capacities]
        if not caps:
            raise ValueError("capacities must not be empty")
        B = {c.tile_size for c in caps}
        if len(B) != 1:
            raise ValueError(f"capacities have different tile sizes {sorted(B)}")
        steps = max(c.steps for c in caps)
        send = tuple(max((c.send_tiles[t] if t < len(c.send_tiles) else 0) for c in caps)
                     for t in range(steps - 1))
        toks = [c.num_tokens for c in caps if c.num_tokens is not None]
        return cls(B.pop(), max(c.tiles for c in caps), send, max(c.fwd_tasks for c in caps),
                   max(c.bwd_pairs for c in caps), max(c.segments for c in caps),
                   num_tokens if num_tokens is not None else (max(toks) if toks else None))


def capacity_for(max_tokens: int, mesh_or_devices, *, tile_size: int = 128, axis_name: str = "cp",
                 task_tiles: int = 8, max_group_size: int = 8, token_tol: float = 0.10,
                 max_sequences: int | None = None) -> MegaRingCapacity:
    """One capacity for any batch of up to ``max_tokens`` tokens on the mesh.

    A plan of a batch fits it when its placement keeps every device within ``token_tol`` of the
    mean token count (BuddyRing's ``token_tol``: every placement it reports feasible; all-CP) and
    uses groups of at most ``max_group_size`` devices; ``plan_megaring(..., capacity=cap)`` raises
    a ``ValueError`` naming the exceeded field otherwise.

    Rows: ``C = ceil((1 + token_tol) * max_tokens / N)`` rounded up to a tile. Exchange: every
    step sends all ``C`` rows (any batch may put every token in a group of ``max_group_size``),
    the volume of a ring over a fixed-size shard; :meth:`MegaRingCapacity.fit` over a data set's
    plans sends only what its batches need. Task tables: the most tile pairs one step can have,
    ``n (n + 1) / 2 + 2n`` for ``n = C / B`` tiles (every key of a step at rows before its query
    at step 0; at most half of a partner's rows precede a member's at later steps); forward
    tasks at most that over ``min(4, task_tiles)`` plus one per Q tile (``tau_max = 4H >= 4``).
    Segments: ``max_sequences`` (default ``C``: a batch of one-token sequences).

    Args:
      max_tokens: the largest ``sum(lengths)`` of a batch (also the packed rows ``plan.shard``
        takes: pad shorter batches at the end).
      mesh_or_devices: a ``jax.sharding.Mesh`` (its ``axis_name`` axis) or the device count ``N``.
    """
    from jax.sharding import Mesh
    if isinstance(mesh_or_devices, Mesh):
        if axis_name not in mesh_or_devices.shape:
            raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh; expected one of "
                             f"{tuple(mesh_or_devices.shape)}")
        N = int(mesh_or_devices.shape[axis_name])
    else:
        N = int(mesh_or_devices)
    if N < 1 or N & (N - 1):
        raise ValueError(f"the CP axis must have a power-of-two size; got {N}")
    if int(max_tokens) < 1:
        raise ValueError(f"max_tokens must be an int >= 1; got {max_tokens!r}")
    if tile_size < 1 or tile_size % 8:
        raise ValueError(f"tile_size must be a positive multiple of 8; got {tile_size}")
    if not (0 <= token_tol < 10):
        raise ValueError(f"token_tol must be in [0, 10); got {token_tol}")
    B = int(tile_size)
    rows = math.ceil((1 + float(token_tol)) * int(max_tokens) / N)
    rows = min(rows, int(max_tokens))      # one device never holds more than the whole batch
    n = max(1, -(-rows // B))
    steps = min(N, int(max_group_size))
    pairs = n * (n + 1) // 2 + 2 * n
    tasks = -(-pairs // min(4, int(task_tiles))) + n
    segs = n * B if max_sequences is None else min(int(max_sequences), n * B)
    return MegaRingCapacity(B, n, (n,) * (steps - 1), tasks, pairs, max(1, segs), int(max_tokens))


def pairs_bound(tiles: int) -> int:
    """The tile-pair bound :func:`capacity_for` uses for ``tiles`` tiles per device."""
    return int(tiles) * (int(tiles) + 1) // 2 + 2 * int(tiles)


def bucket_tiles(n: int, bits: int = 4) -> int:
    """A fine capacity bucket: ``n`` rounded up to a number with at most ``bits`` significant bits
    (``bits=4``: ..., 16, 17, 18, ... 32, 34, 36, ...: at most 6.25 % above ``n``, where a power of
    two is up to 100 %)."""
    n = max(int(n), 1)
    shift = max(n.bit_length() - int(bits), 0)
    return ((n + (1 << shift) - 1) >> shift) << shift


__all__ = ["MegaRingCapacity", "capacity_for", "bucket_tiles", "pairs_bound"]
