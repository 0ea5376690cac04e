"""Mooncake trace loader, generator and the Appendix B.2 snapshot builder."""
import json
import time
import warnings

import numpy as np
import pytest

from liquidcp_jax.workloads import mooncake as mc


def make_trace(rows):
    """rows: (timestamp_ms, input_length, output_length, hash_ids or None for fresh ids)."""
    fresh = 10_000
    lines = []
    for ts, n_in, n_out, ids in rows:
        nb = -(-n_in // 512)
        if ids is None:
            ids, fresh = list(range(fresh, fresh + nb)), fresh + nb
        lines.append(json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out,
                                 "hash_ids": list(ids)}))
    return mc.parse_trace_lines(lines)


@pytest.fixture(scope="module")
def small_trace():
    return mc.generate_trace(400, seed=5, rate_per_s=6.0)


# ---------------------------------------------------------------- loader and generator

def test_roundtrip_and_generator_schema(tmp_path):
    tr = mc.generate_trace(300, seed=1)
    nb = -(-tr.input_length // 512)
    np.testing.assert_array_equal(np.diff(tr.hash_offsets), nb)
    assert (np.diff(tr.timestamp_ms) >= 0).all() and tr.output_length.min() >= 1
    p = tmp_path / "t.jsonl"
    tr.write_jsonl(p)
    back = mc.load_trace(p)
    for f in ("timestamp_ms", "input_length", "output_length", "hash_offsets", "hash_ids"):
        np.testing.assert_array_equal(getattr(back, f), getattr(tr, f))
    # Seeded: same seed same trace, another seed another.
    np.testing.assert_array_equal(mc.generate_trace(300, seed=1).hash_ids, tr.hash_ids)
    assert not np.array_equal(mc.generate_trace(300, seed=2).input_length, tr.input_length)


def test_loader_sorts_by_arrival_and_skips_blank_lines():
    tr = mc.parse_trace_lines([
        '{"timestamp": 50, "input_length": 600, "output_length": 2, "hash_ids": [7, 8]}', "",
        '{"timestamp": 10, "input_length": 10, "output_length": 3, "hash_ids": [9]}'])
    np.testing.assert_array_equal(tr.timestamp_ms, [10, 50])
    np.testing.assert_array_equal(tr.request_hash_ids(1), [7, 8])
    np.testing.assert_array_equal(tr.request_hash_ids(0), [9])


GOOD = {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2]}


@pytest.mark.parametrize("bad,match", [
    ("{not json", "row 3: not valid JSON"),
    ("[1, 2]", "row 3: expected a JSON object"),
    ({k: v for k, v in GOOD.items() if k != "output_length"}, "row 3: field 'output_length' is missing"),
    (dict(GOOD, timestamp=-1), "row 3: field 'timestamp'"),
    (dict(GOOD, timestamp=1.5), "row 3: field 'timestamp'"),
    (dict(GOOD, input_length=0), "row 3: field 'input_length'"),
    (dict(GOOD, input_length=True), "row 3: field 'input_length'"),
    (dict(GOOD, output_length="5"), "row 3: field 'output_length'"),
    (dict(GOOD, hash_ids=[1, -2]), "row 3: field 'hash_ids' must be a list"),
    (dict(GOOD, hash_ids="12"), "row 3: field 'hash_ids' must be a list"),
    (dict(GOOD, hash_ids=[1, 2, 3]), r"row 3: field 'hash_ids' has 3 ids; expected ceil\(input_length / 512\) = 2"),
])
def test_loader_rejects_malformed_rows_with_row_number(tmp_path, bad, match):
    p = tmp_path / "bad.jsonl"
    bad_line = bad if isinstance(bad, str) else json.dumps(bad)
    p.write_text("\n".join([json.dumps(GOOD), json.dumps(GOOD), bad_line, json.dumps(GOOD)]) + "\n")
    with pytest.raises(ValueError, match=match):
        mc.load_trace(p)


