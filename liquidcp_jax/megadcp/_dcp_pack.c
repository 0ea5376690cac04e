/* MegaDCP descriptor packing (megadcp.tables.build_descriptor_tables), compiled into _cw_native.
 *
 * Mirrors megadcp._pack_python row for row (tests assert identical tables): the NumPy version
 * is the specification; this one avoids ~100 array passes over tens of thousands of rows
 * (a prefill chunk alone has thousands of query tiles and reduction runs).
 *
 *   pack(qlen, tiles0, splits, local, P, H, qtt, cqt, tile, lpt, epochs, copy_run, merge_run,
 *        per_epoch, delta_attn, alloc) -> num_epochs
 * computes the row counts, calls alloc((C, T, U, I, F, B)) for a tuple of 27 zeroed, C-contiguous
 * int32 arrays (megadcp._PACK_FIELDS order; hist_kv_start / hist_kv_end are (P, T_cap)) and
 * fills their first rows.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int64_t i64;

#define NFIELDS 27

static i64 *pk_vec(PyObject *o, i64 *n) {
    PyObject *f = PySequence_Fast(o, "expected a sequence of ints");
    if (!f) return NULL;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(f);
    i64 *v = calloc(m ? m : 1, sizeof(i64));
    if (!v) { Py_DECREF(f); PyErr_NoMemory(); return NULL; }
    for (Py_ssize_t i = 0; i < m; i++) {
        v[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(f, i));
        if (v[i] == -1 && PyErr_Occurred()) { free(v); Py_DECREF(f); return NULL; }
    }
    Py_DECREF(f);
    *n = m;
    return v;
}

static i64 pk_cdiv(i64 a, i64 b) { return (a + b - 1) / b; }

/* A run of history tasks with one request and one split size: enumeration indices
 * [e0, e0 + cnt), sorted (LPT) by (epoch, -size, e0). */
typedef struct { i64 ep, size, e0, cnt, req; } HGroup;

static int cmp_hgroup(const void *a, const void *b) {
    const HGroup *x = a, *y = b;
    if (x->ep != y->ep) return x->ep < y->ep ? -1 : 1;
    if (x->size != y->size) return x->size > y->size ? -1 : 1;
    return (x->e0 > y->e0) - (x->e0 < y->e0);
}

typedef struct { double key; i64 i; } KeyIdx;  /* ascending key, then index */

static int cmp_keyidx(const void *a, const void *b) {
    const KeyIdx *x = a, *y = b;
    if (x->key != y->key) return x->key < y->key ? -1 : 1;
    return (x->i > y->i) - (x->i < y->i);
}

PyObject *pack_core(const i64 *q, const i64 *t0, const i64 *s, const i64 *local, const i64 *ep,
                    i64 S, i64 P, i64 H, i64 qtt, i64 cqt, i64 tile, int lpt, i64 copy_run,
                    i64 merge_run, i64 per_epoch, double da, PyObject *alloc, i64 *num_epochs);

PyObject *dcp_pack(PyObject *self, PyObject *args) {
    PyObject *o_q, *o_t0, *o_s, *o_local, *o_ep, *alloc;
    long long P, H, qtt, cqt, tile, copy_run, merge_run, per_epoch;
    int lpt;
    double da;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOLLLLLpOLLLdO", &o_q, &o_t0, &o_s, &o_local, &P, &H, &qtt, &cqt,
                          &tile, &lpt, &o_ep, &copy_run, &merge_run, &per_epoch, &da, &alloc))
        return NULL;
    i64 S = 0, n = 0, num_epochs = 0;
    i64 *q = NULL, *t0 = NULL, *s = NULL, *local = NULL, *ep = NULL;
    PyObject *arrays = NULL, *res = NULL;
    if (!(q = pk_vec(o_q, &S))) goto done;
    if (!(t0 = pk_vec(o_t0, &n)) || n != S) goto bad;
    if (!(s = pk_vec(o_s, &n)) || n != S) goto bad;
    if (!(local = pk_vec(o_local, &n)) || n != P * S) goto bad;
    if (lpt && (!(ep = pk_vec(o_ep, &n)) || n != S)) goto bad;
    arrays = pack_core(q, t0, s, local, ep, S, P, H, qtt, cqt, tile, lpt, copy_run, merge_run,
                       per_epoch, da, alloc, &num_epochs);
    if (arrays) res = PyLong_FromLongLong(num_epochs);
    goto done;
bad:
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "_cw_native.pack: inconsistent inputs");
done:
    Py_XDECREF(arrays);
    free(q); free(t0); free(s); free(local); free(ep);
    return res;
}

