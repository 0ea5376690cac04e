/* Compiled critical-wave simulator and split search (paper §5.2, Appendix A.2).
 *
 * Mirrors, operation for operation, the pure-Python reference in critical_wave.py
 * (_simulate_bulk, release_aware_epochs, reduction_run_size, _workload) and split_search.py
 * (_Scorer.details and the search loop of plan_splits); tests assert both give the same
 * results. The Python code is the specification; this file only makes it fast (the planner
 * runs once per decode step and must take well under a millisecond).
 *
 * Exposed functions (called from Python only through critical_wave / split_search / megadcp):
 *   simulate(attn, red, num_seqs, K, rho, wpc) -> (score, attn_end, ready)
 *   plan(tiles, qtiles, vectors, chunk_tiles, qblocks, limits, fa3, decode_only,
 *        K, rho, da, dr, gm, wpc, hq, M, P, fixed_run, merge_run, min_gain, fixed_splits,
 *        prune) -> tuple (see py_plan)
 *   pack(...) -> num_epochs (_dcp_pack.c)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int64_t i64;

typedef struct { i64 K, wpc; double rho, da, dr, gm; } Params;

/* ------------------------------------------------------------------------------------------ */
/* Min-heap of (time, count) bins. Every entry holds >= 1 CTA or warp, so K (K * wpc) entries  */
/* always suffice.                                                                              */

typedef struct { double w; i64 n; } Bin;
/* `held`: the partly consumed earliest bin, kept out of the array (it is <= every entry), so
 * taking a few tasks from a large bin costs no sift. */
typedef struct { Bin *a; i64 len; Bin held; int has_held; } Heap;

static void heap_clear(Heap *h) { h->len = 0; h->has_held = 0; }

static void heap_push(Heap *h, double w, i64 n) {
    i64 i = h->len++;
    while (i > 0) {
        i64 p = (i - 1) >> 1;
        if (h->a[p].w <= w) break;
        h->a[i] = h->a[p];
        i = p;
    }
    h->a[i].w = w;
    h->a[i].n = n;
}

static Bin heap_pop_array(Heap *h) {
    Bin top = h->a[0];
    Bin last = h->a[--h->len];
    i64 i = 0, len = h->len;
    for (;;) {
        i64 c = 2 * i + 1;
        if (c >= len) break;
        if (c + 1 < len && h->a[c + 1].w < h->a[c].w) c++;
        if (h->a[c].w >= last.w) break;
        h->a[i] = h->a[c];
        i = c;
    }
    if (len) h->a[i] = last;
    return top;
}

/* Replaces the root (array top) by (w, n) and restores the heap order. */
static void heap_replace_top(Heap *h, double w, i64 n) {
    i64 i = 0, len = h->len;
    for (;;) {
        i64 c = 2 * i + 1;
        if (c >= len) break;
        if (c + 1 < len && h->a[c + 1].w < h->a[c].w) c++;
        if (h->a[c].w >= w) break;
        h->a[i] = h->a[c];
        i = c;
    }
    h->a[i].w = w;
    h->a[i].n = n;
}

static int heap_empty(const Heap *h) { return !h->len && !h->has_held; }

/* Pops the earliest bin and merges every bin free at the same instant into it. */
static Bin heap_pop_merged(Heap *h) {
    Bin b;
    if (h->has_held) { b = h->held; h->has_held = 0; }
    else b = heap_pop_array(h);
    while (h->len && h->a[0].w == b.w) b.n += heap_pop_array(h).n;
    return b;
}

/* Puts back the unused part of the bin just popped (still the earliest). */
static void heap_hold(Heap *h, double w, i64 n) { h->held.w = w; h->held.n = n; h->has_held = 1; }

/* ------------------------------------------------------------------------------------------ */
/* Workspace                                                                                    */

typedef struct {
    i64 S, K, wpc;
    /* task groups in queue order */
    double *acost; i64 *acount, *aseq; i64 na;
    i64 *rseq, *rcount; double *rcost; i64 nr;
    /* simulation scratch */
    Heap bins, warps;
    double *seq_w, *ready;   /* (S); seq_w < 0: no history task */
    double *X, *T, *tau;     /* (K + 1) time-map breakpoints */
    Bin *rel;                /* (K) */
    Bin *scratch;            /* (K * wpc) */
} Work;

static void *xcalloc(size_t n, size_t sz) { return calloc(n ? n : 1, sz); }

static int work_init(Work *w, i64 S, i64 K, i64 wpc, i64 max_attn, i64 max_red) {
    memset(w, 0, sizeof(*w));
    w->S = S; w->K = K; w->wpc = wpc;
    w->acost = xcalloc(max_attn, sizeof(double));
    w->acount = xcalloc(max_attn, sizeof(i64));
    w->aseq = xcalloc(max_attn, sizeof(i64));
    w->rseq = xcalloc(max_red, sizeof(i64));
    w->rcount = xcalloc(max_red, sizeof(i64));
    w->rcost = xcalloc(max_red, sizeof(double));
    w->bins.a = xcalloc(K + 1, sizeof(Bin));
    w->warps.a = xcalloc(K * wpc + 1, sizeof(Bin));
    w->seq_w = xcalloc(S, sizeof(double));
    w->ready = xcalloc(S, sizeof(double));
    w->X = xcalloc(K + 2, sizeof(double));
    w->T = xcalloc(K + 2, sizeof(double));
    w->tau = xcalloc(K + 2, sizeof(double));
    w->rel = xcalloc(K + 1, sizeof(Bin));
    w->scratch = xcalloc(K * wpc + 1, sizeof(Bin));
    return w->scratch && w->acost && w->acount && w->aseq && w->rseq && w->rcount && w->rcost && w->bins.a
        && w->warps.a && w->seq_w && w->ready && w->X && w->T && w->tau && w->rel;
}