def test_loader_rejects_missing_or_empty(tmp_path):
    with pytest.raises(ValueError, match="path"):
        mc.load_trace(tmp_path / "absent.jsonl")
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no rows"):
        mc.load_trace(tmp_path / "e.jsonl")


def test_default_path_env_and_fallback(tmp_path, monkeypatch):
    mc.generate_trace(20, seed=3).write_jsonl(tmp_path / "conversation_trace.jsonl")
    monkeypatch.setenv(mc.TRACE_DIR_ENV, str(tmp_path))
    assert mc.default_trace_path() == tmp_path / "conversation_trace.jsonl"
    assert len(mc.load_default_trace()) == 20
    # No file anywhere: a clear warning and the seeded generator.
    monkeypatch.delenv(mc.TRACE_DIR_ENV)
    monkeypatch.setattr(mc, "repo_root", lambda: tmp_path / "nowhere" / "main")
    assert mc.default_trace_path() is None
    with pytest.warns(UserWarning, match="not found.*synthetic generator"):
        tr = mc.load_default_trace(fallback_requests=30, seed=4)
    np.testing.assert_array_equal(tr.input_length, mc.generate_trace(30, seed=4).input_length)
    with pytest.raises(ValueError, match="name"):
        mc.default_trace_path("chat")


# ---------------------------------------------------------------- acceptance draws

def test_acceptance_draws_seeded_with_paper_frequencies():
    a = mc.accepted_drafts(200_000, seed=11)
    np.testing.assert_array_equal(a, mc.accepted_drafts(200_000, seed=11))
    assert not np.array_equal(a[:1000], mc.accepted_drafts(1000, seed=12))
    freq = np.bincount(a, minlength=5) / a.size
    # 4.5 sigma of a binomial proportion at n = 200K is below 0.0045.
    np.testing.assert_allclose(freq, mc.ACCEPT_PROBS, atol=0.0045)
    assert abs((1 + a).mean() - 2.75) < 0.01  # the paper's 2.75 committed tokens per step
    with pytest.raises(ValueError, match="probs"):
        mc.accepted_drafts(5, 0, probs=(0.5, 0.6))


def test_decode_histories_follow_the_draws(small_trace):
    rep = mc.replay(small_trace, 1.0, seed=3)
    out = small_trace.output_length
    seen = 0
    for i in np.nonzero(rep.decode_steps > 2)[0][:50]:
        k = np.arange(rep.decode_steps[i])
        hist = np.array([_row(rep.batch_at_step(int(rep.decode_start[i] + j)), i)[0] for j in k])
        assert hist[0] == small_trace.input_length[i]
        assert set(np.diff(hist)) <= {1, 2, 3, 4, 5}
        # Generated tokens = 1 (from prefill) + commits; the last step reaches output_length.
        gen_before_last = 1 + hist[-1] - hist[0]
        assert gen_before_last < out[i]
        seen += 1
    assert seen == 50
    # Same seed same replay; another seed other histories.
    again = mc.replay(small_trace, 1.0, seed=3)
    np.testing.assert_array_equal(again.commits_prefix, rep.commits_prefix)
    assert not np.array_equal(mc.replay(small_trace, 1.0, seed=4).decode_steps, rep.decode_steps)


def _row(snap, rid):
    j = int(np.nonzero(snap.request_ids == rid)[0][0])
    return snap.history_lengths[j], snap.query_lengths[j], snap.is_prefill[j]


# ---------------------------------------------------------------- arrivals, chunking, cache

