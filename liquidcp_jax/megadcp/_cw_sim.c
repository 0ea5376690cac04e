/* The bulk critical-wave simulator (critical_wave._simulate_bulk_python, paper §5.2).
 *
 * K compute CTAs take attention task groups in queue order (a group: m equal tasks of cost c);
 * the per-CTA release times define the time map W -> t; reductions then run on the released
 * warps in queue order. Every floating-point operation is the reference's (st = max(free,
 * ready), e = st + c, the same time-map arithmetic), so scores agree bit for bit; only the
 * data structures differ. Results depend on the free times only as a multiset, which is what
 * both queues below hold (equal times merged, as the reference merges them when popping).
 */
#include "_cw_core.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

void *xcalloc(size_t n, size_t sz) { return calloc(n ? n : 1, sz); }

/* ------------------------------------------------------------------------------------------ */
/* Warp queue: min-heap of bins. Every entry holds >= 1 warp, so K * wpc entries suffice.      */

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

/* Dispatches m equal tasks (cost c, none starting before r) to the earliest-free warps;
 * returns the end of the last task dispatched, the latest.
 *
 * The reference's task-by-task loop with one shortcut: once every bin present at the start
 * has been popped, all free times lie in (f_max, f_max + c], so each further round of
 * `total` tasks gives every bin one task in increasing time order and adds c to every free
 * time. Those rounds are applied to the sorted bins directly (the same additions) while the
 * values keep max < min + c. */
