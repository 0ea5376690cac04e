/* Python bindings of the compiled critical-wave planner (module _cw_native).
 *
 * The simulator lives in _cw_sim.c, the split search in _cw_search.c, the descriptor packer
 * in _dcp_pack.c (shared declarations: _cw_core.h). Exposed functions (called from Python only
 * through critical_wave / split_search / megadcp):
 *   simulate(attn, red, num_seqs, K, rho, wpc) -> (score, attn_end, ready)
 *   plan(tiles, qtiles, vectors, chunk_tiles, qblocks, limits, fa3, decode_only,
 *        K, rho, da, dr, gm, wpc, hq, M, P, fixed_run, merge_run, min_gain, fixed_splits,
 *        prune) -> tuple (see py_plan)
 *   pack(...) -> num_epochs (_dcp_pack.c)
 *   greedy(cost, ready, loads, assign, finish) -> None (_engine_sched.c)
 *   fa3_heuristic(...) -> int (FA3's num_splits_heuristic)
 *   step(...) -> plan, FA3 reference, limits, epochs, packed tables (_cw_step.c)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <string.h>

#include "_cw_core.h"

/* ------------------------------------------------------------------------------------------ */
/* Python bindings                                                                             */

i64 *parse_vec(PyObject *o, const char *name, i64 *n_out) {
    PyObject *f = PySequence_Fast(o, name);
    if (!f) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(f);
    i64 *v = xcalloc(n, sizeof(i64));
    if (!v) { Py_DECREF(f); PyErr_NoMemory(); return NULL; }
    for (Py_ssize_t i = 0; i < n; i++) {
        v[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(f, i));
        if (v[i] == -1 && PyErr_Occurred()) { Py_DECREF(f); free(v); return NULL; }
    }
    Py_DECREF(f);
    *n_out = n;
    return v;
}

PyObject *vec_tuple(const i64 *v, i64 n) {
    PyObject *t = PyTuple_New(n);
    if (!t) return NULL;
    for (i64 i = 0; i < n; i++) PyTuple_SET_ITEM(t, i, PyLong_FromLongLong(v[i]));
    return t;
}

static PyObject *py_simulate(PyObject *self, PyObject *args) {
    PyObject *attn, *red;
    long long S, K, wpc;
    double rho;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOLLdL", &attn, &red, &S, &K, &rho, &wpc)) return NULL;
    PyObject *fa = PySequence_Fast(attn, "attn"), *fr = NULL;
    if (!fa) return NULL;
    fr = PySequence_Fast(red, "red");
    if (!fr) { Py_DECREF(fa); return NULL; }
    i64 na = PySequence_Fast_GET_SIZE(fa), nr = PySequence_Fast_GET_SIZE(fr);
    Work w;
    PyObject *res = NULL;
    if (!work_init(&w, S, K, wpc, na, nr)) { PyErr_NoMemory(); goto done; }
    for (i64 g = 0; g < na; g++) {  /* (cost, count, seq, tiles) */
        PyObject *t = PySequence_Fast_GET_ITEM(fa, g);
        double cost; long long cnt, seq, tiles;
        if (!PyArg_ParseTuple(t, "dLLL", &cost, &cnt, &seq, &tiles)) goto done;
        w.acost[g] = cost; w.acount[g] = cnt; w.aseq[g] = seq;
    }
    w.na = na;
    for (i64 u = 0; u < nr; u++) {  /* (seq, count, cost, partials) */
        PyObject *t = PySequence_Fast_GET_ITEM(fr, u);
        double cost; long long cnt, seq, part;
        if (!PyArg_ParseTuple(t, "LLdL", &seq, &cnt, &cost, &part)) goto done;
        w.rseq[u] = seq; w.rcount[u] = cnt; w.rcost[u] = cost;
    }
    w.nr = nr;
    Params p = {K, wpc, rho, 0.0, 0.0, 0.0};
    double score, aend;
    simulate(&w, &p, INFINITY, NULL, &score, &aend);
    PyObject *ready = PyList_New(S);
    if (!ready) goto done;
    for (i64 s = 0; s < S; s++) {
        PyObject *x = isnan(w.ready[s]) ? (Py_INCREF(Py_None), Py_None) : PyFloat_FromDouble(w.ready[s]);
        PyList_SET_ITEM(ready, s, x);
    }
    res = Py_BuildValue("ddN", score, aend, ready);
done:
    work_free(&w);
    Py_DECREF(fa);
    Py_DECREF(fr);
    return res;
}