static void work_free(Work *w) {
    free(w->acost); free(w->acount); free(w->aseq); free(w->rseq); free(w->rcount);
    free(w->rcost); free(w->bins.a); free(w->warps.a); free(w->seq_w); free(w->ready);
    free(w->X); free(w->T); free(w->tau); free(w->rel); free(w->scratch);
}

/* Work time -> real time: t(W) = T[j] + tau[j] * (W - X[j]) with X[j] <= W < X[j+1]. */
static double tmap(const Work *w, i64 nx, double W) {
    i64 lo = 0, hi = nx - 1;  /* largest j with X[j] <= W */
    while (lo < hi) {
        i64 mid = (lo + hi + 1) >> 1;
        if (w->X[mid] <= W) lo = mid; else hi = mid - 1;
    }
    return w->T[lo] + w->tau[lo] * (W - w->X[lo]);
}

/* Dispatches m equal tasks (cost c, none starting before r) to the earliest-free bins of h
 * (total CTAs or warps in h); returns the end of the last task dispatched, the latest.
 *
 * Exactly the task-by-task loop of the Python reference, with one shortcut: once every bin
 * present at the start has been popped, all free times lie in (f_max, f_max + c], so each
 * further round of `total` tasks gives every bin one task, in increasing time order, and
 * adds c to every free time. Those rounds are applied directly to the sorted bins (the same
 * additions the loop performs) while the float values keep max < min + c; a group of
 * thousands of query-tile tasks then costs O(bins) per round instead of O(bins log bins). */
static double dispatch(Heap *h, i64 total, double c, i64 m, double r, Bin *scratch) {
    double e = 0.0, fmax = 0.0;
    int armed = m >= total && c > 0.0;
    if (armed) {
        fmax = h->has_held ? h->held.w : h->a[0].w;
        for (i64 i = 0; i < h->len; i++)
            if (h->a[i].w > fmax) fmax = h->a[i].w;
    }
    while (m) {
        Bin b;
        if (!h->has_held && h->len && h->a[0].n <= m && !(h->len > 1 && h->a[1].w == h->a[0].w)
            && !(h->len > 2 && h->a[2].w == h->a[0].w)) {
            /* The earliest bin is alone at its time (both children are later, hence every
             * entry) and is used up: give its tasks' end in place, one sift instead of a pop
             * and a push. Same multiset of free times as the general path. */
            b = h->a[0];
            double st = b.w > r ? b.w : r;
            e = st + c;
            heap_replace_top(h, e, b.n);
            m -= b.n;
        } else {
            b = heap_pop_merged(h);
            double st = b.w > r ? b.w : r;
            i64 a = b.n < m ? b.n : m;
            e = st + c;
            heap_push(h, e, a);
            if (b.n > a) heap_hold(h, b.w, b.n - a);
            m -= a;
        }
        if (armed && b.w >= fmax) {
            armed = 0;
            if (m < total) continue;
            i64 nb = 0;
            while (!heap_empty(h)) scratch[nb++] = heap_pop_merged(h);  /* ascending, distinct */
            while (m >= total && scratch[nb - 1].w < scratch[0].w + c) {
                for (i64 i = 0; i < nb; i++) scratch[i].w += c;  /* every time > r: st = f */
                m -= total;
                e = scratch[nb - 1].w;
            }
            memcpy(h->a, scratch, nb * sizeof(Bin));  /* a sorted array is a valid heap */
            h->len = nb;
        }
    }
    return e;
}

/* Empties h into out in increasing W with equal W merged (what popping it would give);
 * returns the number of bins. An insertion sort of the heap array: a binary heap is nearly
 * level-ordered, so this moves few elements and beats popping every entry (the time map is
 * built once per simulated candidate). */
static i64 sorted_bins(Heap *h, Bin *out) {
    i64 n = 0;
    if (h->has_held) out[n++] = h->held;
    for (i64 i = 0; i < h->len; i++) {
        Bin b = h->a[i];
        i64 q = n++;
        while (q > 0 && out[q - 1].w > b.w) { out[q] = out[q - 1]; q--; }
        out[q] = b;
    }
    i64 m = 0;
    for (i64 i = 0; i < n; i++) {
        if (m && out[m - 1].w == out[i].w) out[m - 1].n += out[i].n;
        else out[m++] = out[i];
    }
    h->len = 0;
    h->has_held = 0;
    return m;
}

