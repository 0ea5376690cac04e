/* The compiled split search (split_search._Scorer.details and _search_python, paper §5.2).
 *
 * Mirrors the Python reference operation for operation (release_aware_epochs,
 * reduction_run_size, _workload, the search loop); tests assert the same plans. Two things
 * make it fast without changing any result:
 *   - pruning (split_search's module docstring): candidates whose proven lower bound cannot
 *     win are skipped, and a simulation stops once its partial score shows it cannot win;
 *   - resuming: a candidate differs from the incumbent in one or a few sequences, so its
 *     attention queue equals the incumbent's up to the first changed group. The dispatch
 *     state there is the incumbent's, saved every SNAP_EVERY groups when the incumbent was
 *     simulated; the candidate's simulation starts from the last saved state at or before
 *     its first changed group (same data, same operations: the same floats).
 */
#include "_cw_core.h"

#include <math.h>
#include <string.h>

/* Queue snapshots of the incumbent: every 4th group. Each copy is <= K + 1 bins and the
 * incumbent is re-recorded once per search iteration, while a candidate replays at most
 * 3 groups more than needed. */
#define SNAP_EVERY 4

static i64 cdiv(i64 a, i64 b) { return (a + b - 1) / b; }  /* a >= 0, b >= 1 */

/* Release-aware order of sequences: decreasing per-block cost, then index. */
static int seq_before(const Scorer *sc, i64 i, i64 j) {
    double x = sc->per[i], y = sc->per[j];
    return x > y || (x == y && i < j);
}

int scorer_init(Scorer *sc, i64 S, const i64 *tiles, const i64 *qtiles, const i64 *vectors,
                const i64 *chunk, i64 C, const i64 *qblocks, int decode_only, Params p, i64 hq,
                i64 M, i64 P, i64 fixed_run, i64 merge_run) {
    memset(sc, 0, sizeof(*sc));
    sc->S = S; sc->C = C; sc->tiles = tiles; sc->qtiles = qtiles; sc->vectors = vectors;
    sc->qblocks = qblocks; sc->decode_only = decode_only; sc->p = p; sc->hq = hq;
    sc->per_epoch = M / P > 1 ? M / P : 1;
    sc->fixed_run = fixed_run; sc->merge_run = merge_run;
    sc->ccost = xcalloc(C, sizeof(double));
    sc->ccount = xcalloc(C, sizeof(i64));
    if (!sc->ccost || !sc->ccount) return 0;
    for (i64 c = 0; c < C; c++) {
        if (sc->nc && sc->ccost[sc->nc - 1] == (double)chunk[c] + p.da) sc->ccount[sc->nc - 1]++;
        else { sc->ccost[sc->nc] = (double)chunk[c] + p.da; sc->ccount[sc->nc++] = 1; }
    }
    sc->ntasks_chunk = C;
    /* History groups: at most 2 per sequence (split sizes q + 1 and q); so are reductions. */
    if (!work_init(&sc->w, S, p.K, p.wpc, 2 * S, 2 * S)) return 0;
    sc->chunk_state.a = xcalloc(p.K + 1, sizeof(Bin));
    if (!sc->chunk_state.a) return 0;
    Queue *q = &sc->w.q;
    queue_reset(q, p.K);
    for (i64 c = 0; c < sc->nc; c++)
        queue_dispatch(q, p.K, sc->ccost[c], sc->ccount[c], sc->w.run, sc->w.scratch);
    memcpy(sc->chunk_state.a, q->a, (size_t)q->len * sizeof(Bin));
    sc->chunk_state.len = q->len;
    sc->seqcost = xcalloc(S, sizeof(double));
    sc->per = xcalloc(S, sizeof(double));
    sc->sidx = xcalloc(S, sizeof(i64));
    sc->epoch = xcalloc(S, sizeof(i64));
    sc->last = xcalloc(S, sizeof(i64));
    sc->chg = xcalloc(S, sizeof(i64));
    sc->mark = xcalloc(S, sizeof(char));
    sc->rstart = xcalloc(S, sizeof(i64));
    if (!sc->seqcost || !sc->per || !sc->sidx || !sc->epoch || !sc->last || !sc->chg || !sc->mark
        || !sc->rstart) return 0;
    for (i64 i = 0; i < S; i++) sc->sidx[i] = i;
    /* Epoch of a block position (position / per_epoch), tabulated: the LPT order (decode-only
     * batches) needs one per sequence and candidate, and a division costs more than the rest. */
    i64 blocks = 0;
    for (i64 i = 0; i < S; i++) blocks += decode_only ? qblocks[i] : 0;
    sc->epoch_of = xcalloc(blocks, sizeof(i64));
    if (!sc->epoch_of) return 0;
    for (i64 b = 0, e = 0, r = 0; b < blocks; b++) {
        sc->epoch_of[b] = e;
        if (++r == sc->per_epoch) { r = 0; e++; }
    }
    i64 cand[5] = {1, hq, 2 * hq, 4 * hq, 8 * hq < 32 ? 8 * hq : 32};
    for (int a = 0; a < 5; a++)  /* descending, duplicates dropped */
        for (int b = a + 1; b < 5; b++)
            if (cand[b] > cand[a]) { i64 t = cand[a]; cand[a] = cand[b]; cand[b] = t; }
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
    sc->snap_every = SNAP_EVERY;
    return 1;  /* the incumbent's buffers are allocated by its first recording */
}

