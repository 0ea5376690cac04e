"""MegaRing engine kernels on a Hopper GPU (skipped elsewhere; not yet run: no GPU was lent when
they were written). The staged transfer launch on emulated ranks of a 64K BuddyRing plan moves
exactly the tables' tiles into the receive buffers."""
import numpy as np
import pytest
import jax
import jax.numpy as jnp

from liquidcp_jax import placement as placement_lib
from liquidcp_jax.megaring import engine_protocol as ep
from liquidcp_jax.megaring.layout import build_layout
from liquidcp_jax.pallas import api
from liquidcp_jax.pallas import megaring_engine as me
from liquidcp_jax.pallas import megaring_transport as mt
from liquidcp_jax.workloads.samplers import sample_batch

_OK, _WHY = api.is_supported(jnp.bfloat16, 128)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=_WHY)]


@pytest.mark.parametrize("dataset,devices", [("freelaw", 8), ("pilecc", 4)])
def test_transfer_launch_64k(rng, dataset, devices):
    lengths = sample_batch(dataset, 65536, 0)
    pl_ = placement_lib.buddyring(lengths.tolist(), devices)
    B = 128
    lay = build_layout(lengths, pl_.starts, pl_.sizes, devices, B)
    send = tuple(int(-(-lay.prefix_rows[t].max() // B)) for t in range(1, lay.steps))
    tb = ep.build_engine_tables(lay, send, causal=True, comm_per_rank=2)
    g = mt.RingGeometry(devices, lay.capacity // B, B, send)
    kv = jnp.asarray(rng.standard_normal((devices * g.rows, 128)), jnp.bfloat16)
    out = np.asarray(jax.block_until_ready(me.transfer_launch(kv, tb, g)).astype(jnp.float32))
    rows, _ = me.transfer_lists(tb, g)
    k = np.asarray(kv.astype(jnp.float32))
    for src, dst in rows.tolist():
        np.testing.assert_array_equal(out[dst:dst + B], k[src:src + B])