/* The bulk simulator (critical_wave._simulate_bulk). Returns 0 when there is no attention task
 * (score = attn_end = 0, no sequence ready), -1 when it stopped early because the score is
 * certain to reach `thr` (then only *score >= thr is meaningful), else 1. */
static int simulate(Work *w, const Params *p, double thr, const Heap *start, int start_any,
                    double *score, double *attn_end) {
    i64 K = p->K, S = w->S;
    Heap *bins = &w->bins;
    int any = 0;
    for (i64 s = 0; s < S; s++) w->seq_w[s] = -1.0;
    if (start) {  /* resume from a saved dispatch state (the chunk tasks, queued first) */
        memcpy(bins->a, start->a, start->len * sizeof(Bin));
        bins->len = start->len;
        bins->held = start->held;
        bins->has_held = start->has_held;
        any = start_any;
    } else {
        heap_clear(bins);
        heap_push(bins, 0.0, K);
    }
    for (i64 g = 0; g < w->na; g++) {
        i64 m = w->acount[g], seq = w->aseq[g];
        if (!m) continue;
        double e = dispatch(bins, K, w->acost[g], m, -INFINITY, w->scratch);
        any = 1;
        if (seq >= 0 && e > w->seq_w[seq]) w->seq_w[seq] = e;
    }
    if (!any) {
        *score = *attn_end = 0.0;
        for (i64 s = 0; s < S; s++) w->ready[s] = NAN;
        return 0;
    }
    /* A CTA is busy from W = 0 until its last task ends (dispatch never idles while tasks are
     * queued), so k(W) = K - #CTAs released by W: the final bins are the whole time map. */
    i64 nr = sorted_bins(bins, w->rel);
    i64 nx = 0, k = K;
    w->X[0] = 0.0;
    w->T[0] = 0.0;
    i64 r0 = 0;
    if (w->rel[0].w == 0.0) { k -= w->rel[0].n; r0 = 1; }
    nx = 1;
    for (i64 i = r0; i < nr; i++) {
        double tau = (double)k / (double)K;
        if (tau < p->rho) tau = p->rho;
        w->tau[nx - 1] = tau;
        w->X[nx] = w->rel[i].w;
        w->T[nx] = w->T[nx - 1] + tau * (w->X[nx] - w->X[nx - 1]);
        k -= w->rel[i].n;
        nx++;
    }
    w->tau[nx - 1] = p->rho;  /* past the last release nothing runs; never used off a point */
    double aend = w->T[nx - 1];
    *attn_end = aend;
    if (aend >= thr) { *score = aend; return -1; }
    for (i64 s = 0; s < S; s++)
        w->ready[s] = w->seq_w[s] >= 0.0 ? tmap(w, nx, w->seq_w[s]) : NAN;
    double end = aend;
    if (w->nr && thr < INFINITY) {
        /* Every reduction starts no earlier than its inputs are ready (st = max(free, ready)),
         * so ready + cost bounds its end from below, in floating point too (rounding is
         * monotonic). In a decode step this bound is usually the score itself: a candidate
         * that cannot win is then rejected without simulating the warp queue. */
        double lb = aend;
        for (i64 u = 0; u < w->nr; u++) {
            double e = w->ready[w->rseq[u]] + w->rcost[u];
            if (e > lb) lb = e;
        }
        if (lb >= thr) { *score = lb; return -1; }
    }
    if (w->nr) {
        Heap *wb = &w->warps;
        heap_clear(wb);
        /* rel[i] is breakpoint X[i + 1 - r0] (X[0] = 0 when r0 = 1): no search needed */
        for (i64 i = 0; i < nr; i++) heap_push(wb, w->T[i + 1 - r0], w->rel[i].n * p->wpc);
        i64 warps = K * p->wpc;
        for (i64 u = 0; u < w->nr; u++) {
            double e = dispatch(wb, warps, w->rcost[u], w->rcount[u], w->ready[w->rseq[u]],
                                w->scratch);
            if (e > end) {
                end = e;
                if (end >= thr) { *score = end; return -1; }
            }
        }
    }
    *score = end;
    return 1;
}

/* ------------------------------------------------------------------------------------------ */
/* Python's round(x, 9), needed bit for bit: the search compares rounded scores.               */

static double round9(double x) {
    double y = x * 1e9;
    double fl = floor(y), fr = y - fl;
    /* Away from a half the rounding of the exact decimal value is that of y; q / 1e9 is then
     * the correctly rounded double of the decimal string, as float(repr) would give. */
    if (fabs(y) < 1e15 && fabs(fr - 0.5) > 1e-3) return (fr < 0.5 ? fl : fl + 1.0) / 1e9;
    char buf[64];
    snprintf(buf, sizeof buf, "%.9f", x);  /* glibc: exact decimal, round-half-even, as dtoa */
    return strtod(buf, NULL);
}

/* ------------------------------------------------------------------------------------------ */
/* The scorer (split_search._Scorer.details)                                                    */

