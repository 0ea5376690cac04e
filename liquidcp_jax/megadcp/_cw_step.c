/* One compiled call for a MegaDCP decode step: megadcp.tables.build_descriptor_tables' default path.
 *
 * The planner runs once per decode step and must take well under a millisecond; at P = 2
 * the Python around the compiled search and packer (per-rank shard lengths, chunk tiles,
 * FA3's reference plan in NumPy, split limits, list conversions, request-table padding) cost
 * about a fifth of that. This file does those steps in C, exactly as the Python code does
 * them (megadcp.tables.build_descriptor_tables, split_search._select / _fa3_reference, fa3.py),
 * then runs the search (plan_core) and the packer (pack_core). Tests compare its tables and
 * plan with the Python path's (engine="python") and with the separate compiled calls.
 *
 *   step(hist, qlen, P, hq, tile, rows_per_tile, M, merge_run, K, rho, da, dr, gm, wpc,
 *        decode_max_query, min_decode_limit, min_gain, alloc)
 *     -> (plan tuple as plan() returns it, fa3 splits, limits, num_epochs)
 * alloc((C, T, U, I, F, B)) returns the 27 packer arrays followed by req_history, req_query,
 * req_query_offset, req_splits ((R_cap,) each) and req_local_len ((P, R_cap)), all zeroed
 * int32; the request arrays are filled here.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <string.h>

#include "_cw_core.h"

PyObject *vec_tuple(const i64 *v, i64 n);
i64 *parse_vec(PyObject *o, const char *name, i64 *n_out);  /* _cw_native.c */
PyObject *plan_tuple(const PlanResult *r, i64 S);
PyObject *pack_core(const i64 *q, const i64 *t0, const i64 *s, const i64 *local, const i64 *ep,
                    i64 S, i64 P, i64 H, i64 qtt, i64 cqt, i64 tile, int lpt, i64 copy_run,
                    i64 merge_run, i64 per_epoch, double da, PyObject *alloc, i64 *num_epochs);
long long fa3_heuristic_c(long long total, long long sms, long long nnb, long long nmb,
                          long long size, int causal, long long maxs);

static i64 cdiv(i64 a, i64 b) { return (a + b - 1) / b; }  /* a >= 0, b >= 1 */

/* split_search._fa3_reference with history_tokens = rank 0's shard: FA3's static count
 * (fa3.fa3_static_num_splits: hdim 128, one KV head, non-causal, varlen, <= 128 splits),
 * then prepare_varlen_num_blocks' per-sequence split (fa3.fa3_dynamic_splits, float32 as the
 * CUDA code), capped at one tile per split. */
static void fa3_reference(i64 S, const i64 *tiles, const i64 *q, const i64 *toks, i64 heads,
                          i64 num_sms, i64 block_m, i64 block_n, i64 *out) {
    i64 maxq = 0, maxk = 0;
    for (i64 i = 0; i < S; i++) {
        if (q[i] > maxq) maxq = q[i];
        if (toks[i] > maxk) maxk = toks[i];
    }
    i64 nmb = cdiv(maxq * heads, block_m), nnb = cdiv(maxk, block_n);
    i64 size = maxk * (128 + 128) * 2;
    i64 total_mblocks = (S <= 992 ? 1 : S) * nmb;  /* PREPARE_VARLEN_MAX_BATCHES */
    i64 st = fa3_heuristic_c(total_mblocks, num_sms, nnb, nmb, size, 0, 128);
    if (st <= 1) {
        for (i64 i = 0; i < S; i++) out[i] = 1;
        return;
    }
    i64 total_blocks = 0;
    for (i64 i = 0; i < S; i++) total_blocks += cdiv(q[i] * heads, block_m) * cdiv(toks[i], block_n);
    float f = (float)total_blocks * 1.1f;
    f = f * (float)1;
    i64 bps = (i64)ceilf(f / (float)num_sms);
    for (i64 i = 0; i < S; i++) {
        i64 s = bps > 0 ? cdiv(cdiv(toks[i], block_n), bps) : 1;
        if (s < 1) s = 1;
        if (s > st) s = st;
        if (s > tiles[i]) s = tiles[i];  /* max(1, min(dyn, tiles)) */
        out[i] = s < 1 ? 1 : s;
    }
}