/* Buffers of the incumbent (groups, ends, queue snapshots); 0 on no memory. Allocated only
 * when a search has candidates to simulate (most P = 8 steps have none). */
static int incumbent_alloc(Scorer *sc) {
    if (sc->snap) return 1;
    i64 S = sc->S, nsnap = 2 * S / SNAP_EVERY + 2;
    sc->inc_acost = xcalloc(2 * S, sizeof(double));
    sc->inc_gend = xcalloc(2 * S, sizeof(double));
    sc->inc_acount = xcalloc(2 * S, sizeof(i64));
    sc->inc_aseq = xcalloc(2 * S, sizeof(i64));
    sc->snap_len = xcalloc(nsnap, sizeof(i64));
    if (!sc->inc_acost || !sc->inc_gend || !sc->inc_acount || !sc->inc_aseq || !sc->snap_len)
        return 0;
    sc->snap = malloc((size_t)nsnap * (size_t)(sc->p.K + 1) * sizeof(Bin));  /* written before read */
    return sc->snap != NULL;
}

void scorer_free(Scorer *sc) {
    free(sc->ccost); free(sc->ccount); free(sc->seqcost); free(sc->per); free(sc->sidx);
    free(sc->epoch); free(sc->last); free(sc->chg); free(sc->mark); free(sc->rstart);
    free(sc->chunk_state.a); free(sc->run_tasks); free(sc->merge_tasks);
    free(sc->cs); free(sc->cq); free(sc->cr); free(sc->epoch_of); free(sc->inc_acost);
    free(sc->inc_gend); free(sc->inc_acount); free(sc->inc_aseq); free(sc->snap);
    free(sc->snap_len);
    work_free(&sc->w);
}

/* reduction_run_size: the largest run in {1, hq, 2hq, 4hq, min(8hq, 32)} leaving >= 0.8*12K
 * tasks. The task counts ceil(v_i / run) are tabulated per sequence (scorer_init) and summed
 * incrementally as split counts change (exact integer sums: the same result). */
static i64 run_size(const Scorer *sc) {
    double target = 0.8 * (double)sc->p.wpc * (double)sc->p.K;
    for (int c = 0; c < sc->nruns; c++)
        if ((double)(sc->copy_tot[c] + sc->merge_tot) >= target) return sc->runs[c];
    return 1;
}

