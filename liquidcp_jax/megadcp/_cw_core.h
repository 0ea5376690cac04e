/* Shared declarations of the compiled critical-wave planner (paper §5.2, Appendix A.2).
 *
 * The extension _cw_native is built from (setup.py):
 *   _cw_sim.c     the bulk event simulator (critical_wave._simulate_bulk) and its queues;
 *   _cw_search.c  the candidate scorer and the split search (split_search._Scorer, the loop);
 *   _cw_native.c  the Python bindings and FA3's static split heuristic;
 *   _cw_step.c    one call for a whole decode step (megadcp.tables.build_descriptor_tables):
 *                 inputs, FA3 reference, limits, search, packing;
 *   _dcp_pack.c   the descriptor packer (megadcp._pack_python).
 * The Python code is the specification; tests assert both give the same results.
 */
#ifndef CW_CORE_H
#define CW_CORE_H

#include <stdint.h>
#include <stdlib.h>

typedef int64_t i64;

typedef struct { i64 K, wpc; double rho, da, dr, gm; } Params;

/* A bin: n CTAs (or warps) free from time w on. */
typedef struct { double w; i64 n; } Bin;

/* Min-heap of bins (the warp queue). `held`: the partly consumed earliest bin, kept out of
 * the array (it is <= every entry), so taking a few tasks from a large bin costs no sift. */
typedef struct { Bin *a; i64 len; Bin held; int has_held; } Heap;

/* The CTA queue: bins sorted by strictly decreasing w, the earliest last. Kept sorted so the
 * final CTA release times (the attention time map) need no sort, and so the state after any
 * queue prefix is a plain array copy (the search resumes candidates from such copies). */
typedef struct { Bin *a; i64 len; } Queue;

/* Simulation workspace: the task groups of one candidate plan, in queue order, and scratch. */
typedef struct {
    i64 S, K, wpc;
    double *acost; i64 *acount, *aseq; i64 na;   /* history-attention groups */
    i64 *rseq, *rcount; double *rcost; i64 nr;   /* reduction groups */
    double *gend;            /* (max_attn) work-time end of each attention group */
    Queue q;                 /* CTA bins during the attention phase */
    Heap warps;
    double *seq_w, *ready;   /* (S); seq_w < 0: no history task */
    double *X, *T, *tau;     /* (K + 1) time-map breakpoints */
    i64 nx, r0;              /* breakpoints; 1 when CTAs are released at W = 0 */
    double *tau_of, tau_rho; int tau_ok;  /* (K + 1) tau(k) for tau_rho */
    Bin *scratch;            /* (K * wpc + 1) */
    Bin *run;                /* (2K + 2) new-bin run of the merge dispatch */
} Work;

/* Where a simulation may start and what it records (the resumable search, _cw_search.c). */
typedef struct {
    const Queue *start;      /* CTA bins before group `from` */
    i64 from;                /* first group to dispatch; gend[0, from) must already be set */
    int start_any;           /* a task was dispatched before `from` (chunk or history) */
    Bin *snap;               /* when non-NULL: record the queue before every group g with */
    i64 *snap_len;           /*   g % snap_every == 0, g >= from, at snap + (g / every) * (K+1) */
    i64 snap_every;
} SimStart;

/* The candidate scorer (split_search._Scorer.details) and the search (_search_python). */
typedef struct {
    i64 S, C;
    const i64 *tiles, *qtiles, *vectors, *qblocks;
    int decode_only;
    Params p;
    i64 hq, per_epoch, fixed_run, merge_run;
    double *ccost; i64 *ccount; i64 nc;  /* chunk groups (the same for every plan) */
    i64 ntasks_chunk;
    Queue chunk_state;       /* CTA bins after the chunk tasks */
    Work w;
    /* the previous call's plan, updated incrementally (w.a* hold its history groups in
     * queue order): splits, per-block cost, rank order, block starts, epochs */
    i64 *cs, *cq, *cr;       /* per sequence: splits (0: not seen), n / s, n % s */
    double *seqcost, *per; i64 *sidx, *rstart, *epoch, *epoch_of, *last, *chg;
    char *mark;
    int ord_valid, ord_lpt;  /* w.a* hold a queue, in LPT (1) or FIFO (0) order */
    i64 copy_tot[5], merge_tot, split_seqs, nsplits, ntasks_hist;  /* plan totals */
    i64 evaluations;
    i64 runs[5]; int nruns;  /* copy-run candidates (descending, distinct) */
    i64 *run_tasks, *merge_tasks;  /* ceil(v_i / run) per sequence and run; ceil(v_i / merge) */
    /* the incumbent of the search: its groups, their ends and queue snapshots */
    double *inc_acost, *inc_gend; i64 *inc_acount, *inc_aseq; i64 inc_na; int inc_valid;
    Bin *snap; i64 *snap_len; i64 snap_every;
    const i64 *lb_splits; i64 lb_run;  /* the plan being scored, for red_max_cost */
} Scorer;

typedef struct {
    double key_score, key_attn, attn_end;  /* key_* rounded to 9 decimals */
    i64 ntasks, nsplits, run;
    int lpt, aborted;
} Detail;

enum { SCORE_PLAIN = 0, SCORE_RESUME = 1, SCORE_RECORD = 2 };

int scorer_init(Scorer *sc, i64 S, const i64 *tiles, const i64 *qtiles, const i64 *vectors,
                const i64 *chunk, i64 C, const i64 *qblocks, int decode_only, Params p, i64 hq,
                i64 M, i64 P, i64 fixed_run, i64 merge_run);
void scorer_free(Scorer *sc);
void details(Scorer *sc, const i64 *splits, Detail *d, double thr, int mode);
int key_cmp(const Detail *a, const Detail *b);
int vec_cmp(const i64 *a, const i64 *b, i64 S);
/* The search from NoSplit; fills search (S) and its/NoSplit's details; 0 on no memory. */
int run_search(Scorer *sc, const i64 *limits, int prune, i64 *search, Detail *nos,
               Detail *srch, i64 *iterations);

typedef struct {
    i64 *chosen, *search, *epochs;  /* (S) each, caller-allocated; epochs valid when ch.lpt */
    i64 iterations, evaluations;
    Detail ch, nos, fa3, srch;      /* chosen, NoSplit, FA3 reference, search result */
} PlanResult;

int plan_core(i64 S, const i64 *tiles, const i64 *qtiles, const i64 *vectors, const i64 *chunk,
              i64 C, const i64 *qblocks, int decode_only, Params p, i64 hq, i64 M, i64 P,
              i64 fixed_run, i64 merge_run, const i64 *limits, const i64 *fa3, const i64 *fixed,
              int prune, double min_gain, PlanResult *out);

void *xcalloc(size_t n, size_t sz);
int work_init(Work *w, i64 S, i64 K, i64 wpc, i64 max_attn, i64 max_red);
void work_free(Work *w);
void queue_reset(Queue *q, i64 K);
double queue_dispatch(Queue *q, i64 total, double c, i64 m, Bin *run, Bin *out);
typedef double (*RedCostFn)(void *ctx, i64 seq);
int sim_attention(Work *w, const Params *p, double thr, const SimStart *st, RedCostFn red_cost,
                  void *ctx, double *score, double *attn_end);
int sim_reductions(Work *w, const Params *p, double thr, double *score);
/* Both phases; returns 0 (no attention task), -1 (stopped: score >= thr) or 1. */
int simulate(Work *w, const Params *p, double thr, const SimStart *st, double *score,
             double *attn_end);
double round9(double x);

#endif
