"""MegaRing engine transport: where a rank's kernel finds a peer's KV tile, its own receive slot,
a peer's gradient accumulator and a counter (pure index arithmetic, plus the one ref move).

Two transports share one geometry (:class:`RingGeometry`: ``P`` ranks of ``n`` tiles of ``B``
rows, receive buffers laid out by exchange step, :func:`liquidcp_jax.megaring.tables.step_bases`
without the local part: tile ``b`` of owner ``o`` lands in rank ``d``'s slot
``step_base[d ^ o] + b``):

* :class:`EmulatedTransport`: the ``P`` ranks are slices of one stacked array on one GPU and one
  launch runs them all. KV / gradient arrays are ``[P * n * B, ...]`` (rank ``r``'s rows
  ``r * n * B ..``), receive buffers ``[P * R * B, ...]`` (``R = sum(send_tiles)``), counters one
  ``pl.get_global`` array with a block of ``per_rank`` entries per rank. A transfer is a TMA
  copy from another rank's slice into the rank's block of the receive buffer.
* :class:`PeerTransport`: one rank per GPU of a single-process mesh (``axis_name``); a peer's
  tile is ``plgpu.remote_ref(ref, {axis_name: owner})`` at the owner's local row, the receive
  buffer and counters are the rank's own (local rows and indices).

Every index function takes Python ints, NumPy arrays or traced int32 scalars (only ``+``, ``*``,
``^`` and a table lookup), so the kernel and the host tests run the same arithmetic. Host calls
with Python ints check their ranges (``ValueError`` naming the argument).
"""
from __future__ import annotations

import dataclasses
import numbers

import numpy as np


def _is_host_int(x) -> bool:
    return isinstance(x, (numbers.Integral, np.integer)) and not isinstance(x, bool)


def _check(name, x, hi):
    if _is_host_int(x) and not 0 <= int(x) < hi:
        raise ValueError(f"{name} must be in [0, {hi}); got {int(x)}")


