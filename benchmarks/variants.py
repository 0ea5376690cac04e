"""The one registry of named kernel configurations the benchmarks can time (``--variants``).

Each entry is data: which pass it changes (``"fwd"``: ``pallas.api.TuningConfig``; ``"bwd"``:
``tile_attention_bwd.BwdTuningConfig``) and the config fields it sets; everything else stays at
the library default. ``kernels.py`` times a "fwd" variant's forward and a "bwd" variant's backward
kernels alone; ``kernel_trace.py`` traces a "fwd" variant's forward (and, with ``--bwd``, its
forward+backward under the default backward) and a "bwd" variant's forward+backward.

When a config option is removed from the library, delete the entries that set it (the benchmark
tests build every entry, so a stale one fails there, naming itself).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class Variant:
    kind: str                   # "fwd" or "bwd"
    fields: Mapping[str, Any]   # config fields that differ from the library default


VARIANTS: dict[str, Variant] = {
    # Forward: the two kernels forced (the default picks by tokens per segment slot), tiles,
    # ring depth.
    "fwd_plain": Variant("fwd", {"persistent": False}),
    "fwd_persistent": Variant("fwd", {"persistent": True}),
    "fwd_bkv64": Variant("fwd", {"block_kv": 64}),
    "fwd_mcs3": Variant("fwd", {"max_concurrent_steps": 3}),
    # Backward: the two kernels or the fused one forced (the default picks per batch).
    "two_kernel": Variant("bwd", {"fused": False}),
    "fused": Variant("bwd", {"fused": True}),
    "two_kernel_dq128": Variant("bwd", {"fused": False, "block_kv_dq": 128}),
    "dq128": Variant("bwd", {"block_kv_dq": 128}),
    "fused_mcs3": Variant("bwd", {"fused": True, "max_concurrent_steps": 3}),
    # Named barriers for the backward's hand-overs (default: on for two kernels, off for fused).
    "named_barriers": Variant("bwd", {"named_barriers": True}),
    "mbarrier_bwd": Variant("bwd", {"named_barriers": False}),
    "two_kernel_named": Variant("bwd", {"fused": False, "named_barriers": True}),
    "two_kernel_mbarrier": Variant("bwd", {"fused": False, "named_barriers": False}),
    "fused_named": Variant("bwd", {"fused": True, "named_barriers": True}),
    # Backward ring depth.
    "mcs3": Variant("bwd", {"max_concurrent_steps": 3}),
    "mcs4": Variant("bwd", {"max_concurrent_steps": 4}),
    "mcs3_named": Variant("bwd", {"max_concurrent_steps": 3, "named_barriers": True}),
}


def parse(spec: str | None) -> list[str]:
    """Comma list of :data:`VARIANTS` names ('' or None: none) -> list; ValueError naming an
    unknown one and the known ones."""
    names = [x.strip() for x in (spec or "").split(",") if x.strip()]
    for n in names:
        if n not in VARIANTS:
            raise ValueError(f"--variants: unknown variant {n!r}; expected a comma list of "
                             f"{sorted(VARIANTS)}")
    return names


def config(name: str):
    """The ``TuningConfig`` / ``BwdTuningConfig`` of a variant."""
    from liquidcp_jax.pallas import api
    from liquidcp_jax.pallas import tile_attention_bwd
    v = VARIANTS[name]
    cls = api.TuningConfig if v.kind == "fwd" else tile_attention_bwd.BwdTuningConfig
    unknown = set(v.fields) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ValueError(f"variant {name!r} sets {sorted(unknown)}, which {cls.__name__} no longer "
                         "has: delete it from benchmarks/variants.py")
    return cls(**v.fields)


def configs(name: str):
    """(forward config, backward config) of a variant; the other pass keeps the default (None)."""
    cfg = config(name)
    return (cfg, None) if VARIANTS[name].kind == "fwd" else (None, cfg)
