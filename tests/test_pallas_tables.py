"""Task-table builder and masking logic (CPU, NumPy and jnp builders)."""
import numpy as np
import jax.numpy as jnp
import pytest

from liquidcp_jax.pallas import tables as T
from liquidcp_jax.reference import segment_visibility


def _case(rng, causal, s_cap=6):
  n = int(rng.integers(1, s_cap + 1))
  lens = rng.integers(1, 300, size=n)
  lens[0] = 1  # always one length-1 segment
  gaps = rng.integers(0, 40, size=n)
  qs = np.cumsum(gaps) + np.cumsum(np.r_[0, lens[:-1]])
  tq = -(-max(int(qs[-1] + lens[-1] + rng.integers(0, 40)), 128) // 8) * 8
  perm = rng.permutation(n)  # segments need not be sorted
  qs, lens = qs[perm], lens[perm]
  ks = np.cumsum(np.r_[0, lens[:-1]])  # k packed densely, q with gaps
  tk = -(-max(int(ks.max() + lens.max()), 128) // 128) * 128
  qp = rng.integers(0, 50, size=n)
  kp = qp - rng.integers(0, 20, size=n)  # keys may start earlier (ring offsets)
  pad = lambda a: np.r_[a, rng.integers(0, 5, size=s_cap - n)]  # junk beyond num_segs
  return [pad(qs), pad(lens), pad(ks), pad(lens), pad(qp), pad(kp)], n, tq, tk


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_kv", [64, 128])
def test_every_pair_covered_exactly_once(causal, block_kv):
  rng = np.random.default_rng(1 + causal + block_kv)
  for _ in range(8):
    args, n, tq, tk = _case(rng, causal)
    tt = T.build_task_table(*args, n, tq=tq, tk=tk, block_q=128, block_kv=block_kv, causal=causal)
    cnt = T.table_visibility(tt, tq, tk)
    ref = segment_visibility((*args, n), tq, tk, causal)
    assert ref.sum() > 0
    np.testing.assert_array_equal(cnt, ref.astype(np.int64))


@pytest.mark.parametrize("causal", [False, True])
def test_reverse_table_is_the_transpose(causal):
  rng = np.random.default_rng(21 + causal)
  for _ in range(8):
    (qs, ql, ks, kl, qp, kp), n, tq, tk = _case(rng, causal)
    tkr = -(-tk // 8) * 8
    tqc = -(-tq // 64) * 64
    tt = T.build_task_table(ks, kl, qs, ql, kp, qp, n, tq=tkr, tk=tqc, block_q=128, block_kv=64,
                            causal=causal, reverse=True)
    cnt = T.table_visibility(tt, tkr, tqc)[:tk, :tq]
    ref = segment_visibility((qs, ql, ks, kl, qp, kp, n), tq, tk, causal)
    np.testing.assert_array_equal(cnt, ref.T.astype(np.int64))
    tab = tt.table
    assert (tab[:, T.F["t_lo"]] <= np.maximum(tab[:, T.F["full_lo"]], tab[:, T.F["t_lo"]])).all()


@pytest.mark.parametrize("reverse", [False, True])
def test_segment_launch_order(reverse):
  """launch_order="segment": the same tasks as "work" (every pair still covered once), grouped by
  segment with the longest segment first, heaviest task first inside one, workless tasks last;
  the jnp builder agrees."""
  rng = np.random.default_rng(41 + reverse)
  for _ in range(6):
    args, n, tq, tk = _case(rng, True)
    if reverse:
      (qs, ql, ks, kl, qp, kp) = args
      args, tq, tk = [ks, kl, qs, ql, kp, qp], -(-tk // 8) * 8, -(-tq // 64) * 64
    kw = dict(tq=tq, tk=tk, block_q=128, block_kv=64, causal=True, reverse=reverse)
    a = T.build_task_table(*args, n, **kw)
    b = T.build_task_table(*args, n, launch_order="segment", **kw)
    np.testing.assert_array_equal(T.table_visibility(a, tq, tk), T.table_visibility(b, tq, tk))
    c = T.build_task_table(*[jnp.asarray(x) for x in args], jnp.int32(n), launch_order="segment",
                           xp=jnp, **kw)
    np.testing.assert_array_equal(np.asarray(c.table), b.table)
    np.testing.assert_array_equal(np.asarray(c.row_task), b.row_task)
    tab = b.table
    work = tab[:, T.F["n_tiles"]] - tab[:, T.F["t_lo"]]
    live = np.flatnonzero(work > 0)
    assert (live == np.arange(live.size)).all()  # workless tasks last
    # Segment of each live task: its first stored row's segment (segments do not overlap in q).
    first = tab[live, T.F["q_base"]] + tab[live, T.F["q_lo"]]
    qs, ql = np.asarray(args[0][:n]), np.asarray(args[1][:n])
    seg = np.array([np.flatnonzero((qs <= r) & (r < qs + ql))[0] for r in first])
    change = np.flatnonzero(np.diff(seg)) + 1
    runs = np.split(seg, change)
    assert len({int(r[0]) for r in runs}) == len(runs)  # each segment one contiguous run
    assert (np.diff([ql[r[0]] for r in runs]) <= 0).all()  # longest segment first
    for w in np.split(work[live], change):
      assert (np.diff(w) <= 0).all()  # heaviest first inside a segment


def test_jnp_builder_matches_numpy_and_rows_owned_once():
  rng = np.random.default_rng(7)
  for causal in (False, True):
    args, n, tq, tk = _case(rng, causal)
    a = T.build_task_table(*args, n, tq=tq, tk=tk, block_q=128, block_kv=128, causal=causal)
    b = T.build_task_table(*[jnp.asarray(x) for x in args], jnp.int32(n), tq=tq, tk=tk,
                           block_q=128, block_kv=128, causal=causal, xp=jnp)
    np.testing.assert_array_equal(a.table, np.asarray(b.table))
    np.testing.assert_array_equal(a.row_task, np.asarray(b.row_task))
    tab = a.table
    owner = np.zeros(tq, int)
    for row in tab:
      d = dict(zip(T.FIELDS, row))
      assert 0 <= d["full_lo"] <= d["full_hi"] <= d["n_tiles"]
      assert 0 <= d["q_base"] <= tq - 128 and 0 <= d["kv_base"] <= tk - 128
      assert d["kv_base"] + d["n_tiles"] * 128 <= tk
      assert d["q_base"] % T.ROW_ALIGN == 0 and d["kv_base"] % T.ROW_ALIGN == 0
      owner[d["q_base"] + d["q_lo"]:d["q_base"] + d["q_hi"]] += 1
    np.testing.assert_array_equal(owner, 1)  # gaps included: every out row written once
    # row -> (task, offset) points back at the row
    t = a.row_task
    np.testing.assert_array_equal(tab[t, T.F["q_base"]] + a.row_off, np.arange(tq))
    # heaviest first
    assert (np.diff(tab[:, T.F["n_tiles"]]) <= 0).all()


def test_dense_causal_tiles_are_minimal():
  s = np.array([0]); ln = np.array([1024])
  tt = T.build_task_table(s, ln, s, ln, s * 0, s * 0, 1, tq=1024, tk=1024, block_q=128,
                          block_kv=128, causal=True)
  tab = tt.table[tt.table[:, T.F["q_hi"]] > tt.table[:, T.F["q_lo"]]]
  assert len(tab) == 8
  # each Q tile visits i+1 tiles, only the diagonal one masked
  for row in tab:
    d = dict(zip(T.FIELDS, row))
    i = d["q_base"] // 128
    assert (d["n_tiles"], d["full_lo"], d["full_hi"]) == (i + 1, 0, i)


def test_bad_launch_order_raises():
  z = np.zeros(1, np.int32)
  with pytest.raises(ValueError, match="launch_order"):
    T.build_task_table(z, z + 1, z, z + 1, z, z, 1, tq=128, tk=128, block_q=128, block_kv=64,
                       causal=True, launch_order="lpt")


def test_bad_shapes_raise():
  s = np.array([0]); ln = np.array([10])
  with pytest.raises(ValueError, match="tq"):
    T.build_task_table(s, ln, s, ln, s, s, 1, tq=64, tk=128, block_q=128, block_kv=128,
                       causal=True)
  with pytest.raises(ValueError, match="multiple of 8"):
    T.build_task_table(s, ln, s, ln, s, s, 1, tq=132, tk=128, block_q=128, block_kv=128,
                       causal=True)
  with pytest.raises(ValueError, match="tk"):
    T.build_task_table(s, ln, s, ln, s, s, 1, tq=128, tk=100, block_q=128, block_kv=128,
                       causal=True)