/* Adds (sign +1) or removes (-1) sequence i with s splits from the plan totals. */
static void seq_totals(Scorer *sc, i64 i, i64 s, i64 sign) {
    if (s < 1) return;  /* not seen yet */
    sc->nsplits += sign * s;
    if (sc->tiles[i] <= 0) return;
    sc->ntasks_hist += sign * s * sc->qtiles[i];
    if (s > 1) {
        sc->merge_tot += sign * sc->merge_tasks[i];
        sc->split_seqs += sign;
    } else {
        for (int c = 0; c < 5; c++) sc->copy_tot[c] += sign * sc->run_tasks[5 * i + c];
    }
}

/* Queue order of history groups: LPT (epoch of the sequence's last block, then decreasing
 * cost, then sequence) or FIFO (sequence, then decreasing cost: the larger split first). */
static int group_before(const Scorer *sc, int lpt, double c1, i64 s1, double c2, i64 s2) {
    if (lpt) {
        i64 e1 = sc->epoch[s1], e2 = sc->epoch[s2];
        if (e1 != e2) return e1 < e2;
        if (c1 != c2) return c1 > c2;
        return s1 < s2;
    }
    if (s1 != s2) return s1 < s2;
    return c1 > c2;
}

/* Inserts sequence i's groups (split sizes q + 1 and q) into the sorted queue w->a*. */
static void insert_groups(Scorer *sc, int lpt, i64 i) {
    Work *w = &sc->w;
    i64 q = sc->cq[i], rr = sc->cr[i], s = sc->cs[i], qt = sc->qtiles[i];
    double cost[2] = {(double)(q + 1) + sc->p.da, (double)q + sc->p.da};
    i64 cnt[2] = {rr * qt, (s - rr) * qt};
    for (int k = 0; k < 2; k++) {
        if (!cnt[k]) continue;
        i64 lo = 0, hi = w->na;  /* first group the new one goes before */
        while (lo < hi) {
            i64 mid = (lo + hi) >> 1;
            if (group_before(sc, lpt, cost[k], i, w->acost[mid], w->aseq[mid])) hi = mid;
            else lo = mid + 1;
        }
        size_t mv = (size_t)(w->na - lo);
        memmove(w->acost + lo + 1, w->acost + lo, mv * sizeof(double));
        memmove(w->acount + lo + 1, w->acount + lo, mv * sizeof(i64));
        memmove(w->aseq + lo + 1, w->aseq + lo, mv * sizeof(i64));
        w->acost[lo] = cost[k];
        w->acount[lo] = cnt[k];
        w->aseq[lo] = i;
        w->na++;
    }
}

static i64 rank_of(const Scorer *sc, i64 i) {
    i64 r = 0;
    while (sc->sidx[r] != i) r++;
    return r;
}

/* Brings the queue (sc->sidx order, epochs, the history groups in w->a*) from the previous
 * call's plan to this one's. `nd` sequences changed their split count (sc->chg). The result
 * is exactly the full rebuild's: the orders are strict total orders. */
