"""MegaDCP capacities a server can pin before it has seen its batches (issue 21, item 2).

``plan_megadcp(..., capacities=caps)`` takes per-table floors; when every table of a step fits
them, the plan's static part and leaf shapes are the floors', so one jitted decode step compiles
once. ``plan.capacity`` of earlier steps (the decode example's ``pinned_capacities``) needs the
schedule ahead of time; :func:`capacity_for` needs only the server's limits:

    caps = lcp.megadcp.capacity_for(max_requests=64, max_query_tokens=4096, max_history=131072,
                                    mesh=mesh, num_q_heads=32, max_query_per_request=4096)
    step = jax.jit(decode_step)                               # takes the plan as an argument
    for hist, qlen in scheduler:                              # any step within the limits
        plan = lcp.plan_megadcp(hist, qlen, mesh, num_q_heads=32, capacities=caps)
        assert plan.capacity == caps                          # (fits_capacity says why not)
        out = step(q_padded, ..., plan)                       # q: [caps["query_tokens"], Hq, D]

The bound. Every table count of a step is a sum over its requests of a per-request count that
grows with the request's history, its query tokens and its KV split count (at most the rank-0
tiles of its history): chunk tasks and pairs, history tasks (splits x query tiles), history
pairs (history tiles x query tiles), reduction inputs, final blocks, transfer blocks, the laid-out
history per rank. An *envelope* batch of ``max_requests`` requests, each with ``max_history``
history and ``max_query_per_request`` query tokens, split as far as possible (every rank-0 tile
its own split), therefore bounds each of them. Three counts depend on the plan's copy-run choice
and are bounded directly: reductions (at most one per output vector, ``max_query_tokens * H``),
vectors per reduction (a query tile's ``q_tile_tokens * H``) and inputs per reduction (the most
splits). ``query_tokens`` is ``max_query_tokens`` (bucketed).

The GPU engine's own tables (``engine=True``: ``engine_attn``, ``engine_red``,
``engine_red_inputs``) follow the same argument: its attention tasks are the planner's chunk and
history tasks cut into row blocks, its reductions and their inputs the split query tiles (P > 1) or
the chunk tiles with their splits (P = 1), each a per-request count that grows with the history,
the query tokens and the splits; the envelope plans are packed for the engine too.
"""
from __future__ import annotations

from jax.sharding import Mesh

from liquidcp_jax.megadcp.split_search import tile_query_tokens
from liquidcp_jax.megadcp.tables import bucket


def _positive(name, v):
    if isinstance(v, bool) or int(v) != v or int(v) < 1:
        raise ValueError(f"{name} must be an int >= 1; got {v!r}")
    return int(v)


def capacity_for(max_requests: int, max_query_tokens: int, max_history: int, mesh: Mesh,
                 axis_name: str = "dcp", *, num_q_heads: int, num_kv_heads: int = 1,
                 max_query_per_request: int | None = None, head_dim: int | None = None, tile: int = 128, rows_per_tile: int = 128,
                 min_capacity: int = 8, num_comm_ctas: int = 16, params=None,
                 engine: bool = False, engine_config=None) -> dict:
    """Capacities (``plan_megadcp(..., capacities=...)``) for any step with at most
    ``max_requests`` requests, ``max_query_tokens`` query tokens in all, at most
    ``max_query_per_request`` (default ``max_query_tokens``) per request and at most
    ``max_history`` cached tokens per request (module docstring: the bound).

    ``num_kv_heads``, ``tile``, ``rows_per_tile``, ``min_capacity``, ``num_comm_ctas``,
    ``head_dim`` and ``params`` must be those the steps are planned with; ``engine=True``
    (with the steps' ``engine_config``) adds the GPU engine's tables (steps planned with
    ``engine=True`` or on a GPU where ``"auto"`` packs them).
    """
    from liquidcp_jax.megadcp.plan import plan_megadcp

    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh; got {type(mesh).__name__}")
    if axis_name not in mesh.shape:
        raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh; expected one of "
                         f"{tuple(mesh.shape)}")
    R = _positive("max_requests", max_requests)
    Tq = _positive("max_query_tokens", max_query_tokens)
    Hmax = _positive("max_history", max_history)
    Qmax = Tq if max_query_per_request is None else min(_positive("max_query_per_request",
                                                                  max_query_per_request), Tq)
    P = int(mesh.shape[axis_name])
    hkv = _positive("num_kv_heads", num_kv_heads)
    heads = _positive("num_q_heads", num_q_heads) // hkv     # H: the query heads of one KV head
    tile = _positive("tile", tile)
    tiles0 = -(-(-(-Hmax // P)) // tile)                  # rank 0's history tiles of one request
    hist, qlen = [Hmax] * R, [Qmax] * R
    kw = dict(num_q_heads=int(num_q_heads), num_kv_heads=hkv, head_dim=head_dim, tile=tile,
              rows_per_tile=rows_per_tile, min_capacity=min_capacity, num_comm_ctas=num_comm_ctas,
              params=params, engine=bool(engine), engine_config=engine_config)
    caps: dict = {}
    for splits in ([tiles0] * R, [1] * R):
        c = plan_megadcp(hist, qlen, mesh, axis_name, splits=splits, **kw).capacity
        caps = {k: max(v, caps.get(k, 0)) for k, v in c.items()}
    qtt = tile_query_tokens(int(rows_per_tile), heads)
    caps["reductions"] = max(caps["reductions"], bucket(Tq * heads, min_capacity))
    caps["red_run"] = max(caps["red_run"], bucket(qtt * heads, 1))
    caps["red_inputs"] = max(caps["red_inputs"], bucket(tiles0, 1))
    caps["query_tokens"] = bucket(Tq, min_capacity)
    return caps


def fits_capacity(plan, capacities: dict) -> str | None:
    """``None`` when ``plan`` was planned within ``capacities`` (equal static shapes), else a
    sentence naming the first table that grew past its floor."""
    got = plan.capacity or {}
    for k, v in capacities.items():
        if got.get(k, v) != v:
            return f"table {k!r} needs capacity {got[k]}; the pinned capacity is {v}"
    return None


__all__ = ["capacity_for", "fits_capacity"]