typedef struct {
    i64 S, C;
    const i64 *tiles, *qtiles, *vectors, *qblocks;
    int decode_only;
    Params p;
    i64 hq, per_epoch, fixed_run, merge_run;
    /* chunk groups (independent of the splits) */
    double *ccost; i64 *ccount; i64 nc;
    i64 ntasks_chunk;
    Heap chunk_state;  /* CTA bins after the chunk tasks: the same for every candidate plan */
    /* scratch */
    Work w;
    double *seqcost, *per; i64 *sidx, *epoch, *hidx, *last;
    double *hcost; i64 *hcount, *hseq; i64 nh;
    i64 evaluations;
    /* run_size tables: candidate runs (descending, distinct) and ceil(v_i / run) per sequence */
    i64 runs[5]; int nruns;
    i64 *run_tasks, *merge_tasks;  /* (S, 5), (S) */
    i64 *cs, *cq, *cr;  /* per sequence: splits last seen (0: none) and n / s, n % s */
} Scorer;

typedef struct {
    double key_score, key_attn, attn_end;  /* key_* rounded to 9 decimals */
    i64 ntasks, nsplits, run;
    int lpt, aborted;
} Detail;

/* Release-aware order of sequences: decreasing per-block cost, then index. */
static int seq_before(const Scorer *sc, i64 i, i64 j) {
    double x = sc->per[i], y = sc->per[j];
    return x > y || (x == y && i < j);
}

/* History groups: by epoch of the sequence's last block, then decreasing cost, then
 * sequence (a sequence's larger split comes first by cost). */
static int hist_before(const Scorer *sc, i64 g, i64 h) {
    i64 eg = sc->epoch[sc->hseq[g]], eh = sc->epoch[sc->hseq[h]];
    if (eg != eh) return eg < eh;
    double x = sc->hcost[g], y = sc->hcost[h];
    if (x != y) return x > y;
    return sc->hseq[g] < sc->hseq[h];
}

static int scorer_init(Scorer *sc, i64 S, const i64 *tiles, const i64 *qtiles, const i64 *vectors,
                       const i64 *chunk, i64 C, const i64 *qblocks, int decode_only, Params p,
                       i64 hq, i64 M, i64 P, i64 fixed_run, i64 merge_run, const i64 *limits) {
    memset(sc, 0, sizeof(*sc));
    sc->S = S; sc->C = C; sc->tiles = tiles; sc->qtiles = qtiles; sc->vectors = vectors;
    sc->qblocks = qblocks; sc->decode_only = decode_only; sc->p = p; sc->hq = hq;
    sc->per_epoch = M / P > 1 ? M / P : 1;
    sc->fixed_run = fixed_run; sc->merge_run = merge_run;
    sc->ccost = xcalloc(C, sizeof(double));
    sc->ccount = xcalloc(C, sizeof(i64));
    for (i64 c = 0; c < C; c++) {
        if (sc->nc && sc->ccost[sc->nc - 1] == (double)chunk[c] + p.da) sc->ccount[sc->nc - 1]++;
        else { sc->ccost[sc->nc] = (double)chunk[c] + p.da; sc->ccount[sc->nc++] = 1; }
    }
    sc->ntasks_chunk = C;
    /* Reduction groups: at most 2 per sequence. */
    if (!work_init(&sc->w, S, p.K, p.wpc, sc->nc + 2 * S, 2 * S)) return 0;
    sc->chunk_state.a = xcalloc(p.K + 1, sizeof(Bin));
    if (!sc->chunk_state.a) return 0;
    {
        Heap *bins = &sc->w.bins;
        heap_clear(bins);
        heap_push(bins, 0.0, p.K);
        for (i64 c = 0; c < sc->nc; c++)
            dispatch(bins, p.K, sc->ccost[c], sc->ccount[c], -INFINITY, sc->w.scratch);
        memcpy(sc->chunk_state.a, bins->a, bins->len * sizeof(Bin));
        sc->chunk_state.len = bins->len;
        sc->chunk_state.held = bins->held;
        sc->chunk_state.has_held = bins->has_held;
    }
    sc->seqcost = xcalloc(S, sizeof(double));
    sc->per = xcalloc(S, sizeof(double));
    sc->sidx = xcalloc(S, sizeof(i64));
    if (sc->sidx) for (i64 i = 0; i < S; i++) sc->sidx[i] = i;
    sc->epoch = xcalloc(S, sizeof(i64));
    sc->hidx = xcalloc(2 * S, sizeof(i64));
    sc->last = xcalloc(S, sizeof(i64));
    sc->hcost = xcalloc(2 * S, sizeof(double));
    sc->hcount = xcalloc(2 * S, sizeof(i64));
    sc->hseq = xcalloc(2 * S, sizeof(i64));
    (void)limits;
    {
        i64 cand[5] = {1, hq, 2 * hq, 4 * hq, 8 * hq < 32 ? 8 * hq : 32};
        for (int a = 0; a < 5; a++)  /* descending, duplicates dropped */
            for (int b = a + 1; b < 5; b++)
                if (cand[b] > cand[a]) { i64 t = cand[a]; cand[a] = cand[b]; cand[b] = t; }
        sc->nruns = 0;
        for (int c = 0; c < 5; c++)
            if (!sc->nruns || cand[c] != sc->runs[sc->nruns - 1]) sc->runs[sc->nruns++] = cand[c];
        sc->run_tasks = xcalloc(5 * S, sizeof(i64));
        sc->merge_tasks = xcalloc(S, sizeof(i64));
        sc->cs = xcalloc(S, sizeof(i64));
        sc->cq = xcalloc(S, sizeof(i64));
        sc->cr = xcalloc(S, sizeof(i64));
        if (!sc->run_tasks || !sc->merge_tasks || !sc->cs || !sc->cq || !sc->cr) return 0;
        for (i64 i = 0; i < S; i++) {
            for (int c = 0; c < sc->nruns; c++)
                sc->run_tasks[5 * i + c] = (vectors[i] + sc->runs[c] - 1) / sc->runs[c];
            sc->merge_tasks[i] = (vectors[i] + merge_run - 1) / merge_run;
        }
    }
    return sc->ccost && sc->ccount && sc->seqcost && sc->per && sc->sidx && sc->epoch
        && sc->hidx && sc->last && sc->hcost && sc->hcount && sc->hseq;
}