static void update_order(Scorer *sc, int lpt, i64 nd) {
    i64 S = sc->S;
    Work *w = &sc->w;
    i64 *chg = sc->chg, ne = nd;
    if (!sc->ord_valid || lpt != sc->ord_lpt || nd > 8) {
        /* Full rebuild. Insertion sort from the previous order (near-linear: plans of the
         * search differ in a few sequences). */
        if (lpt) {
            for (i64 r = 1; r < S; r++) {
                i64 i = sc->sidx[r], q = r;
                while (q > 0 && seq_before(sc, i, sc->sidx[q - 1])) { sc->sidx[q] = sc->sidx[q - 1]; q--; }
                sc->sidx[q] = i;
            }
            i64 start = 0;
            for (i64 r = 0; r < S; r++) {
                i64 i = sc->sidx[r], nb = sc->qblocks[i];
                sc->rstart[r] = start;
                sc->epoch[i] = nb > 0 ? sc->epoch_of[start + nb - 1] : 0;
                start += nb;
            }
        }
        w->na = 0;
        for (i64 r = 0; r < S; r++) {  /* in rank (LPT) or sequence (FIFO) order */
            i64 i = lpt ? sc->sidx[r] : r;
            if (sc->tiles[i] <= 0) continue;
            i64 q = sc->cq[i], rr = sc->cr[i], s = sc->cs[i], qt = sc->qtiles[i];
            if (rr) {
                w->acost[w->na] = (double)(q + 1) + sc->p.da;
                w->acount[w->na] = rr * qt;
                w->aseq[w->na++] = i;
            }
            if (s - rr) {
                w->acost[w->na] = (double)q + sc->p.da;
                w->acount[w->na] = (s - rr) * qt;
                w->aseq[w->na++] = i;
            }
        }
        if (lpt) {  /* epochs are nondecreasing in rank order: only groups within an epoch move */
            for (i64 k = 1; k < w->na; k++) {
                double c = w->acost[k];
                i64 n = w->acount[k], i = w->aseq[k], q = k;
                while (q > 0 && group_before(sc, 1, c, i, w->acost[q - 1], w->aseq[q - 1])) {
                    w->acost[q] = w->acost[q - 1]; w->acount[q] = w->acount[q - 1];
                    w->aseq[q] = w->aseq[q - 1];
                    q--;
                }
                w->acost[q] = c; w->acount[q] = n; w->aseq[q] = i;
            }
        }
        sc->ord_valid = 1;
        sc->ord_lpt = lpt;
        return;
    }
    if (!nd) return;
    for (i64 k = 0; k < nd; k++) sc->mark[chg[k]] = 1;
    if (lpt) {
        /* Re-place the changed sequences in the rank order; only ranks between their old
         * and new places can change epoch (the sequences before any other rank are the same). */
        i64 rmin = S, rmax = -1;
        for (i64 k = 0; k < nd; k++) {
            i64 r = rank_of(sc, chg[k]);
            if (r < rmin) rmin = r;
            if (r > rmax) rmax = r;
        }
        i64 len = 0;  /* drop the changed ones (marked) */
        for (i64 r = rmin; r < S; r++)
            if (!sc->mark[sc->sidx[r]]) sc->sidx[rmin + len++] = sc->sidx[r];
        len += rmin;
        for (i64 k = 0; k < nd; k++) {
            i64 i = chg[k], lo = 0, hi = len;
            while (lo < hi) {
                i64 mid = (lo + hi) >> 1;
                if (seq_before(sc, i, sc->sidx[mid])) hi = mid; else lo = mid + 1;
            }
            memmove(sc->sidx + lo + 1, sc->sidx + lo, (size_t)(len - lo) * sizeof(i64));
            sc->sidx[lo] = i;
            len++;
        }
        for (i64 k = 0; k < nd; k++) {
            i64 r = rank_of(sc, chg[k]);
            if (r < rmin) rmin = r;
            if (r > rmax) rmax = r;
        }
        i64 start = sc->rstart[rmin];
        for (i64 r = rmin; r <= rmax; r++) {
            i64 i = sc->sidx[r], nb = sc->qblocks[i];
            sc->rstart[r] = start;
            i64 ep = nb > 0 ? sc->epoch_of[start + nb - 1] : 0;
            start += nb;
            if (ep == sc->epoch[i]) continue;
            sc->epoch[i] = ep;
            if (!sc->mark[i] && sc->tiles[i] > 0) { sc->mark[i] = 1; chg[ne++] = i; }
        }
    }
    /* Drop the affected sequences' groups, then insert their new ones in order. */
    i64 na = 0;
    for (i64 k = 0; k < w->na; k++) {
        if (sc->mark[w->aseq[k]]) continue;
        w->acost[na] = w->acost[k]; w->acount[na] = w->acount[k]; w->aseq[na++] = w->aseq[k];
    }
    w->na = na;
    for (i64 k = 0; k < ne; k++) {
        if (sc->tiles[chg[k]] > 0) insert_groups(sc, lpt, chg[k]);
        sc->mark[chg[k]] = 0;
    }
}

/* The largest cost of a reduction of sequence i under the plan being scored (the costs
 * details() gives its reduction groups: the same expressions, hence the same floats). */