/* Writes v (n values) into the int32 array `arr` (capacity >= n; rows past n stay zero). */
static int fill_i32(PyObject *arr, const i64 *v, i64 n, i64 stride_rows, i64 nrows) {
    Py_buffer b;
    if (PyObject_GetBuffer(arr, &b, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return 0;
    int ok = b.itemsize == 4 && b.len / 4 >= (nrows - 1) * stride_rows + n;
    if (ok) {
        int32_t *d = b.buf;
        for (i64 r = 0; r < nrows; r++)
            for (i64 i = 0; i < n; i++) d[r * stride_rows + i] = (int32_t)v[r * n + i];
    } else {
        PyErr_SetString(PyExc_ValueError, "_cw_native.step: request array too small");
    }
    PyBuffer_Release(&b);
    return ok;
}

PyObject *dcp_step(PyObject *self, PyObject *args) {
    PyObject *o_hist, *o_q, *alloc;
    long long P, hq, tile, rpt, M, merge_run, K, wpc, dmq, mdl;
    double rho, da, dr, gm, min_gain;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOLLLLLLLddddLLLdO", &o_hist, &o_q, &P, &hq, &tile, &rpt, &M,
                          &merge_run, &K, &rho, &da, &dr, &gm, &wpc, &dmq, &mdl, &min_gain, &alloc))
        return NULL;
    i64 S = 0, n = 0, C = 0;
    i64 *hist = NULL, *q = NULL, *local = NULL, *tiles = NULL, *chunk = NULL, *vec = NULL;
    i64 *qt = NULL, *qb = NULL, *fa3 = NULL, *lim = NULL, *chosen = NULL, *srch = NULL;
    i64 *epochs = NULL, *s = NULL, *qoff = NULL;
    PyObject *arrays = NULL, *res = NULL;
    if (!(hist = parse_vec(o_hist, "history", &S))) goto done;
    if (!(q = parse_vec(o_q, "query", &n)) || n != S) goto bad;
    if (S < 1 || P < 1 || hq < 1 || tile < 1 || rpt < 1 || M < 1 || merge_run < 1 || K < 1
        || wpc < 1 || mdl < 1) goto bad;
    for (i64 i = 0; i < S; i++)
        if (hist[i] < 0 || q[i] < 1) goto bad;
    i64 H = P * hq, qtt = rpt / H > 1 ? rpt / H : 1, cqt = rpt / hq > 1 ? rpt / hq : 1;
    local = xcalloc(P * S, sizeof(i64));
    tiles = xcalloc(S, sizeof(i64));
    vec = xcalloc(S, sizeof(i64));
    qt = xcalloc(S, sizeof(i64));
    qb = xcalloc(S, sizeof(i64));
    fa3 = xcalloc(S, sizeof(i64));
    lim = xcalloc(S, sizeof(i64));
    chosen = xcalloc(S, sizeof(i64));
    srch = xcalloc(S, sizeof(i64));
    epochs = xcalloc(S, sizeof(i64));
    s = xcalloc(S, sizeof(i64));
    qoff = xcalloc(S, sizeof(i64));
    if (!local || !tiles || !vec || !qt || !qb || !fa3 || !lim || !chosen || !srch || !epochs
        || !s || !qoff) { PyErr_NoMemory(); goto done; }
    /* megadcp.local_history_lengths (token t on rank t % P), rank 0's tiles, chunk tasks */
    int decode_only = 1;
    for (i64 i = 0; i < S; i++) {
        for (i64 r = 0; r < P; r++) local[r * S + i] = hist[i] > r ? cdiv(hist[i] - r, P) : 0;
        tiles[i] = cdiv(local[i], tile);
        C += cdiv(q[i], cqt);
        vec[i] = q[i] * H;
        qt[i] = cdiv(q[i], qtt);
        qb[i] = cdiv(q[i], 16);  /* QUERY_BLOCK */
        decode_only &= q[i] <= dmq;
        qoff[i] = i ? qoff[i - 1] + q[i - 1] : 0;
    }
    chunk = xcalloc(C, sizeof(i64));
    if (!chunk) { PyErr_NoMemory(); goto done; }
    for (i64 i = 0, c = 0; i < S; i++)
        for (i64 k = 0; k * cqt < q[i]; k++) {
            i64 qe = k * cqt + cqt < q[i] ? k * cqt + cqt : q[i];
            chunk[c++] = cdiv(qe, tile);
        }
    fa3_reference(S, tiles, q, local, H, K, rpt, tile, fa3);
    for (i64 i = 0; i < S; i++) {  /* split_search._select's limits */
        i64 l = q[i] <= dmq && tiles[i] >= K && fa3[i] < mdl ? mdl : fa3[i];
        if (l > tiles[i]) l = tiles[i];
        lim[i] = l < 1 ? 1 : l;
    }
    Params p = {K, wpc, rho, da, dr, gm};
    PlanResult r;
    memset(&r, 0, sizeof r);
    r.chosen = chosen; r.search = srch; r.epochs = epochs;
    if (!plan_core(S, tiles, qt, vec, chunk, C, qb, decode_only, p, hq, M, P, -1, merge_run, lim,
                   fa3, NULL, 1, min_gain, &r)) { PyErr_NoMemory(); goto done; }
    for (i64 i = 0; i < S; i++) s[i] = tiles[i] > 0 ? chosen[i] : 0;  /* no history, no tasks */
    i64 num_epochs = 0;
    arrays = pack_core(q, tiles, s, local, r.ch.lpt ? epochs : NULL, S, P, H, qtt, cqt, tile,
                       r.ch.lpt, r.ch.run, merge_run, M / P > 1 ? M / P : 1, da, alloc,
                       &num_epochs);
    if (!arrays) goto done;
    if (PyTuple_GET_SIZE(arrays) != 32) goto bad;
    Py_buffer rb;  /* request capacity from req_history */
    if (PyObject_GetBuffer(PyTuple_GET_ITEM(arrays, 27), &rb, PyBUF_SIMPLE) < 0) goto done;
    i64 rcap = rb.len / 4;
    PyBuffer_Release(&rb);
    if (!fill_i32(PyTuple_GET_ITEM(arrays, 27), hist, S, rcap, 1)
        || !fill_i32(PyTuple_GET_ITEM(arrays, 28), q, S, rcap, 1)
        || !fill_i32(PyTuple_GET_ITEM(arrays, 29), qoff, S, rcap, 1)
        || !fill_i32(PyTuple_GET_ITEM(arrays, 30), chosen, S, rcap, 1)
        || !fill_i32(PyTuple_GET_ITEM(arrays, 31), local, S, rcap, P)) goto done;
    res = Py_BuildValue("NNNL", plan_tuple(&r, S), vec_tuple(fa3, S), vec_tuple(lim, S),
                        (long long)num_epochs);
    goto done;
bad:
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "_cw_native.step: inconsistent inputs");
done:
    Py_XDECREF(arrays);
    free(hist); free(q); free(local); free(tiles); free(chunk); free(vec); free(qt); free(qb);
    free(fa3); free(lim); free(chosen); free(srch); free(epochs); free(s); free(qoff);
    return res;
}