/* The tuple plan() returns (split_search._plan_native unpacks it). */
PyObject *plan_tuple(const PlanResult *r, i64 S) {
    PyObject *epochs;
    if (r->ch.lpt) {
        epochs = vec_tuple(r->epochs, S);
        if (!epochs) return NULL;
    } else {
        epochs = Py_None;
        Py_INCREF(epochs);
    }
    return Py_BuildValue("NNLLddLLsNddd", vec_tuple(r->chosen, S), vec_tuple(r->search, S),
                         (long long)r->iterations, (long long)r->evaluations, r->ch.key_score,
                         r->ch.attn_end, (long long)r->ch.ntasks, (long long)r->ch.run,
                         r->ch.lpt ? "lpt" : "fifo", epochs, r->nos.key_score, r->fa3.key_score,
                         r->srch.key_score);
}

static PyObject *py_plan(PyObject *self, PyObject *args) {
    PyObject *o_tiles, *o_qt, *o_vec, *o_chunk, *o_qb, *o_lim, *o_fa3, *o_fixed;
    int decode_only, prune;
    long long K, wpc, hq, M, P, fixed_run, merge_run;
    double rho, da, dr, gm, min_gain;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOOOOpLddddLLLLLLdOp", &o_tiles, &o_qt, &o_vec, &o_chunk, &o_qb,
                          &o_lim, &o_fa3, &decode_only, &K, &rho, &da, &dr, &gm, &wpc, &hq, &M,
                          &P, &fixed_run, &merge_run, &min_gain, &o_fixed, &prune))
        return NULL;
    i64 S = 0, n = 0, C = 0;
    i64 *tiles = NULL, *qt = NULL, *vec = NULL, *chunk = NULL, *qb = NULL, *lim = NULL;
    i64 *fa3 = NULL, *fixed = NULL, *chosen = NULL, *srch = NULL, *epochs = NULL;
    PyObject *res = NULL;
    if (!(tiles = parse_vec(o_tiles, "tiles", &S))) goto done;
    if (!(qt = parse_vec(o_qt, "qtiles", &n)) || n != S) goto bad;
    if (!(vec = parse_vec(o_vec, "vectors", &n)) || n != S) goto bad;
    if (!(chunk = parse_vec(o_chunk, "chunk", &C))) goto done;
    if (!(qb = parse_vec(o_qb, "qblocks", &n)) || n != S) goto bad;
    if (!(lim = parse_vec(o_lim, "limits", &n)) || n != S) goto bad;
    if (!(fa3 = parse_vec(o_fa3, "fa3", &n)) || n != S) goto bad;
    if (o_fixed != Py_None && (!(fixed = parse_vec(o_fixed, "fixed", &n)) || n != S)) goto bad;
    if (S < 1 || K < 1 || wpc < 1 || hq < 1 || M < 1 || P < 1 || merge_run < 1) goto bad;
    for (i64 i = 0; i < S; i++)
        if (tiles[i] < 0 || qt[i] < 1 || vec[i] < 1 || qb[i] < 0 || lim[i] < 1 || fa3[i] < 1
            || (fixed && fixed[i] < 1)) goto bad;
    for (i64 c = 0; c < C; c++)
        if (chunk[c] < 0) goto bad;
    chosen = xcalloc(S, sizeof(i64));
    srch = xcalloc(S, sizeof(i64));
    epochs = xcalloc(S, sizeof(i64));
    if (!chosen || !srch || !epochs) { PyErr_NoMemory(); goto done; }
    Params p = {K, wpc, rho, da, dr, gm};
    PlanResult r;
    memset(&r, 0, sizeof r);
    r.chosen = chosen; r.search = srch; r.epochs = epochs;
    if (!plan_core(S, tiles, qt, vec, chunk, C, qb, decode_only, p, hq, M, P, fixed_run, merge_run,
                   lim, fa3, fixed, prune, min_gain, &r)) { PyErr_NoMemory(); goto done; }
    res = plan_tuple(&r, S);
    goto done;