static double red_max_cost(void *ctx, i64 i) {
    const Scorer *sc = ctx;
    const Params *p = &sc->p;
    i64 s = sc->lb_splits[i], v = sc->vectors[i];
    i64 rn = s == 1 ? sc->lb_run : sc->merge_run, per = s == 1 ? 1 : s;
    i64 full = v / rn, rem = v % rn;
    double c = -INFINITY;
    if (full) c = p->dr + p->gm * (double)rn * (double)per;
    if (rem) {
        double cr = p->dr + p->gm * (double)rem * (double)per;
        if (cr > c) c = cr;
    }
    return c;
}

/* Scores `splits`; with a finite `thr` it may stop as soon as the score is certain to reach
 * thr (d->aborted; the key is then only a lower bound >= round9(thr)). Modes: SCORE_PLAIN
 * simulates from the chunk state; SCORE_RESUME starts from the incumbent's saved state
 * before the first group that differs; SCORE_RECORD simulates from the chunk state and saves
 * this plan as the incumbent (thr = -inf: only the attention phase, not counted). */
void details(Scorer *sc, const i64 *splits, Detail *d, double thr, int mode) {
    const Params *p = &sc->p;
    i64 S = sc->S;
    /* Candidates change one or a few sequences: divide, cost and re-place only those. */
    i64 nd = 0;
    for (i64 i = 0; i < S; i++) {
        i64 s = splits[i];
        if (sc->cs[i] == s) continue;
        seq_totals(sc, i, sc->cs[i], -1);
        seq_totals(sc, i, s, +1);
        sc->cs[i] = s;
        i64 n = sc->tiles[i];
        if (n <= 0) continue;
        sc->cq[i] = n / s; sc->cr[i] = n % s;
        sc->seqcost[i] = (double)sc->qtiles[i] * ((double)n + (double)s * p->da);
        i64 nb = sc->qblocks[i];
        sc->per[i] = nb > 0 ? sc->seqcost[i] / (double)nb : 0.0;
        sc->chg[nd++] = i;
    }
    int lpt = sc->decode_only && sc->split_seqs > 0;
    update_order(sc, lpt, nd);
    i64 run = sc->fixed_run > 0 ? sc->fixed_run : run_size(sc);
    i64 ntasks = sc->ntasks_chunk + sc->ntasks_hist, nsplits = sc->nsplits;
    Work *w = &sc->w;
    SimStart st = {&sc->chunk_state, 0, sc->nc > 0, NULL, NULL, 0};
    Queue from;
    if (mode == SCORE_RESUME && sc->inc_valid) {
        i64 f = 0, lim = w->na < sc->inc_na ? w->na : sc->inc_na;
        while (f < lim && w->acost[f] == sc->inc_acost[f] && w->acount[f] == sc->inc_acount[f]
               && w->aseq[f] == sc->inc_aseq[f]) f++;
        i64 k = f / sc->snap_every, cp = k * sc->snap_every;
        from.a = sc->snap + k * (p->K + 1);
        from.len = sc->snap_len[k];
        memcpy(w->gend, sc->inc_gend, (size_t)cp * sizeof(double));
        st.start = &from;
        st.from = cp;
        st.start_any = sc->nc > 0 || cp > 0;  /* every group holds >= 1 task */
    } else if (mode == SCORE_RECORD) {
        st.snap = sc->snap;
        st.snap_len = sc->snap_len;
        st.snap_every = sc->snap_every;
    }
    double score, aend;
    sc->lb_splits = splits;
    sc->lb_run = run;
    int r = sim_attention(w, p, thr, &st, red_max_cost, sc, &score, &aend);
    if (r > 0) {
        /* reductions: sequences in the order their last attention group is queued */
        w->nr = 0;
        for (i64 k = 0; k < w->na; k++) sc->last[w->aseq[k]] = k;
        for (i64 k = 0; k < w->na; k++) {
            i64 i = w->aseq[k];
            if (sc->last[i] != k) continue;
            i64 s = splits[i], v = sc->vectors[i];
            i64 rn = s == 1 ? run : sc->merge_run, per = s == 1 ? 1 : s;
            i64 full = v / rn, rem = v % rn;
            if (full) {
                w->rseq[w->nr] = i;
                w->rcount[w->nr] = full;
                w->rcost[w->nr++] = p->dr + p->gm * (double)rn * (double)per;
            }
            if (rem) {
                w->rseq[w->nr] = i;
                w->rcount[w->nr] = 1;
                w->rcost[w->nr++] = p->dr + p->gm * (double)rem * (double)per;
            }
        }
        r = sim_reductions(w, p, thr, &score);
    }
    d->aborted = r < 0;
    if (mode == SCORE_RECORD) {
        memcpy(sc->inc_acost, w->acost, (size_t)w->na * sizeof(double));
        memcpy(sc->inc_acount, w->acount, (size_t)w->na * sizeof(i64));
        memcpy(sc->inc_aseq, w->aseq, (size_t)w->na * sizeof(i64));
        memcpy(sc->inc_gend, w->gend, (size_t)w->na * sizeof(double));
        sc->inc_na = w->na;
        sc->inc_valid = 1;
    }
    if (thr != -INFINITY) sc->evaluations++;
    d->key_score = round9(score);
    d->key_attn = round9(aend);
    d->attn_end = aend;
    d->ntasks = ntasks;
    d->nsplits = nsplits;
    d->run = run;
    d->lpt = lpt;
}