static double heap_dispatch(Heap *h, i64 total, double c, i64 m, double r, Bin *scratch) {
    double e = 0.0, fmax = 0.0;
    int armed = m >= total && c > 0.0;
    if (armed) {
        fmax = h->has_held ? h->held.w : h->a[0].w;
        for (i64 i = 0; i < h->len; i++)
            if (h->a[i].w > fmax) fmax = h->a[i].w;
    }
    while (m) {
        Bin b;
        if (!h->has_held && h->a[0].n <= m && !(h->len > 1 && h->a[1].w == h->a[0].w)
            && !(h->len > 2 && h->a[2].w == h->a[0].w)) {
            /* The earliest bin is alone at its time and used up: replace it in place (one
             * sift instead of a pop and a push; the same multiset of free times). */
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
            if (b.n > a) { h->held.w = b.w; h->held.n = b.n - a; h->has_held = 1; }
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

/* ------------------------------------------------------------------------------------------ */
/* CTA queue: bins in strictly decreasing time, the earliest at a[len - 1].                    */

void queue_reset(Queue *q, i64 K) { q->a[0].w = 0.0; q->a[0].n = K; q->len = 1; }

/* Inserts (w, n), merging with an equal time. New ends usually land near the earliest end
 * (costs decrease along an LPT queue), so a short scan from there comes first. */
static inline void q_insert(Queue *q, double w, i64 n) {
    Bin *a = q->a;
    i64 len = q->len, p = len, lo = len > 8 ? len - 8 : 0;
    while (p > lo && a[p - 1].w < w) p--;
    if (p == lo && lo > 0 && a[p - 1].w < w) {  /* binary search in [0, lo) */
        i64 l = 0, h = lo - 1;  /* first index whose time is < w; a[h] < w */
        while (l < h) {
            i64 mid = (l + h) >> 1;
            if (a[mid].w < w) h = mid; else l = mid + 1;
        }
        p = l;
    }
    if (p > 0 && a[p - 1].w == w) { a[p - 1].n += n; return; }
    memmove(a + p + 1, a + p, (size_t)(len - p) * sizeof(Bin));
    a[p].w = w;
    a[p].n = n;
    q->len = len + 1;
}

/* Dispatches m tasks of cost c (attention: no ready time) to the earliest-free CTAs; returns
 * the end of the last one, the latest. `total`: CTAs in the queue (K). `run`: 2K + 2 bins,
 * `out`: K + 1 bins of scratch.
 *
 * Few tasks: pop the earliest bin, insert the end (a short move). Many tasks: the ends of
 * one group arrive in nondecreasing order (popped times never decrease, c is fixed), so
 * they are appended to a sorted run, popped against the old bins like a merge, and merged
 * back once (O(bins) per group instead of a move per task). When every old bin has been
 * popped, all times lie in (f_max, f_max + c]; a round of `total` tasks then gives each
 * bin one task in increasing order and adds c to every time, applied directly while
 * max < min + c (the additions the loop would do). */
double queue_dispatch(Queue *q, i64 total, double c, i64 m, Bin *run, Bin *out) {
    double e = 0.0;
    if (m < 8) {
        while (m) {
            Bin *b = &q->a[q->len - 1];
            double f = b->w;
            i64 n = b->n, take = n < m ? n : m;
            e = f + c;
            if (take == n) q->len--; else b->n = n - take;
            q_insert(q, e, take);
            m -= take;
        }
        return e;
    }
    Bin *a = q->a;
    i64 ol = q->len, rh = 0, rt = 0, cap = 2 * total + 2, hn = 0;
    double hw = 0.0;
    while (m) {
        if (!hn && !ol) {
            /* Every bin of the pass has been popped: run[rh, rt) holds all of them. */
            i64 nb = rt - rh;
            Bin *r = run + rh;
            while (m >= total && r[nb - 1].w < r[0].w + c) {
                for (i64 i = 0; i < nb; i++) r[i].w += c;
                m -= total;
                e = r[nb - 1].w;
            }
            for (i64 i = rt - 1; i >= rh; i--) {  /* the run becomes the old bins */
                if (ol && a[ol - 1].w == run[i].w) a[ol - 1].n += run[i].n;
                else a[ol++] = run[i];
            }
            rh = rt = 0;
            if (!m) break;
        }
        double f;
        i64 n;
        if (hn) { f = hw; n = hn; hn = 0; }
        else if (ol && (rh == rt || a[ol - 1].w <= run[rh].w)) { ol--; f = a[ol].w; n = a[ol].n; }
        else { f = run[rh].w; n = run[rh++].n; }
        while (ol && a[ol - 1].w == f) n += a[--ol].n;
        while (rh < rt && run[rh].w == f) n += run[rh++].n;
        i64 take = n < m ? n : m;
        e = f + c;  /* >= every end in the run: those came from earlier (smaller) pops */
        if (rt > rh && run[rt - 1].w == e) run[rt - 1].n += take;
        else {
            if (rt == cap) {  /* live bins <= total, so this frees >= total + 2 slots */
                memmove(run, run + rh, (size_t)(rt - rh) * sizeof(Bin));
                rt -= rh;
                rh = 0;
            }
            run[rt].w = e;
            run[rt++].n = take;
        }
        if (n > take) { hw = f; hn = n - take; }
        m -= take;
    }
    /* Merge old a[0, ol) (decreasing), run[rh, rt) (increasing) and the held bin (earliest). */
    i64 k = 0, i = 0, j = rt - 1;
    while (i < ol || j >= rh) {
        Bin b = (j < rh || (i < ol && a[i].w > run[j].w)) ? a[i++] : run[j--];
        if (k && out[k - 1].w == b.w) out[k - 1].n += b.n;
        else out[k++] = b;
    }
    if (hn) {
        if (k && out[k - 1].w == hw) out[k - 1].n += hn;
        else { out[k].w = hw; out[k++].n = hn; }
    }
    memcpy(a, out, (size_t)k * sizeof(Bin));
    q->len = k;
    return e;
}

/* ------------------------------------------------------------------------------------------ */
/* Workspace                                                                                    */

int work_init(Work *w, i64 S, i64 K, i64 wpc, i64 max_attn, i64 max_red) {
    memset(w, 0, sizeof(*w));
    w->S = S; w->K = K; w->wpc = wpc;
    w->acost = xcalloc(max_attn, sizeof(double));
    w->acount = xcalloc(max_attn, sizeof(i64));
    w->aseq = xcalloc(max_attn, sizeof(i64));
    w->gend = xcalloc(max_attn, sizeof(double));
    w->rseq = xcalloc(max_red, sizeof(i64));
    w->rcount = xcalloc(max_red, sizeof(i64));
    w->rcost = xcalloc(max_red, sizeof(double));
    w->q.a = xcalloc(K + 1, sizeof(Bin));
    w->warps.a = xcalloc(K * wpc + 1, sizeof(Bin));
    w->seq_w = xcalloc(S, sizeof(double));
    w->ready = xcalloc(S, sizeof(double));
    w->X = xcalloc(K + 2, sizeof(double));
    w->T = xcalloc(K + 2, sizeof(double));
    w->tau = xcalloc(K + 2, sizeof(double));
    w->tau_of = xcalloc(K + 1, sizeof(double));
    w->scratch = xcalloc(K * wpc + K + 2, sizeof(Bin));
    w->run = xcalloc(2 * K + 2, sizeof(Bin));
    return w->acost && w->acount && w->aseq && w->gend && w->rseq && w->rcount && w->rcost
        && w->q.a && w->warps.a && w->seq_w && w->ready && w->X && w->T && w->tau && w->tau_of
        && w->scratch && w->run;
}

void work_free(Work *w) {
    free(w->acost); free(w->acount); free(w->aseq); free(w->gend); free(w->rseq);
    free(w->rcount); free(w->rcost); free(w->q.a); free(w->warps.a); free(w->seq_w);
    free(w->ready); free(w->X); free(w->T); free(w->tau); free(w->tau_of); free(w->scratch); free(w->run);
}

/* Work time -> real time: t(W) = T[j] + tau[j] * (W - X[j]), j the largest with X[j] <= W
 * (X[0] = 0 <= W). Branch-free search: the lookups of one simulation are independent, so
 * the CPU overlaps them instead of mispredicting half the comparisons. */
static inline double tmap(const Work *w, i64 nx, double W) {
    const double *X = w->X;
    i64 base = 0, n = nx;
    while (n > 1) {
        i64 half = n >> 1;
        base = X[base + half] <= W ? base + half : base;
        n -= half;
    }
    return w->T[base] + w->tau[base] * (W - X[base]);
}

/* Attention phase of the bulk simulator: dispatches the groups, builds the time map and
 * maps each sequence's last group end to its ready time. Returns 0 when there is no
 * attention task (score = attn_end = 0, no sequence ready), -1 when it stopped early because
 * the score is certain to reach `thr` (then only *score >= thr is meaningful), else 1 (the
 * reductions are left to sim_reductions). `st` (optional): resume at a saved queue state
 * and/or record queue states (see SimStart). `red_cost(ctx, s)` (optional): the largest cost
 * of a reduction of sequence s, for the early stop below. */
int sim_attention(Work *w, const Params *p, double thr, const SimStart *st, RedCostFn red_cost,
                  void *ctx, double *score, double *attn_end) {
    i64 K = p->K, S = w->S, g = 0;
    Queue *q = &w->q;
    int any = 0;
    if (st && st->start) {
        memcpy(q->a, st->start->a, (size_t)st->start->len * sizeof(Bin));
        q->len = st->start->len;
        g = st->from;
        any = st->start_any;
    } else {
        queue_reset(q, K);
    }
    i64 every = st && st->snap ? st->snap_every : 0;
    for (; g < w->na; g++) {
        if (every && g % every == 0) {
            memcpy(st->snap + (g / every) * (K + 1), q->a, (size_t)q->len * sizeof(Bin));
            st->snap_len[g / every] = q->len;
        }
        i64 m = w->acount[g];
        if (!m) { w->gend[g] = -1.0; continue; }
        w->gend[g] = queue_dispatch(q, K, w->acost[g], m, w->run, w->scratch);
        any = 1;
    }
    if (every && g % every == 0) {
        memcpy(st->snap + (g / every) * (K + 1), q->a, (size_t)q->len * sizeof(Bin));
        st->snap_len[g / every] = q->len;
    }
    if (!any) {
        *score = *attn_end = 0.0;
        for (i64 s = 0; s < S; s++) w->ready[s] = NAN;
        return 0;
    }
    /* A sequence is ready when its latest group ends (a later, shorter split can end first). */
    double *seq_w = w->seq_w;
    for (i64 s = 0; s < S; s++) seq_w[s] = -1.0;
    for (i64 h = 0; h < w->na; h++) {
        i64 s = w->aseq[h];
        if (s < 0) continue;
        double e = w->gend[h], o = seq_w[s];
        seq_w[s] = e > o ? e : o;  /* branch-free: which group of a sequence ends last varies */
    }
    /* A CTA is busy from W = 0 until its last task ends (dispatch never idles while tasks are
     * queued), so k(W) = K - #CTAs released by W: the final bins, read from the earliest, are
     * the whole time map. */
    const Bin *rel = q->a;
    i64 nr = q->len, k = K, r0 = 0, nx = 1;
    w->X[0] = 0.0;
    w->T[0] = 0.0;
    if (rel[nr - 1].w == 0.0) { k -= rel[nr - 1].n; r0 = 1; }
    if (!w->tau_ok || w->tau_rho != p->rho) {  /* tau(k) = max(rho, k / K), tabulated */
        for (i64 j = 0; j <= K; j++) {
            double t = (double)j / (double)K;
            w->tau_of[j] = t < p->rho ? p->rho : t;
        }
        w->tau_ok = 1;
        w->tau_rho = p->rho;
    }
    /* The running X and T stay in registers (the arrays could alias for the compiler). */
    double x = 0.0, t = 0.0;
    const double *tau_of = w->tau_of;
    double *X = w->X, *T = w->T, *taus = w->tau;
    for (i64 i = r0; i < nr; i++) {
        const Bin *b = &rel[nr - 1 - i];
        double tau = tau_of[k], xn = b->w;
        taus[nx - 1] = tau;
        t = t + tau * (xn - x);
        x = xn;
        X[nx] = x;
        T[nx] = t;
        k -= b->n;
        nx++;
    }
    w->tau[nx - 1] = p->rho;  /* past the last release nothing runs; never used off a point */
    w->nx = nx;
    w->r0 = r0;
    double aend = w->T[nx - 1];
    *attn_end = *score = aend;
    if (aend >= thr) return -1;
    for (i64 s = 0; s < S; s++) w->ready[s] = -1.0;  /* -1: not mapped yet (ready >= 0) */
    if (red_cost && thr < INFINITY) {
        /* Every reduction starts no earlier than its inputs are ready (st = max(free, ready)),
         * so ready + cost bounds its end from below, in floating point too (rounding is
         * monotonic). In a decode step this bound usually decides: a candidate that cannot
         * win is rejected without building its reductions or simulating the warp queue.
         * Sequences are mapped lazily in queue order, which puts the longest (latest-ready)
         * ones of an LPT queue first, so most rejections map only a few. */
        for (i64 h = 0; h < w->na; h++) {
            i64 s = w->aseq[h];
            if (s < 0 || w->ready[s] >= 0.0) continue;
            double r = w->ready[s] = tmap(w, nx, w->seq_w[s]);
            double e = r + red_cost(ctx, s);
            if (e >= thr) { *score = e; return -1; }
        }
    }
    for (i64 s = 0; s < S; s++)
        if (w->ready[s] < 0.0) w->ready[s] = w->seq_w[s] >= 0.0 ? tmap(w, nx, w->seq_w[s]) : NAN;
    return 1;
}

/* Reduction phase: the warps of each CTA are free from its release on; reductions (w->rseq,
 * rcount, rcost, in queue order) start once a warp is free and their inputs are ready.
 * *score holds the attention end on entry; returns -1 on an early stop (as sim_attention),
 * else 1 with the score. */
int sim_reductions(Work *w, const Params *p, double thr, double *score) {
    double end = *score;
    if (!w->nr) return 1;
    const Bin *rel = w->q.a;
    i64 nr = w->q.len, r0 = w->r0, K = p->K;
    Heap *wb = &w->warps;
    heap_clear(wb);
    /* ascending release i is breakpoint X[i + 1 - r0] (X[0] = 0 when r0 = 1) */
    for (i64 i = 0; i < nr; i++) heap_push(wb, w->T[i + 1 - r0], rel[nr - 1 - i].n * p->wpc);
    i64 warps = K * p->wpc;
    for (i64 u = 0; u < w->nr; u++) {
        double e = heap_dispatch(wb, warps, w->rcost[u], w->rcount[u], w->ready[w->rseq[u]],
                                 w->scratch);
        if (e > end) {
            end = e;
            if (end >= thr) { *score = end; return -1; }
        }
    }
    *score = end;
    return 1;
}

int simulate(Work *w, const Params *p, double thr, const SimStart *st, double *score,
             double *attn_end) {
    int r = sim_attention(w, p, thr, st, NULL, NULL, score, attn_end);
    return r <= 0 ? r : sim_reductions(w, p, thr, score);
}

/* ------------------------------------------------------------------------------------------ */
/* Python's round(x, 9), needed bit for bit: the search compares rounded scores.               */

double round9(double x) {
    double y = x * 1e9;
    double fl = floor(y), fr = y - fl;
    /* Away from a half the rounding of the exact decimal value is that of y; q / 1e9 is then
     * the correctly rounded double of the decimal string, as float(repr) would give. */
    if (fabs(y) < 1e15 && fabs(fr - 0.5) > 1e-3) return (fr < 0.5 ? fl : fl + 1.0) / 1e9;
    char buf[64];
    snprintf(buf, sizeof buf, "%.9f", x);  /* glibc: exact decimal, round-half-even, as dtoa */
    return strtod(buf, NULL);
}