static void scorer_free(Scorer *sc) {
    free(sc->ccost); free(sc->ccount); free(sc->seqcost); free(sc->per); free(sc->sidx);
    free(sc->epoch); free(sc->hidx); free(sc->last); free(sc->hcost); free(sc->hcount);
    free(sc->hseq); free(sc->chunk_state.a); free(sc->run_tasks); free(sc->merge_tasks);
    free(sc->cs); free(sc->cq); free(sc->cr);
    work_free(&sc->w);
}

static i64 cdiv(i64 a, i64 b) { return (a + b - 1) / b; }  /* a >= 0, b >= 1 */

/* reduction_run_size: the largest run in {1, hq, 2hq, 4hq, min(8hq, 32)} leaving >= 0.8*12K
 * tasks. The per-sequence task counts ceil(v / run) are tabulated once (scorer_init): the
 * search calls this for every candidate, and 5 * S integer divisions per call cost more than
 * the rest of the bookkeeping. Sums are exact integers, so the result is unchanged. */
static i64 run_size(const Scorer *sc, const i64 *splits) {
    i64 tot[5] = {0, 0, 0, 0, 0}, merges = 0;
    for (i64 i = 0; i < sc->S; i++) {
        if (sc->tiles[i] <= 0) continue;
        if (splits[i] > 1) { merges += sc->merge_tasks[i]; continue; }
        const i64 *t = sc->run_tasks + 5 * i;
        tot[0] += t[0]; tot[1] += t[1]; tot[2] += t[2]; tot[3] += t[3]; tot[4] += t[4];
    }
    double target = 0.8 * (double)sc->p.wpc * (double)sc->p.K;
    for (int c = 0; c < sc->nruns; c++)
        if ((double)(tot[c] + merges) >= target) return sc->runs[c];
    return 1;
}

/* Scores `splits`; with a finite `thr` it may stop as soon as the score is certain to reach
 * thr (d->aborted; the key is then only a lower bound >= round9(thr)). */