@dataclasses.dataclass(frozen=True)
class RingGeometry:
    """Static sizes shared by both transports.

    Fields: num_ranks ``P`` (a power of two), tiles ``n`` (tiles per rank), tile_size ``B``,
    send_tiles ``(steps - 1,)`` tiles received at exchange steps ``1 ..`` (the plan's
    ``capacity.send_tiles``), counters_per_rank (entries of one rank's counter block).
    """

    num_ranks: int
    tiles: int
    tile_size: int
    send_tiles: tuple[int, ...]
    counters_per_rank: int = 1

    def __post_init__(self):
        object.__setattr__(self, "send_tiles", tuple(int(x) for x in self.send_tiles))
        for name in ("num_ranks", "tiles", "tile_size", "counters_per_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or int(v) != v or int(v) < 1:
                raise ValueError(f"{name} must be an int >= 1; got {v!r}")
        if self.num_ranks & (self.num_ranks - 1):
            raise ValueError(f"num_ranks must be a power of two; got {self.num_ranks}")
        if len(self.send_tiles) >= self.num_ranks and self.send_tiles:
            raise ValueError(f"send_tiles has {len(self.send_tiles)} steps; at most num_ranks - 1 = "
                             f"{self.num_ranks - 1}")
        if any(x < 0 or x > self.tiles for x in self.send_tiles):
            raise ValueError(f"send_tiles must be in [0, tiles={self.tiles}]; got {self.send_tiles}")

    @classmethod
    def from_capacity(cls, capacity, num_ranks: int, counters_per_rank: int = 1) -> "RingGeometry":
        """From a :class:`~liquidcp_jax.megaring.capacity.MegaRingCapacity`."""
        return cls(int(num_ranks), capacity.tiles, capacity.tile_size, capacity.send_tiles,
                   counters_per_rank)

    @property
    def rows(self) -> int:
        """``C = n * B``: rows of one rank's slice."""
        return self.tiles * self.tile_size

    @property
    def steps(self) -> int:
        return len(self.send_tiles) + 1

    @property
    def recv_tiles(self) -> int:
        """``R``: receive-buffer tiles per rank."""
        return int(sum(self.send_tiles))

    @property
    def step_base(self) -> np.ndarray:
        """``(P,)`` int32: first receive slot of each exchange step ``t`` (index ``t``; entry 0
        and steps past the plan's: ``R``, i.e. no slot)."""
        base = np.full(self.num_ranks, self.recv_tiles, np.int32)
        base[1:self.steps] = np.concatenate([[0], np.cumsum(self.send_tiles)])[:self.steps - 1]
        return base

    def recv_slot(self, rank, owner, tile, step_base=None):
        """Rank ``rank``'s receive slot of tile ``tile`` of rank ``owner`` (``owner != rank``, the
        tile within the step's ``send_tiles[(rank ^ owner) - 1]``). ``step_base``: the table as a
        device array inside a kernel (default: :attr:`step_base`)."""
        _check("rank", rank, self.num_ranks)
        _check("owner", owner, self.num_ranks)
        if _is_host_int(rank) and _is_host_int(owner):
            t = int(rank) ^ int(owner)
            if t == 0 or t >= self.steps:
                raise ValueError(f"owner {owner} is not a partner of rank {rank} within the plan's "
                                 f"{self.steps - 1} exchange steps")
            _check("tile", tile, self.send_tiles[t - 1])
        base = self.step_base if step_base is None else step_base
        return base[rank ^ owner] + tile

    def pool_slot(self, rank, owner, tile):
        """The engine's KV pool slot (:func:`~liquidcp_jax.megaring.tables.step_bases` order: the
        rank's own tiles ``0 .. n - 1``, then its receive slots)."""
        if _is_host_int(rank) and _is_host_int(owner) and int(rank) == int(owner):
            _check("tile", tile, self.tiles)
            return tile
        return self.tiles + self.recv_slot(rank, owner, tile)


@dataclasses.dataclass(frozen=True)
class EmulatedTransport:
    """All ``P`` ranks in one launch on one GPU (stacked arrays; see the module docstring)."""

    geom: RingGeometry

    def kv_row(self, owner, tile):
        """First row of ``owner``'s tile ``tile`` in the stacked KV (or gradient) array."""
        _check("owner", owner, self.geom.num_ranks)
        _check("tile", tile, self.geom.tiles)
        return owner * self.geom.rows + tile * self.geom.tile_size

    def recv_row(self, rank, slot):
        """First row of ``rank``'s receive slot ``slot`` in the stacked receive buffer."""
        _check("rank", rank, self.geom.num_ranks)
        _check("slot", slot, max(self.geom.recv_tiles, 1))
        return (rank * self.geom.recv_tiles + slot) * self.geom.tile_size

    def counter(self, rank, index):
        """Index of ``rank``'s counter ``index`` in the launch's one counter array."""
        _check("rank", rank, self.geom.num_ranks)
        _check("index", index, self.geom.counters_per_rank)
        return rank * self.geom.counters_per_rank + index

    def source(self, kv_ref, rank, owner, tile):
        """``(ref, row)`` of a KV tile as rank ``rank`` reads it: the same stacked array."""
        del rank
        return kv_ref, self.kv_row(owner, tile)

    def destination(self, recv_ref, rank, slot):
        """``(ref, row)`` of rank ``rank``'s receive slot."""
        return recv_ref, self.recv_row(rank, slot)

    def grad_target(self, acc_ref, rank, owner, tile):
        """``(ref, row)`` of ``owner``'s dK / dV accumulator rows of tile ``tile`` (reduce-add)."""
        del rank
        return acc_ref, self.kv_row(owner, tile)

    def owner_counter(self, sem_ref, rank, owner, index):
        """``(ref, index, device_id)`` of ``owner``'s counter ``index`` signalled by ``rank``
        (backward completion): one array, no device id."""
        del rank
        return sem_ref, self.counter(owner, index), None

    def buffer_shapes(self, tail=()) -> dict:
        """Row counts of the launch's stacked arrays: ``kv`` ``[P * C, *tail]``, ``recv``
        ``[P * R * B, *tail]``, ``counters`` ``[P * per_rank]``."""
        g = self.geom
        return {"kv": (g.num_ranks * g.rows,) + tuple(tail),
                "recv": (g.num_ranks * g.recv_tiles * g.tile_size,) + tuple(tail),
                "counters": (g.num_ranks * g.counters_per_rank,)}


@dataclasses.dataclass(frozen=True)
class PeerTransport:
    """One rank per GPU of a single-process mesh; peers through ``plgpu.remote_ref``."""

    geom: RingGeometry
    axis_name: str = "cp"

    def device_id(self, owner):
        """The ``remote_ref`` device id of rank ``owner``: its index along ``axis_name`` (other
        mesh axes: the caller's own coordinates)."""
        _check("owner", owner, self.geom.num_ranks)
        return {self.axis_name: owner}

    def kv_row(self, owner, tile):
        """First row of ``owner``'s tile ``tile`` in the owner's local KV (or gradient) array."""
        _check("owner", owner, self.geom.num_ranks)
        _check("tile", tile, self.geom.tiles)
        return tile * self.geom.tile_size

    def recv_row(self, rank, slot):
        """First row of receive slot ``slot`` in the rank's own receive buffer."""
        _check("rank", rank, self.geom.num_ranks)
        _check("slot", slot, max(self.geom.recv_tiles, 1))
        return slot * self.geom.tile_size

    def counter(self, rank, index):
        """Index of counter ``index`` in the rank's own counter array."""
        _check("rank", rank, self.geom.num_ranks)
        _check("index", index, self.geom.counters_per_rank)
        return index

    def _remote(self, ref, owner):
        import jax.experimental.pallas.mosaic_gpu as plgpu
        return plgpu.remote_ref(ref, self.device_id(owner))

    def source(self, kv_ref, rank, owner, tile):
        """``(ref, row)``: the owner's array through ``remote_ref`` (the rank's own when
        ``owner == rank`` on the host)."""
        if _is_host_int(rank) and _is_host_int(owner) and int(rank) == int(owner):
            return kv_ref, self.kv_row(owner, tile)
        return self._remote(kv_ref, owner), self.kv_row(owner, tile)

    def destination(self, recv_ref, rank, slot):
        return recv_ref, self.recv_row(rank, slot)

    def grad_target(self, acc_ref, rank, owner, tile):
        """``(ref, row)`` of the owner's dK / dV accumulator (a TMA reduce-add target)."""
        return self.source(acc_ref, rank, owner, tile)

    def owner_counter(self, sem_ref, rank, owner, index):
        """``(ref, index, device_id)`` for ``pl.semaphore_signal(ref.at[index],
        device_id=device_id)`` on the owner's counter."""
        del rank
        return sem_ref, self.counter(owner, index), self.device_id(owner)

    def buffer_shapes(self, tail=()) -> dict:
        """Per-device shapes: ``kv`` ``[C, *tail]``, ``recv`` ``[R * B, *tail]``, ``counters``."""
        g = self.geom
        return {"kv": (g.rows,) + tuple(tail), "recv": (g.recv_tiles * g.tile_size,) + tuple(tail),
                "counters": (g.counters_per_rank,)}


def transfer_rows(xfer: np.ndarray, transport, fields: dict) -> np.ndarray:
    """Host: ``[n_xfer, 4]`` int64 ``(source device (-1: same array), source row, destination
    row, receive slot recomputed)`` of an engine transfer table (``fields``: its column map, e.g.
    :data:`liquidcp_jax.megaring.engine_protocol.XF`)."""
    out = np.zeros((len(xfer), 4), np.int64)
    g = transport.geom
    for i, x in enumerate(np.asarray(xfer).tolist()):
        d, o, b, slot = (x[fields[k]] for k in ("rank", "owner", "owner_tile", "recv_slot"))
        want = int(g.recv_slot(d, o, b))
        if want != slot:
            raise ValueError(f"xfer row {i}: recv_slot {slot} != the geometry's {want}")
        dev = -1 if isinstance(transport, EmulatedTransport) else o
        out[i] = (dev, transport.kv_row(o, b), transport.recv_row(d, slot), want)
    return out