bad:
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "_cw_native.plan: inconsistent inputs");
done:
    free(tiles); free(qt); free(vec); free(chunk); free(qb); free(lim); free(fa3); free(fixed);
    free(chosen); free(srch); free(epochs);
    return res;
}

/* FA3's num_splits_heuristic (fa3.num_splits_heuristic, the reference): the same float32 and
 * float64 operations, for the per-step FA3 reference plan without NumPy's per-call overhead.
 *   fa3_heuristic(total_mblocks, num_sms, num_n_blocks, num_m_blocks, size_one_kv_head,
 *                 is_causal_or_local, max_splits) -> int */
long long fa3_heuristic_c(long long total, long long sms, long long nnb, long long nmb,
                          long long size, int causal, long long maxs) {
    const long long L2 = 50LL * 1024 * 1024;
    if ((float)total >= 0.8f * (float)sms) {
        if (size > L2 && nmb >= sms * 2 && !causal) {
            long long c = (size + L2 - 1) / L2;
            return c < maxs ? c : maxs;
        }
        return 1;
    }
    if (nnb <= 4) return 1;
    if (sms < maxs) maxs = sms;
    if (nnb < maxs) maxs = nnb;
    float max_eff = 0.0f;
    for (long long k = 1; k <= maxs; k++) {
        float nw = (float)(total * k) / (float)sms;
        float eff = nw / ceilf(nw);  /* 0 / 0 = NaN never wins, as in the C++ loop */
        if (eff > max_eff) max_eff = eff;
    }
    for (long long k = 1; k <= maxs; k++) {
        float nw = (float)(total * k) / (float)sms;
        float eff = nw / ceilf(nw);
        if ((double)eff >= 0.85 * (double)max_eff) return k;
    }
    return 1;
}

static PyObject *py_fa3_heuristic(PyObject *self, PyObject *args) {
    long long total, sms, nnb, nmb, size, maxs;
    int causal;
    (void)self;
    if (!PyArg_ParseTuple(args, "LLLLLpL", &total, &sms, &nnb, &nmb, &size, &causal, &maxs))
        return NULL;
    if (total < 0 || sms < 1 || nnb < 0 || nmb < 0 || maxs < 1) {
        PyErr_SetString(PyExc_ValueError, "fa3_heuristic: total_mblocks, num_n_blocks, "
                        "num_m_blocks must be >= 0 and num_sms, max_splits >= 1");
        return NULL;
    }
    return PyLong_FromLongLong(fa3_heuristic_c(total, sms, nnb, nmb, size, causal, maxs));
}

PyObject *dcp_pack(PyObject *self, PyObject *args);  /* _dcp_pack.c */
PyObject *dcp_step(PyObject *self, PyObject *args);  /* _cw_step.c */
PyObject *engine_greedy(PyObject *self, PyObject *args);  /* _engine_sched.c */

static PyMethodDef methods[] = {
    {"simulate", py_simulate, METH_VARARGS, "Bulk critical-wave simulation of a task-group workload."},
    {"pack", dcp_pack, METH_VARARGS, "MegaDCP descriptor packing (megadcp._pack_python)."},
    {"plan", py_plan, METH_VARARGS, "Critical-wave split search (split_search.plan_splits core)."},
    {"fa3_heuristic", py_fa3_heuristic, METH_VARARGS, "FA3 num_splits_heuristic (fa3.py)."},
    {"step", dcp_step, METH_VARARGS, "Plan and pack one decode step (megadcp.tables.build_descriptor_tables)."},
    {"greedy", engine_greedy, METH_VARARGS, "Greedy list scheduling (pallas.megadcp_engine_tables._greedy_python)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cw_native",
                                    "Compiled critical-wave simulator and split search.", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__cw_native(void) { return PyModule_Create(&module); }