static void details(Scorer *sc, const i64 *splits, Detail *d, double thr) {
    const Params *p = &sc->p;
    i64 S = sc->S;
    int split_any = 0;
    for (i64 i = 0; i < S; i++)
        if (sc->tiles[i] > 0 && splits[i] > 1) { split_any = 1; break; }
    int lpt = sc->decode_only && split_any;
    if (lpt) {  /* release_aware_epochs: blocks of one sequence are contiguous in the order */
        for (i64 i = 0; i < S; i++) {
            i64 n = sc->tiles[i];
            sc->seqcost[i] = n > 0 ? (double)sc->qtiles[i] * ((double)n + (double)splits[i] * p->da) : 0.0;
            i64 nb = sc->qblocks[i];
            sc->per[i] = nb > 0 ? sc->seqcost[i] / (double)nb : 0.0;
        }
        /* Insertion sort from the previous call's order: successive plans of the search differ
         * in one or two sequences, so this is near-linear (the order is a strict total order,
         * so the result equals a full sort's). */
        for (i64 r = 1; r < S; r++) {
            i64 i = sc->sidx[r], q = r;
            while (q > 0 && seq_before(sc, i, sc->sidx[q - 1])) { sc->sidx[q] = sc->sidx[q - 1]; q--; }
            sc->sidx[q] = i;
        }
        i64 start = 0;
        for (i64 r = 0; r < S; r++) {
            i64 i = sc->sidx[r], nb = sc->qblocks[i];
            sc->epoch[i] = nb > 0 ? (start + nb - 1) / sc->per_epoch : 0;
            start += nb;
        }
    }
    i64 run = sc->fixed_run > 0 ? sc->fixed_run : run_size(sc, splits);
    /* history groups, in sequence order (FIFO) or release-aware rank order (LPT) */
    sc->nh = 0;
    i64 ntasks = sc->ntasks_chunk, nsplits = 0;
    for (i64 r = 0; r < S; r++) {
        i64 i = lpt ? sc->sidx[r] : r;
        i64 n = sc->tiles[i], s = splits[i], qt = sc->qtiles[i];
        nsplits += s;
        if (n <= 0) continue;
        ntasks += qt * s;
        if (sc->cs[i] != s) {  /* candidates change one or two sequences: divide only those */
            sc->cs[i] = s; sc->cq[i] = n / s; sc->cr[i] = n % s;
        }
        i64 q = sc->cq[i], rr = sc->cr[i];
        if (rr) { sc->hcost[sc->nh] = (double)(q + 1) + p->da; sc->hcount[sc->nh] = rr * qt; sc->hseq[sc->nh++] = i; }
        if (s - rr) { sc->hcost[sc->nh] = (double)q + p->da; sc->hcount[sc->nh] = (s - rr) * qt; sc->hseq[sc->nh++] = i; }
    }
    for (i64 h = 0; h < sc->nh; h++) sc->hidx[h] = h;
    if (lpt) {  /* epochs are already nondecreasing: only groups within an epoch move */
        for (i64 k = 1; k < sc->nh; k++) {
            i64 g = sc->hidx[k], q = k;
            while (q > 0 && hist_before(sc, g, sc->hidx[q - 1])) { sc->hidx[q] = sc->hidx[q - 1]; q--; }
            sc->hidx[q] = g;
        }
    }
    Work *w = &sc->w;
    w->na = 0;  /* the chunk groups are already in sc->chunk_state */
    for (i64 k = 0; k < sc->nh; k++) {
        i64 h = sc->hidx[k];
        w->acost[w->na] = sc->hcost[h]; w->acount[w->na] = sc->hcount[h]; w->aseq[w->na++] = sc->hseq[h];
        sc->last[sc->hseq[h]] = k;
    }
    /* reductions: sequences in the order their last attention group is queued */
    w->nr = 0;
    for (i64 k = 0; k < sc->nh; k++) {
        i64 i = sc->hseq[sc->hidx[k]];
        if (sc->last[i] != k) continue;
        i64 s = splits[i], v = sc->vectors[i];
        i64 rn = s == 1 ? run : sc->merge_run, per = s == 1 ? 1 : s;
        i64 full = v / rn, rem = v % rn;
        if (full) { w->rseq[w->nr] = i; w->rcount[w->nr] = full; w->rcost[w->nr++] = p->dr + p->gm * (double)rn * (double)per; }
        if (rem) { w->rseq[w->nr] = i; w->rcount[w->nr] = 1; w->rcost[w->nr++] = p->dr + p->gm * (double)rem * (double)per; }
    }
    double score, aend;
    d->aborted = simulate(w, p, thr, &sc->chunk_state, sc->nc > 0, &score, &aend) < 0;
    sc->evaluations++;
    d->key_score = round9(score);
    d->key_attn = round9(aend);
    d->attn_end = aend;
    d->ntasks = ntasks;
    d->nsplits = nsplits;
    d->run = run;
    d->lpt = lpt;
}

/* Lexicographic key comparison (score, attention end, tasks, splits). */
static int key_cmp(const Detail *a, const Detail *b) {
    if (a->key_score != b->key_score) return a->key_score < b->key_score ? -1 : 1;
    if (a->key_attn != b->key_attn) return a->key_attn < b->key_attn ? -1 : 1;
    if (a->ntasks != b->ntasks) return a->ntasks < b->ntasks ? -1 : 1;
    if (a->nsplits != b->nsplits) return a->nsplits < b->nsplits ? -1 : 1;
    return 0;
}

static int vec_cmp(const i64 *a, const i64 *b, i64 S) {
    for (i64 i = 0; i < S; i++)
        if (a[i] != b[i]) return a[i] < b[i] ? -1 : 1;
    return 0;
}

typedef struct { double b; i64 idx; } Cand;  /* idx: sequence, or S for the joint candidate */

static int cmp_cand(const void *a, const void *b) {
    const Cand *x = a, *y = b;
    if (x->b != y->b) return x->b < y->b ? -1 : 1;
    return (x->idx > y->idx) - (x->idx < y->idx);
}

/* ------------------------------------------------------------------------------------------ */
/* The search (split_search._search_python)                                                    */

typedef struct {
    i64 *chosen, *search;
    Detail ch, nos, fa3, srch;
    i64 iterations;
} PlanOut;

/* Lower bound slack: a candidate is skipped only when its bound clears the threshold by more
 * than rounding noise, so skipping never changes which candidate wins (see split_search). */
static int bound_clears(double b, double thr) { return b - 1e-7 * (b > 1.0 ? b : 1.0) >= thr; }