/* The packing itself: calls alloc((C, T, U, I, F, B)) for a tuple of >= 27 zeroed int32
 * arrays (the first 27 in megadcp._PACK_FIELDS order) and fills them. Returns that tuple
 * (new reference) with *num_epochs, or NULL with an exception set. */
PyObject *pack_core(const i64 *q, const i64 *t0, const i64 *s, const i64 *local, const i64 *ep,
                    i64 S, i64 P, i64 H, i64 qtt, i64 cqt, i64 tile, int lpt, i64 copy_run,
                    i64 merge_run, i64 per_epoch, double da, PyObject *alloc, i64 *num_epochs) {
    i64 *qt = NULL, *first = NULL, *pos = NULL, *last = NULL;
    HGroup *hg = NULL;
    KeyIdx *ki = NULL;
    PyObject *arrays = NULL, *res = NULL;
    Py_buffer buf[NFIELDS];
    int nbuf = 0;
    if (S < 0 || P < 1 || H < 1 || qtt < 1 || cqt < 1 || tile < 1 || copy_run < 1 || merge_run < 1
        || per_epoch < 1) goto bad;
    qt = calloc(S + 1, sizeof(i64));
    first = calloc(S + 1, sizeof(i64));
    last = calloc(S + 1, sizeof(i64));
    hg = calloc(2 * S + 1, sizeof(HGroup));
    ki = calloc(S + 1, sizeof(KeyIdx));
    if (!qt || !first || !last || !hg || !ki) { PyErr_NoMemory(); goto done; }
    /* ---- counts ---- */
    i64 C = 0, T = 0, U = 0, F = 0;
    for (i64 i = 0; i < S; i++) {
        if (q[i] < 1 || t0[i] < 0 || s[i] < 0) goto bad;
        C += pk_cdiv(q[i], cqt);
        qt[i] = pk_cdiv(q[i], qtt);
        first[i] = T;
        T += s[i] * qt[i];
        F += pk_cdiv(q[i], 16);
        if (s[i] > 0) {
            i64 run = s[i] == 1 ? copy_run : merge_run;
            for (i64 k = 0; k < qt[i]; k++) {
                i64 qs = k * qtt, qe = qs + qtt < q[i] ? qs + qtt : q[i];
                U += pk_cdiv((qe - qs) * H, run);
            }
        }
    }
    pos = calloc(T + 1, sizeof(i64));
    if (!pos) { PyErr_NoMemory(); goto done; }
    arrays = PyObject_CallFunction(alloc, "((LLLLLL))", (long long)C, (long long)T, (long long)U,
                                   (long long)T, (long long)F, (long long)F);
    if (!arrays) goto done;
    if (!PyTuple_Check(arrays) || PyTuple_GET_SIZE(arrays) < NFIELDS) goto bad;
    int32_t *A[NFIELDS];
    i64 cap[NFIELDS];
    for (int f = 0; f < NFIELDS; f++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(arrays, f), &buf[f],
                               PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) goto done;
        nbuf++;
        if (buf[f].itemsize != 4) goto bad;
        A[f] = buf[f].buf;
        cap[f] = buf[f].len / 4;
    }
    i64 Tcap = cap[5];
    if (cap[0] < C || Tcap < T || cap[10] != P * Tcap || cap[11] != P * Tcap || cap[12] < U
        || cap[19] < T || cap[20] < F || cap[23] < F) goto bad;
    /* ---- chunk attention: request order ---- */
    i64 row = 0;
    for (i64 i = 0; i < S; i++)
        for (i64 k = 0; k * cqt < q[i]; k++, row++) {
            i64 qs = k * cqt, qe = qs + cqt < q[i] ? qs + cqt : q[i];
            A[0][row] = (int32_t)i; A[1][row] = (int32_t)qs; A[2][row] = (int32_t)qe;
            A[3][row] = (int32_t)qe; A[4][row] = (int32_t)pk_cdiv(qe, tile);
        }
    /* ---- history attention: groups of equal split size, enumeration order within ---- */
    i64 ng = 0;
    for (i64 i = 0; i < S; i++) {
        if (s[i] <= 0) continue;
        i64 base = t0[i] / s[i], rem = t0[i] % s[i];
        if (rem) hg[ng++] = (HGroup){lpt ? ep[i] : 0, base + 1, first[i], rem * qt[i], i};
        if (s[i] - rem) hg[ng++] = (HGroup){lpt ? ep[i] : 0, base, first[i] + rem * qt[i],
                                            (s[i] - rem) * qt[i], i};
    }
    if (lpt) qsort(hg, ng, sizeof(HGroup), cmp_hgroup);
    row = 0;
    for (i64 g = 0; g < ng; g++) {
        i64 i = hg[g].req, base = t0[i] / s[i], rem = t0[i] % s[i];
        for (i64 e = hg[g].e0; e < hg[g].e0 + hg[g].cnt; e++, row++) {
            i64 u = e - first[i], j = u / qt[i], k = u % qt[i];
            i64 size = base + (j < rem), tst = j * base + (j < rem ? j : rem);
            i64 qs = k * qtt, qe = qs + qtt < q[i] ? qs + qtt : q[i];
            A[5][row] = (int32_t)i; A[6][row] = (int32_t)j; A[7][row] = (int32_t)qs;
            A[8][row] = (int32_t)qe; A[9][row] = (int32_t)size;
            for (i64 r = 0; r < P; r++) {
                i64 L = local[r * S + i], a = tst * tile, b = (tst + size) * tile;
                A[10][r * Tcap + row] = (int32_t)(a < L ? a : L);
                A[11][r * Tcap + row] = (int32_t)(b < L ? b : L);
            }
            pos[e] = row;
            last[i] = row;  /* rows are written in queue order: the final write is the max */
        }
    }
    /* ---- history reductions: requests by their last queued task, then query tile ---- */
    i64 nr = 0;
    for (i64 i = 0; i < S; i++)
        if (s[i] > 0) { ki[nr].key = (double)last[i]; ki[nr++].i = i; }
    qsort(ki, nr, sizeof(KeyIdx), cmp_keyidx);
    i64 urow = 0, irow = 0;
    for (i64 x = 0; x < nr; x++) {
        i64 i = ki[x].i, run = s[i] == 1 ? copy_run : merge_run;
        for (i64 k = 0; k < qt[i]; k++) {
            i64 qs = k * qtt, qe = qs + qtt < q[i] ? qs + qtt : q[i], nv = (qe - qs) * H;
            i64 in0 = irow;
            for (i64 j = 0; j < s[i]; j++) A[19][irow++] = (int32_t)pos[first[i] + j * qt[i] + k];
            for (i64 v = 0; v < nv; v += run, urow++) {
                A[12][urow] = (int32_t)i; A[13][urow] = (int32_t)qs; A[14][urow] = (int32_t)qe;
                A[15][urow] = (int32_t)v; A[16][urow] = (int32_t)(nv - v < run ? nv - v : run);
                A[17][urow] = (int32_t)in0; A[18][urow] = (int32_t)s[i];
            }
        }
    }
    /* ---- final reductions (request order) and transfer blocks ---- */
    row = 0;
    for (i64 i = 0; i < S; i++)
        for (i64 b = 0; b * 16 < q[i]; b++, row++) {
            A[20][row] = (int32_t)i; A[21][row] = (int32_t)(b * 16);
            A[22][row] = (int32_t)(b * 16 + 16 < q[i] ? b * 16 + 16 : q[i]);
        }
    if (lpt) {  /* release_aware_epochs: decreasing per-block cost, stable */
        for (i64 i = 0; i < S; i++) {
            double cost = t0[i] > 0 ? (double)qt[i] * ((double)t0[i] + (double)s[i] * da) : 0.0;
            i64 nb = pk_cdiv(q[i], 16);
            ki[i].key = -(nb > 0 ? cost / (double)nb : 0.0);
            ki[i].i = i;
        }
        qsort(ki, S, sizeof(KeyIdx), cmp_keyidx);
    } else {
        for (i64 i = 0; i < S; i++) ki[i].i = i;
    }
    row = 0;
    for (i64 x = 0; x < S; x++) {
        i64 i = ki[x].i;
        for (i64 b = 0; b * 16 < q[i]; b++, row++) {
            A[23][row] = (int32_t)i; A[24][row] = (int32_t)(b * 16);
            A[25][row] = (int32_t)(b * 16 + 16 < q[i] ? b * 16 + 16 : q[i]);
            A[26][row] = (int32_t)(row / per_epoch);
        }
    }
    *num_epochs = F ? (F - 1) / per_epoch + 1 : 0;
    res = arrays;
    arrays = NULL;
    goto done;
bad:
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "_cw_native.pack: inconsistent inputs");
done:
    for (int f = 0; f < nbuf; f++) PyBuffer_Release(&buf[f]);
    Py_XDECREF(arrays);
    free(qt); free(first); free(pos); free(last); free(hg); free(ki);
    return res;
}