@pytest.mark.parametrize("scale", [1, 2, 4])
def test_arrival_scaling(scale):
    tr = make_trace([(0, 100, 3, None), (1000, 100, 3, None), (2010, 100, 3, None)])
    rep = mc.replay(tr, scale)
    want = np.ceil(np.array([0, 1000, 2010]) / scale / 20).astype(int)
    np.testing.assert_array_equal(rep.arrival_step, want)
    # An idle system schedules each arrival in its arrival step.
    first = [rep.chunk_step[rep.chunk_request == i].min() for i in range(3)]
    np.testing.assert_array_equal(first, want)
    np.testing.assert_array_equal(rep.decode_start, want + 1)
    # Generated traces: the scaled replay sees the same arrivals `scale` times sooner.
    g = mc.generate_trace(50, seed=0)
    np.testing.assert_array_equal(mc.replay(g, scale, until_ms=1000).arrival_step,
                                  np.ceil(g.timestamp_ms / (20.0 * scale)).astype(int))


@pytest.mark.parametrize("budget", [4096, None])
def test_chunking(small_trace, budget):
    rep = mc.replay(small_trace, 4.0, prefill_token_budget=budget)
    L = small_trace.input_length
    assert rep.chunk_tokens.max() <= 4096 and rep.chunk_tokens.min() >= 1
    assert (np.diff(rep.chunk_step) >= 0).all()
    # One chunk per request per step.
    pairs = rep.chunk_step * len(L) + rep.chunk_request
    assert np.unique(pairs).size == pairs.size
    if budget is not None:
        per_step = np.bincount(rep.chunk_step, weights=rep.chunk_tokens)
        assert per_step.max() <= budget
    for i in range(len(L)):
        sel = rep.chunk_request == i
        c, h = rep.chunk_tokens[sel], rep.chunk_history[sel]
        # The chunks tile the uncached suffix exactly, in order.
        assert c.sum() == L[i] - rep.cached_tokens[i]
        assert h[0] == rep.cached_tokens[i]
        np.testing.assert_array_equal(h[1:], h[:-1] + c[:-1])
        assert rep.decode_start[i] == rep.chunk_step[sel].max() + 1
    # Prefill rows of a batch are the chunks of that step.
    s = int(rep.chunk_step[len(rep.chunk_step) // 2])
    snap = rep.batch_at_step(s)
    assert snap.kind == "mixed"
    np.testing.assert_array_equal(np.sort(snap.request_ids[snap.is_prefill]),
                                  np.sort(rep.chunk_request[rep.chunk_step == s]))
    assert (snap.query_lengths[~snap.is_prefill] == 16).all()


def test_prefix_cache_accounting():
    a_ids = list(range(10))  # 10 blocks, 5000 tokens
    tr = make_trace([
        (0, 5000, 4, a_ids),                       # A: cold
        (0, 5000, 4, a_ids),                       # A' arrives with A: A is not cached yet
        (10_000, 5000, 4, a_ids[:8] + [100, 101]),  # B shares 8 full blocks
        (20_000, 5000, 4, a_ids),                  # C repeats A: (L-1)//512 = 9 blocks cached, since
                                                   # at least one token is recomputed for the logits
        (30_000, 700, 4, [55, 56]),                # D: unrelated
    ])
    rep = mc.replay(tr, 1.0)
    np.testing.assert_array_equal(rep.cached_tokens, [0, 0, 8 * 512, 9 * 512, 0])
    prefilled = np.bincount(rep.chunk_request, weights=rep.chunk_tokens, minlength=5)
    np.testing.assert_array_equal(prefilled, [5000, 5000, 5000 - 4096, 5000 - 4608, 700])
    # The repeated prefix is not re-prefilled: C's single chunk starts after the cached blocks.
    sel = rep.chunk_request == 3
    np.testing.assert_array_equal(rep.chunk_history[sel], [4608])
    # A and A' share one 4096-token budget per step: FCFS, A first.
    s0 = rep.batch_at_step(0)
    np.testing.assert_array_equal(s0.request_ids, [0])
    np.testing.assert_array_equal(s0.query_lengths, [4096])
    s1 = rep.batch_at_step(1)
    np.testing.assert_array_equal(s1.request_ids, [0, 1])
    np.testing.assert_array_equal(s1.history_lengths, [4096, 0])
    np.testing.assert_array_equal(s1.query_lengths, [904, 3192])


def test_concurrency_cap(small_trace):
    rep = mc.replay(small_trace, 4.0, max_batch_requests=6, until_ms=60_000)
    sizes = [rep.batch_at_step(s).request_ids.size for s in range(rep.horizon_step)]
    assert max(sizes) == 6
    free = mc.replay(small_trace, 4.0, until_ms=60_000)
    assert max(free.batch_at_step(s).request_ids.size for s in range(free.horizon_step)) > 6


def test_snapshots_window_kinds_and_stats(small_trace):
    span_s = small_trace.timestamp_ms[-1] / 1000
    for scale in (1, 2, 4):
        snaps = mc.build_snapshots(small_trace, scale, num_snapshots=20, seed=1,
                                   window_s=(5.0, span_s * 0.8))
        assert len(snaps) == 20 and all(s.request_ids.size for s in snaps)
        t = np.array([s.t_ms for s in snaps])
        assert (np.diff(t) >= 0).all()
        assert t.min() >= 5000 / scale and t.max() <= span_s * 800 / scale
        for s in snaps:
            h, q = s.batch
            assert h.dtype == q.dtype == np.int64 and h.shape == q.shape
            assert (q[~s.is_prefill] == 16).all() and (q[s.is_prefill] <= 4096).all()
            assert s.kind == ("mixed" if s.is_prefill.any() else "decode")
        again = mc.build_snapshots(small_trace, scale, num_snapshots=20, seed=1,
                                   window_s=(5.0, span_s * 0.8))
        np.testing.assert_array_equal(np.concatenate([s.history_lengths for s in snaps]),
                                      np.concatenate([s.history_lengths for s in again]))
    st = mc.snapshot_stats(snaps)
    assert st["snapshots_decode"] + st["snapshots_mixed"] == 20
    assert st["decode_history_mean"] > 0
    with pytest.raises(ValueError, match="window_s"):
        mc.build_snapshots(small_trace, 1, window_s=(10, 5))
    with pytest.raises(ValueError, match="non-empty batch"):
        mc.build_snapshots(small_trace, 1, num_snapshots=3, window_s=(1e6, 1e6 + 1))


def test_bad_arguments(small_trace):
    with pytest.raises(ValueError, match="scale"):
        mc.replay(small_trace, 0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        mc.replay(small_trace, 1, chunk_tokens=0)
    with pytest.raises(ValueError, match="prefill_token_budget"):
        mc.replay(small_trace, 1, prefill_token_budget=-4)
    with pytest.raises(ValueError, match="trace"):
        mc.replay([1, 2], 1)
    with pytest.raises(ValueError, match="num_requests"):
        mc.generate_trace(0)
    rep = mc.replay(small_trace, 1, until_ms=1000)
    with pytest.raises(ValueError, match="step"):
        rep.batch_at_step(rep.horizon_step)


# ---------------------------------------------------------------- the real trace excerpt

def test_real_conversation_trace_smoke():
    path = mc.default_trace_path("conversation")
    if path is None:
        pytest.skip("shared/data/mooncake/conversation_trace.jsonl is absent beside the checkout")
    tr = mc.load_trace(path)
    assert len(tr) == 12031
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        snaps = mc.build_snapshots(tr, 4, num_snapshots=100, seed=0)
    assert time.perf_counter() - t0 < 10  # a one-hour replay at 4x takes well under a second
    st = mc.snapshot_stats(snaps)
    # Table 3 (4x): 54/46 D/M, 34.5 decode requests per batch, ~12.2K decode history.
    assert 20 < st["decode_requests_per_decode_batch"] < 50
    assert 8_000 < st["decode_history_mean"] < 18_000
    assert st["snapshots_mixed"] > 10