static int run_search(Scorer *sc, const i64 *limits, int prune, PlanOut *out, Cand *cands,
                      double *seq_lb, int *tied, double *cur_ready, double *best_ready) {
    const Params *p = &sc->p;
    i64 S = sc->S;
    i64 *cur = out->search;
    for (i64 i = 0; i < S; i++) cur[i] = 1;
    Detail cur_d, d, best_d;
    details(sc, cur, &cur_d, INFINITY);
    out->nos = cur_d;
    memcpy(cur_ready, sc->w.ready, S * sizeof(double));
    double chunk_work = 0.0;
    for (i64 c = 0; c < sc->nc; c++) chunk_work += sc->ccost[c] * (double)sc->ccount[c];
    /* The last attention task may be a chunk task, whose end feeds no reduction. */
    double tail_red = sc->C ? 0.0 : p->dr + p->gm;
    i64 iterations = 0;
    for (;;) {
        iterations++;
        double work = chunk_work, top1 = 0.0, top2 = 0.0;
        for (i64 i = 0; i < S; i++) {
            i64 n = sc->tiles[i], s = cur[i];
            if (n > 0) {
                seq_lb[i] = p->rho * ((double)cdiv(n, s) + p->da) + p->dr + p->gm * (double)s;
                work += (double)sc->qtiles[i] * ((double)n + (double)s * p->da);
            } else {
                seq_lb[i] = 0.0;
            }
            if (seq_lb[i] > top1) { top2 = top1; top1 = seq_lb[i]; }
            else if (seq_lb[i] > top2) top2 = seq_lb[i];
        }
        i64 nc = 0;
        for (i64 j = 0; j < S; j++) {
            i64 n = sc->tiles[j];
            if (n <= 0 || cur[j] >= limits[j]) continue;
            double b = 0.0;
            if (prune) {
                i64 s1 = cur[j] + 1;
                double new_lb = p->rho * ((double)cdiv(n, s1) + p->da) + p->dr + p->gm * (double)s1;
                double rest = seq_lb[j] >= top1 ? top2 : top1;
                double wl = (work + (double)sc->qtiles[j] * p->da) / (double)p->K + tail_red;
                b = new_lb > rest ? new_lb : rest;
                if (wl > b) b = wl;
            }
            cands[nc].b = b; cands[nc++].idx = j;
        }
        /* Joint +1 on the sequences tied at the attention tail. */
        i64 ntied = 0;
        double tol = 1e-9 * (cur_d.attn_end > 1.0 ? cur_d.attn_end : 1.0);
        for (i64 i = 0; i < S; i++) {
            double r = cur_ready[i];
            tied[i] = sc->tiles[i] > 0 && !isnan(r) && fabs(r - cur_d.attn_end) <= tol
                      && cur[i] < limits[i];
            ntied += tied[i];
        }
        if (ntied >= 2) { cands[nc].b = 0.0; cands[nc++].idx = S; }
        qsort(cands, nc, sizeof(Cand), cmp_cand);
        double cur_score = cur_d.key_score;
        i64 best = -1;
        for (i64 c = 0; c < nc; c++) {
            double b = cands[c].b;
            i64 j = cands[c].idx;
            if (prune && (bound_clears(b, cur_score) ||
                          (best >= 0 && b - 1e-7 * (b > 1.0 ? b : 1.0) > best_d.key_score)))
                continue;
            if (j < S) cur[j]++;
            else for (i64 i = 0; i < S; i++) cur[i] += tied[i];
            /* Stop simulating once the candidate surely cannot win: a score >= cur_score
             * rounds to >= cur_score (itself rounded), and one past best + 1e-6 rounds above
             * best's. */
            double thr = INFINITY;
            if (prune) {
                thr = cur_score;
                if (best >= 0) {
                    double tb = best_d.key_score + 1e-6 * (best_d.key_score > 1.0 ? best_d.key_score : 1.0);
                    if (tb < thr) thr = tb;
                }
            }
            details(sc, cur, &d, thr);
            if (j < S) cur[j]--;
            else for (i64 i = 0; i < S; i++) cur[i] -= tied[i];
            if (!d.aborted && d.key_score < cur_score) {
                int c2 = best < 0 ? -1 : key_cmp(&d, &best_d);
                if (best < 0 || c2 < 0 || (c2 == 0 && j < best)) {
                    best = j;
                    best_d = d;
                    memcpy(best_ready, sc->w.ready, S * sizeof(double));
                }
            }
        }
        if (best < 0) break;
        if (best < S) cur[best]++;
        else for (i64 i = 0; i < S; i++) cur[i] += tied[i];
        cur_d = best_d;
        memcpy(cur_ready, best_ready, S * sizeof(double));
    }
    out->srch = cur_d;
    out->iterations = iterations;
    return 1;
}

/* ------------------------------------------------------------------------------------------ */
/* Python bindings                                                                             */

