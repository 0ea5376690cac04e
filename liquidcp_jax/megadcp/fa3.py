"""FlashAttention-3's native KV-split heuristic, reproduced for the FA3-derived reference plan.

Source: ``Dao-AILab/flash-attention`` tag ``v2.8.3`` (unchanged at HEAD 2026-08-15):

* ``hopper/heuristics.h`` -- ``num_splits_heuristic`` (the static split count);
* ``hopper/flash_api.cpp`` -- ``get_num_splits``, its only caller, which forms
  ``num_m_blocks`` from the *batch-wide* ``max_seqlen_q`` (PackGQA folds the
  ``h / h_k`` query heads of one KV head into rows), ``num_n_blocks`` from
  ``max_seqlen_k`` and pretends ``batch = 1`` when the varlen scheduler runs
  (``b <= 992``);
* ``hopper/flash_prepare_scheduler.cu`` -- ``prepare_varlen_num_blocks``, the
  per-sequence dynamic split capped by the static count;
* ``hopper/tile_size.h`` -- kBlockM/kBlockN (hdim 128, 16-bit: kBlockM 128;
  kBlockN 128 if causal/local/paged-non-TMA else 176).

The arithmetic is reproduced with the same types: float32 where the C++ uses
``float`` (``0.8f * num_SMs``, ``n_waves``, ``ceilf(total * 1.1f * heads / sms)``)
and float64 where it uses a ``double`` literal (``0.85 * max_efficiency``).
This is our own re-implementation from reading the code; no code is copied.

vLLM's DCP path (``FlashAttentionImpl._forward_with_dcp``) calls FA3's varlen
forward with ``causal=False``, the gathered query heads ``P * hq`` over one KV
head, ``max_seqlen_q`` = the batch's longest query and ``seqused_k`` = each
request's local history shard; that is what :func:`fa3_num_splits` models.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

_F32 = np.float32
PREPARE_VARLEN_MAX_BATCHES = 992  # 32 warps x 31 batches per warp in the 1-CTA prepare kernel
L2_BYTES = 50 * 1024 * 1024


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def num_splits_heuristic(total_mblocks: int, num_sms: int, num_n_blocks: int, num_m_blocks: int,
                         size_one_kv_head: int, is_causal_or_local: bool, max_splits: int) -> int:
    """FA3 ``num_splits_heuristic`` (``hopper/heuristics.h``): the static split count (int)."""
    for name, v in (("total_mblocks", total_mblocks), ("num_sms", num_sms),
                    ("num_n_blocks", num_n_blocks), ("num_m_blocks", num_m_blocks),
                    ("max_splits", max_splits)):
        if int(v) < (1 if name in ("num_sms", "max_splits") else 0):
            raise ValueError(f"{name} must be a non-negative int (num_sms, max_splits >= 1), got {v}")
    total_mblocks, num_sms = int(total_mblocks), int(num_sms)
    # `total_mblocks >= 0.8f * num_SMs`: int promoted to float, float32 product.
    if _F32(total_mblocks) >= _F32(0.8) * _F32(num_sms):
        if size_one_kv_head > L2_BYTES and num_m_blocks >= num_sms * 2 and not is_causal_or_local:
            return min(_ceil_div(int(size_one_kv_head), L2_BYTES), int(max_splits))
        return 1
    if num_n_blocks <= 4:
        return 1
    max_splits = min(int(max_splits), num_sms, int(num_n_blocks))
    # The C++ loops s = 1..max_splits; element-wise float32 arithmetic is the same IEEE math.
    s = np.arange(1, max_splits + 1, dtype=np.int64)
    with np.errstate(divide="ignore", invalid="ignore"):
        n_waves = (total_mblocks * s).astype(_F32) / _F32(num_sms)
        eff = (n_waves / np.ceil(n_waves)).astype(_F32)
    # `if (eff > max_efficiency) max_efficiency = eff` from 0: NaN (0 / 0) never wins.
    max_eff = max(0.0, float(np.max(np.where(np.isnan(eff), _F32(0), eff))))
    ok = eff.astype(np.float64) >= 0.85 * max_eff
    return int(np.argmax(ok)) + 1 if ok.any() else 1


def fa3_block_n(head_dim: int = 128, *, causal: bool = False, paged_kv_non_tma: bool = True) -> int:
    """kBlockN of ``tile_size_fwd_sm90`` for 16-bit inputs and ``head_dim <= 128`` (hdim 128 only).

    vLLM's paged cache (page 16) is never TMA-paged, so its DCP calls use 128.
    """
    if head_dim != 128:
        raise ValueError(f"head_dim must be 128 (the only tile size reproduced here), got {head_dim}")
    return 128 if (causal or paged_kv_non_tma) else 176


def fa3_static_num_splits(num_seqs: int, max_seqlen_q: int, max_seqlen_k: int, *, num_heads: int,
                          num_heads_k: int = 1, head_dim: int = 128, num_sms: int = 132,
                          block_m: int = 128, block_n: int = 128, is_causal: bool = False,
                          varlen: bool = True, max_splits: int = 128, heuristic=None) -> int:
    """``get_num_splits`` (``hopper/flash_api.cpp``): the static split count of one FA3 call.

    ``heuristic``: an implementation of :func:`num_splits_heuristic` with its signature (the
    planner passes the compiled one, ``_cw_native.fa3_heuristic``); default this module's.
    """
    if num_heads < 1 or num_heads_k < 1 or num_heads % num_heads_k:
        raise ValueError(f"num_heads={num_heads} must be a positive multiple of num_heads_k={num_heads_k}")
    if max_seqlen_q < 0 or max_seqlen_k < 0 or num_seqs < 1:
        raise ValueError(f"need num_seqs >= 1 and max lengths >= 0, got {num_seqs}, "
                         f"{max_seqlen_q}, {max_seqlen_k}")
    num_m_blocks = _ceil_div(max_seqlen_q * (num_heads // num_heads_k), block_m)
    num_n_blocks = _ceil_div(max_seqlen_k, block_n)
    # int32 in the C++; overflows only beyond 8M tokens at hdim 128, far outside decode shards.
    size_one_kv_head = max_seqlen_k * (head_dim + head_dim) * 2
    dynamic = varlen and num_seqs <= PREPARE_VARLEN_MAX_BATCHES
    total_mblocks = (1 if dynamic else num_seqs) * num_heads_k * num_m_blocks
    return (heuristic or num_splits_heuristic)(total_mblocks, num_sms, num_n_blocks, num_m_blocks,
                                               size_one_kv_head, is_causal, max_splits)


def fa3_dynamic_splits(n_blocks: Sequence[int], m_blocks: Sequence[int], num_splits_static: int, *,
                       num_sms: int, num_head: int = 1) -> tuple[int, ...]:
    """``prepare_varlen_num_blocks`` (``hopper/flash_prepare_scheduler.cu``): per-sequence splits.

    Args:
      n_blocks: ``(B,)`` KV blocks per sequence, ``ceil(seqused_k / kBlockN)``.
      m_blocks: ``(B,)`` query blocks per sequence (PackGQA rows / kBlockM).
      num_head: ``h_k`` when PackGQA is on (always, once the static count is > 1).
    """
    if num_splits_static <= 1:
        # The kernel is then compiled without Split: every sequence runs whole.
        return tuple(1 for _ in n_blocks)
    n = np.asarray(n_blocks, dtype=np.int64)
    total_blocks = int(np.dot(np.asarray(m_blocks, dtype=np.int64), n))
    bps = int(math.ceil(_F32(_F32(_F32(total_blocks) * _F32(1.1)) * _F32(num_head)) / _F32(num_sms)))
    # C++ divides by blocks_per_sm unguarded; it is 0 only when every sequence is empty.
    s = -(-n // bps) if bps > 0 else np.ones_like(n)
    return tuple(np.clip(s, 1, max(1, num_splits_static)).tolist())


def fa3_num_splits(seqused_k: Sequence[int], query_lens: Sequence[int], *, num_heads: int,
                   num_heads_k: int = 1, head_dim: int = 128, num_sms: int = 132,
                   block_m: int = 128, block_n: int = 128, max_seqlen_k: int | None = None,
                   max_seqlen_q: int | None = None, is_causal: bool = False,
                   max_splits: int = 128) -> tuple[int, ...]:
    """Per-sequence split counts FA3's varlen forward picks when the caller passes ``num_splits <= 0``.

    Args:
      seqused_k: ``(B,)`` KV tokens per sequence (for DCP: the local history shard).
      query_lens: ``(B,)`` query tokens per sequence.
      num_heads / num_heads_k: query and KV heads of the call (DCP: ``P * hq`` over 1).
      max_seqlen_k / max_seqlen_q: what the caller passes; default the batch maxima.
        (vLLM passes the batch-wide maximum query length: a prefill chunk in the batch
        pushes ``num_m_blocks`` past ``0.8 * num_sms`` and disables splitting for all.)
    Returns:
      ``(B,)`` split counts, each in ``[1, 128]``.
    """
    ks = [int(x) for x in seqused_k]
    qs = [int(x) for x in query_lens]
    if len(ks) != len(qs) or not ks:
        raise ValueError(f"seqused_k and query_lens must be non-empty and equally long, got "
                         f"{len(ks)} and {len(qs)}")
    if min(ks) < 0 or min(qs) < 0:
        raise ValueError("seqused_k and query_lens must be >= 0")
    mk = max(ks) if max_seqlen_k is None else int(max_seqlen_k)
    mq = max(qs) if max_seqlen_q is None else int(max_seqlen_q)
    static = fa3_static_num_splits(len(ks), mq, mk, num_heads=num_heads, num_heads_k=num_heads_k,
                                   head_dim=head_dim, num_sms=num_sms, block_m=block_m,
                                   block_n=block_n, is_causal=is_causal, max_splits=max_splits)
    if len(ks) > PREPARE_VARLEN_MAX_BATCHES:
        return tuple(static for _ in ks)
    qpk = num_heads // num_heads_k
    m_blocks = [_ceil_div(q * qpk, block_m) for q in qs]
    n_blocks = [_ceil_div(k, block_n) for k in ks]
    return fa3_dynamic_splits(n_blocks, m_blocks, static, num_sms=num_sms, num_head=num_heads_k)
