/* Greedy list scheduling for the MegaDCP GPU engine's static CTA assignment, compiled into
 * _cw_native (pallas.megadcp_engine_tables._greedy_python is the specification; tests assert
 * identical results). A mixed prefill+decode step has thousands of tasks: a Python heap loop
 * over them was most of the packing time.
 *
 *   greedy(cost, ready, loads, assign, finish) -> None
 * cost: float64[n]; ready: float64[n] or None; loads: float64[G] (in: each CTA's busy time,
 * out: after the tasks); assign: int64[n] and finish: float64[n] (out). Task i, in order, goes
 * to the CTA with the least (load, index); it starts at max(load, ready[i]) and ends cost[i] later.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct { double load; int64_t g; } slot_t;

static int less(slot_t a, slot_t b) { return a.load < b.load || (a.load == b.load && a.g < b.g); }

static void sift_down(slot_t *h, Py_ssize_t n, Py_ssize_t i) {
    for (;;) {
        Py_ssize_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && less(h[l], h[m])) m = l;
        if (r < n && less(h[r], h[m])) m = r;
        if (m == i) return;
        slot_t t = h[i]; h[i] = h[m]; h[m] = t;
        i = m;
    }
}

static int get_buf(PyObject *o, Py_buffer *b, const char *fmt, int writable, const char *name) {
    if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)))
        return -1;
    int fmt_ok = b->format != NULL && b->format[1] == 0 && b->itemsize == 8
                 && (b->format[0] == fmt[0] || (fmt[0] == 'l' && b->format[0] == 'q'));
    if (b->ndim != 1 || !fmt_ok) {
        PyErr_Format(PyExc_ValueError, "greedy: %s must be a 1-D C-contiguous '%s' array", name, fmt);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

PyObject *engine_greedy(PyObject *self, PyObject *args) {
    PyObject *oc, *orr, *ol, *oa, *of;
    Py_buffer c, r, l, a, f;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOO", &oc, &orr, &ol, &oa, &of)) return NULL;
    int has_ready = orr != Py_None, ok = 0;
    if (get_buf(oc, &c, "d", 0, "cost")) return NULL;
    if (has_ready && get_buf(orr, &r, "d", 0, "ready")) goto e0;
    if (get_buf(ol, &l, "d", 1, "loads")) goto e1;
    if (get_buf(oa, &a, "l", 1, "assign")) goto e2;
    if (get_buf(of, &f, "d", 1, "finish")) goto e3;
    Py_ssize_t n = c.shape[0], G = l.shape[0];
    if (G < 1 || a.shape[0] != n || f.shape[0] != n || (has_ready && r.shape[0] != n)) {
        PyErr_SetString(PyExc_ValueError, "greedy: loads must be non-empty and cost, ready, "
                        "assign, finish of one length");
        goto e4;
    }
    slot_t *h = malloc(G * sizeof(slot_t));
    if (!h) { PyErr_NoMemory(); goto e4; }
    const double *cost = c.buf, *ready = has_ready ? r.buf : NULL;
    double *loads = l.buf, *fin = f.buf;
    int64_t *asg = a.buf;
    for (Py_ssize_t g = 0; g < G; g++) { h[g].load = loads[g]; h[g].g = g; }
    for (Py_ssize_t i = G / 2 - 1; i >= 0; i--) sift_down(h, G, i);
    for (Py_ssize_t i = 0; i < n; i++) {   /* the root is the least (load, index) */
        double start = h[0].load;
        if (ready && ready[i] > start) start = ready[i];
        asg[i] = h[0].g;
        fin[i] = h[0].load = start + cost[i];
        sift_down(h, G, 0);
    }
    for (Py_ssize_t g = 0; g < G; g++) loads[h[g].g] = h[g].load;
    free(h);
    ok = 1;
e4: PyBuffer_Release(&f);
e3: PyBuffer_Release(&a);
e2: PyBuffer_Release(&l);
e1: if (has_ready) PyBuffer_Release(&r);
e0: PyBuffer_Release(&c);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}