static i64 *parse_vec(PyObject *o, const char *name, i64 *n_out) {
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

static PyObject *vec_tuple(const i64 *v, i64 n) {
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
    simulate(&w, &p, INFINITY, NULL, 0, &score, &aend);
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
    i64 *fa3 = NULL, *fixed = NULL, *ones = NULL, *chosen = NULL, *srch = NULL;
    Cand *cands = NULL;
    double *seq_lb = NULL, *cur_ready = NULL, *best_ready = NULL;
    int *tied = NULL;
    Scorer sc;
    int sc_ok = 0;
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
        if (tiles[i] < 0 || qt[i] < 1 || vec[i] < 1 || lim[i] < 1 || fa3[i] < 1
            || (fixed && fixed[i] < 1)) goto bad;
    Params p = {K, wpc, rho, da, dr, gm};
    if (!scorer_init(&sc, S, tiles, qt, vec, chunk, C, qb, decode_only, p, hq, M, P, fixed_run,
                     merge_run, lim)) { scorer_free(&sc); PyErr_NoMemory(); goto done; }
    sc_ok = 1;
    ones = xcalloc(S, sizeof(i64));
    chosen = xcalloc(S, sizeof(i64));
    srch = xcalloc(S, sizeof(i64));
    cands = xcalloc(S + 1, sizeof(Cand));
    seq_lb = xcalloc(S, sizeof(double));
    cur_ready = xcalloc(S, sizeof(double));
    best_ready = xcalloc(S, sizeof(double));
    tied = xcalloc(S, sizeof(int));
    if (!ones || !chosen || !srch || !cands || !seq_lb || !cur_ready || !best_ready || !tied) {
        PyErr_NoMemory();
        goto done;
    }
    for (i64 i = 0; i < S; i++) ones[i] = 1;
    PlanOut out;
    memset(&out, 0, sizeof out);
    out.search = srch;
    Detail fa3_d, ch;
    if (fixed) {
        details(&sc, ones, &out.nos, INFINITY);
        details(&sc, fa3, &fa3_d, INFINITY);
        memcpy(srch, fixed, S * sizeof(i64));
        memcpy(chosen, fixed, S * sizeof(i64));
        details(&sc, fixed, &out.srch, INFINITY);
        out.iterations = 0;
    } else {
        run_search(&sc, lim, prune, &out, cands, seq_lb, tied, cur_ready, best_ready);
        if (!vec_cmp(fa3, ones, S)) fa3_d = out.nos;
        else if (!vec_cmp(fa3, srch, S)) fa3_d = out.srch;
        else details(&sc, fa3, &fa3_d, INFINITY);
        /* best of NoSplit, search, FA3 by (key, splits) as Python's sorted() of the pool */
        const i64 *pv[3] = {ones, srch, fa3};
        const Detail *pd[3] = {&out.nos, &out.srch, &fa3_d};
        int b = 0;
        for (int c = 1; c < 3; c++) {
            int k = key_cmp(pd[c], pd[b]);
            if (k < 0 || (k == 0 && vec_cmp(pv[c], pv[b], S) < 0)) b = c;
        }
        const i64 *cv = pv[b];
        if (vec_cmp(cv, ones, S) && pd[b]->key_score > (1.0 - min_gain) * out.nos.key_score) cv = ones;
        memcpy(chosen, cv, S * sizeof(i64));
    }
    i64 evals = sc.evaluations;
    details(&sc, chosen, &ch, INFINITY);  /* leaves the chosen plan's epochs in sc.epoch */
    PyObject *epochs;
    if (ch.lpt) {
        epochs = vec_tuple(sc.epoch, S);
        if (!epochs) goto done;
    } else {
        epochs = Py_None;
        Py_INCREF(epochs);
    }
    res = Py_BuildValue("NNLLddLLsNddd", vec_tuple(chosen, S), vec_tuple(srch, S),
                        (long long)out.iterations, (long long)evals, ch.key_score, ch.attn_end,
                        (long long)ch.ntasks, (long long)ch.run, ch.lpt ? "lpt" : "fifo", epochs,
                        out.nos.key_score, fa3_d.key_score, out.srch.key_score);
    goto done;
bad:
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "_cw_native.plan: inconsistent inputs");
done:
    if (sc_ok) scorer_free(&sc);
    free(tiles); free(qt); free(vec); free(chunk); free(qb); free(lim); free(fa3); free(fixed);
    free(ones); free(chosen); free(srch); free(cands); free(seq_lb); free(cur_ready);
    free(best_ready); free(tied);
    return res;
}

/* FA3's num_splits_heuristic (fa3.num_splits_heuristic, the reference): the same float32 and
 * float64 operations, for the per-step FA3 reference plan without NumPy's per-call overhead.
 *   fa3_heuristic(total_mblocks, num_sms, num_n_blocks, num_m_blocks, size_one_kv_head,
 *                 is_causal_or_local, max_splits) -> int */
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
    const long long L2 = 50LL * 1024 * 1024;
    if ((float)total >= 0.8f * (float)sms) {
        if (size > L2 && nmb >= sms * 2 && !causal) {
            long long c = (size + L2 - 1) / L2;
            return PyLong_FromLongLong(c < maxs ? c : maxs);
        }
        return PyLong_FromLong(1);
    }
    if (nnb <= 4) return PyLong_FromLong(1);
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
        if ((double)eff >= 0.85 * (double)max_eff) return PyLong_FromLongLong(k);
    }
    return PyLong_FromLong(1);
}

PyObject *dcp_pack(PyObject *self, PyObject *args);  /* _dcp_pack.c */

static PyMethodDef methods[] = {
    {"simulate", py_simulate, METH_VARARGS, "Bulk critical-wave simulation of a task-group workload."},
    {"pack", dcp_pack, METH_VARARGS, "MegaDCP descriptor packing (megadcp._pack_python)."},
    {"plan", py_plan, METH_VARARGS, "Critical-wave split search (split_search.plan_splits core)."},
    {"fa3_heuristic", py_fa3_heuristic, METH_VARARGS, "FA3 num_splits_heuristic (fa3.py)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cw_native",
                                    "Compiled critical-wave simulator and split search.", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__cw_native(void) { return PyModule_Create(&module); }
