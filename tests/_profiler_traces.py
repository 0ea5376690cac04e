"""Chrome traces in the format of Mosaic GPU's on-device profiler, for testing trace readers on
the CPU: a buffer laid out as the device leaves it, dumped by the profiler's own ``ProfilerSpec``."""
import io
import json

import numpy as np
from jax.experimental.mosaic.gpu import profiler as mgpu_profiler


def events_buffer(spec, events, num_warpgroups: int, start_ns=1000):
    """The profiler's buffer: per (CTA, warpgroup) a header (start time, SM id, entries used)
    then (tag, %clock) pairs. ``events[(cta, wg)]`` lists ``(name, "B" or "E", cycle)`` in the
    order the device records them (regions may nest)."""
    G = 1 + max(c for c, _ in events)
    buf = np.zeros((G, num_warpgroups, spec.entries_per_warpgroup), np.uint32)
    for (c, wg), evs in events.items():
        ev = []
        for name, ph, t in evs:
            ev += [(spec.ENTER if ph == "B" else spec.EXIT) | spec.intern_name(name), t]
        buf[c, wg, :3] = (start_ns + 7 * c, c, len(ev))
        buf[c, wg, 3:3 + len(ev)] = ev
    return buf.reshape(-1), G


def profiler_trace(events, space: int, num_warpgroups: int):
    """The Chrome trace ``ProfilerSpec.dump`` writes from that buffer (``space``: the kernel's
    ``profile_space``)."""
    spec = mgpu_profiler.ProfilerSpec(4 * space)
    buf, G = events_buffer(spec, events, num_warpgroups)
    f = io.StringIO()
    spec.dump(buf, f, grid=(G, 1, 1), block=(128 * num_warpgroups, 1, 1))
    return json.loads(f.getvalue())