/* Lexicographic key comparison (score, attention end, tasks, splits). */
int key_cmp(const Detail *a, const Detail *b) {
    if (a->key_score != b->key_score) return a->key_score < b->key_score ? -1 : 1;
    if (a->key_attn != b->key_attn) return a->key_attn < b->key_attn ? -1 : 1;
    if (a->ntasks != b->ntasks) return a->ntasks < b->ntasks ? -1 : 1;
    if (a->nsplits != b->nsplits) return a->nsplits < b->nsplits ? -1 : 1;
    return 0;
}

int vec_cmp(const i64 *a, const i64 *b, i64 S) {
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

/* Lower bound slack: a candidate is skipped only when its bound clears the threshold by more
 * than rounding noise, so skipping never changes which candidate wins (see split_search). */
static int bound_clears(double b, double thr) { return b - 1e-7 * (b > 1.0 ? b : 1.0) >= thr; }

int run_search(Scorer *sc, const i64 *limits, int prune, i64 *cur, Detail *nos, Detail *srch,
               i64 *iterations_out) {
    const Params *p = &sc->p;
    i64 S = sc->S;
    Cand *cands = xcalloc(S + 1, sizeof(Cand));
    double *seq_lb = xcalloc(S, sizeof(double)), *cur_ready = xcalloc(S, sizeof(double));
    double *best_ready = xcalloc(S, sizeof(double));
    int *tied = xcalloc(S, sizeof(int));
    int ok = cands && seq_lb && cur_ready && best_ready && tied;
    if (!ok) goto done;
    for (i64 i = 0; i < S; i++) cur[i] = 1;
    Detail cur_d, d, best_d, rec;
    /* NoSplit, recorded as the first incumbent when any sequence may split */
    int any_cand = 0;
    for (i64 i = 0; i < S; i++) any_cand |= sc->tiles[i] > 0 && limits[i] > 1;
    if (any_cand && !incumbent_alloc(sc)) { ok = 0; goto done; }
    details(sc, cur, &cur_d, INFINITY, any_cand ? SCORE_RECORD : SCORE_PLAIN);
    *nos = cur_d;
    memcpy(cur_ready, sc->w.ready, (size_t)S * sizeof(double));
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
        qsort(cands, (size_t)nc, sizeof(Cand), cmp_cand);
        /* Save the incumbent's queue states for the candidates to resume from (an attention
         * phase only, not counted as an evaluation). */
        if (nc && iterations > 1) details(sc, cur, &rec, -INFINITY, SCORE_RECORD);
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
            details(sc, cur, &d, thr, SCORE_RESUME);
            if (j < S) cur[j]--;
            else for (i64 i = 0; i < S; i++) cur[i] -= tied[i];
            if (!d.aborted && d.key_score < cur_score) {
                int c2 = best < 0 ? -1 : key_cmp(&d, &best_d);
                if (best < 0 || c2 < 0 || (c2 == 0 && j < best)) {
                    best = j;
                    best_d = d;
                    memcpy(best_ready, sc->w.ready, (size_t)S * sizeof(double));
                }
            }
        }
        if (best < 0) break;
        if (best < S) cur[best]++;
        else for (i64 i = 0; i < S; i++) cur[i] += tied[i];
        cur_d = best_d;
        memcpy(cur_ready, best_ready, (size_t)S * sizeof(double));
    }
    *srch = cur_d;
    *iterations_out = iterations;
done:
    free(cands); free(seq_lb); free(cur_ready); free(best_ready); free(tied);
    return ok;
}

/* split_search.plan_splits' selection: the search (or the fixed plan), then the best of
 * NoSplit, the search result and the FA3 reference by (key, splits), adopted over NoSplit
 * only when min_gain better. Returns 0 on no memory. */
int plan_core(i64 S, const i64 *tiles, const i64 *qtiles, const i64 *vectors, const i64 *chunk,
              i64 C, const i64 *qblocks, int decode_only, Params p, i64 hq, i64 M, i64 P,
              i64 fixed_run, i64 merge_run, const i64 *limits, const i64 *fa3, const i64 *fixed,
              int prune, double min_gain, PlanResult *out) {
    Scorer sc;
    int ok = scorer_init(&sc, S, tiles, qtiles, vectors, chunk, C, qblocks, decode_only, p, hq, M,
                         P, fixed_run, merge_run);
    i64 *ones = xcalloc(S, sizeof(i64));
    if (!ok || !ones) { ok = 0; goto done; }
    for (i64 i = 0; i < S; i++) ones[i] = 1;
    out->iterations = 0;
    if (fixed) {
        details(&sc, ones, &out->nos, INFINITY, SCORE_PLAIN);
        details(&sc, fa3, &out->fa3, INFINITY, SCORE_PLAIN);
        memcpy(out->search, fixed, (size_t)S * sizeof(i64));
        memcpy(out->chosen, fixed, (size_t)S * sizeof(i64));
        details(&sc, fixed, &out->srch, INFINITY, SCORE_PLAIN);
    } else {
        if (!run_search(&sc, limits, prune, out->search, &out->nos, &out->srch, &out->iterations)) {
            ok = 0;
            goto done;
        }
        if (!vec_cmp(fa3, ones, S)) out->fa3 = out->nos;
        else if (!vec_cmp(fa3, out->search, S)) out->fa3 = out->srch;
        else details(&sc, fa3, &out->fa3, INFINITY, SCORE_PLAIN);
        /* best of NoSplit, search, FA3 by (key, splits), as Python's sorted() of the pool */
        const i64 *pv[3] = {ones, out->search, fa3};
        const Detail *pd[3] = {&out->nos, &out->srch, &out->fa3};
        int b = 0;
        for (int c = 1; c < 3; c++) {
            int k = key_cmp(pd[c], pd[b]);
            if (k < 0 || (k == 0 && vec_cmp(pv[c], pv[b], S) < 0)) b = c;
        }
        const i64 *cv = pv[b];
        if (vec_cmp(cv, ones, S) && pd[b]->key_score > (1.0 - min_gain) * out->nos.key_score) cv = ones;
        memcpy(out->chosen, cv, (size_t)S * sizeof(i64));
    }
    out->evaluations = sc.evaluations;
    details(&sc, out->chosen, &out->ch, INFINITY, SCORE_PLAIN);  /* its epochs: sc.epoch */
    memcpy(out->epochs, sc.epoch, (size_t)S * sizeof(i64));
done:
    scorer_free(&sc);
    free(ones);
    return ok;
}
