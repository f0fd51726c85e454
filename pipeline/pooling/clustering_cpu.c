/* Token Pooling's clustering and merge on the CPU, one call for a batch of small problems: K-Medoids on the tokens,
 * K-Means on their (B, N, N) Gram matrices, and the weighted cluster means.
 *
 * Built and loaded by native.py (plain C, no Python or torch headers: it compiles in about a second),
 * called through ctypes as the CPU kernels of the custom ops tokenpool::kmedoids, tokenpool::kmeans_gram and
 * tokenpool::cluster_means.
 *
 * Why our own kernels: torch's CPU index reductions (argmin, min with indices) ran 10x slower than the
 * plain minimum here, the torch iterations took as long as the distance matrix itself at DeiT-S size,
 * and K-Means' torch iterations work on dense (B, K, N) tensors where each token belongs to one
 * cluster; index_add_'s cluster sums took 5-9 ms of a DeiT-S step at batch 64, where one pass over the tokens takes
 * about 1 ms (docs/benchmarks.md). No library runs these iterations, with these tie, swap and empty-cluster rules,
 * on a batch of small problems.
 *
 * All return 0, -1 when the workspace could not be allocated, or -2 when the sizes or the swap margin are out of their
 * ranges (1 <= K <= N for K-Medoids, K >= 1 for each, keep in (0, 1]; native.py's wrappers refuse these, and the shapes,
 * the indices and repeated medoids, before a call: the C trusts that every index it is given lies in range).
 *
 * Instruction sets: on x86-64 the K-Medoids and the means kernels are built three times, for the x86-64 psABI levels
 * v4 (AVX-512), v3 (AVX2, FMA) and the baseline, and the loader picks the one the CPU runs (GCC's and Clang's
 * target_clones; the helpers that do their arithmetic are inlined into each clone, INLINE, so that they too are
 * built for its level); one
 * library serves every x86-64 CPU, so a cache or an image built elsewhere loads anywhere. K-Means' kernels are built
 * for the baseline alone: with an AVX-512 clone the weighted K-Means step took 9.5-9.7% of a DeiT-S block, 7.4% with
 * the baseline build and 7.3-8.8% at db5a098 (bench ops, the Intel Xeon VM, 2026-12-07; docs/benchmarks.md).
 * -DPIPELINE_NO_CLONES builds the baseline alone. clustering_isa() names the level the cloned kernels run at here,
 * clustering_built() the levels the library holds (native.py keys its cache by it and refuses a library that says
 * otherwise). -ffp-contract=off holds in every clone: a wider vector changes no rounding, and no sum is reordered
 * (the C compiler reassociates no floating-point addition without -ffast-math; K-Medoids' _dot spells its order
 * out), so every clone gives the same bits.
 *
 * K-Medoids (kmedoids_f32 / _f64). Semantics are those of clustering._kmedoids and of the brute-force
 * reference in tests/:
 *   - assignment: each token joins the medoid nearest to it, d(i, med[c]), ties to the lowest cluster
 *     index; then every medoid joins its own cluster;
 *   - update: the cost of token p as the medoid of its own cluster c is sum_{q in c} w_q d(p, q), added
 *     in increasing q from 0 (each product rounded before the add: build with -ffp-contract=off);
 *     each cluster's cheapest member (lowest token index on ties) replaces the medoid when its cost is
 *     below keep * the medoid's cost.
 * The update visits only the members of each cluster (sum over clusters of size^2 additions, where the
 * torch path reads all N^2 distances). The distances: the caller gives the products of every token with the
 * starting medoids (one batched matmul, half the Gram matrix's work at K = N / 2), from which their columns are
 * derived as clustering.dists_from_gram derives the Gram matrix's, (|x_i|^2 + |x_j|^2) - 2 x_i . x_j, with the
 * squared norms of the tokens not given summed by _dot (so a column may differ from dists_from_gram's in its last
 * bits); any other distance the iterations read (a medoid swapped in, two members of a cluster that are not its
 * medoid: few at the paper's K) is computed on first read, its product summed in _dot's fixed order, and kept (NaN
 * marks a distance not computed yet: tokens that are not finite, which token_pool refuses unless told not to
 * validate, give NaN distances that are computed again at each read). Each image's distances are a workspace of its
 * own that stays in cache for its iterations.
 *
 * K-Means (kmeans_gram_f32 / _f64), the Gram form of clustering._kmeans_gram: every centre is kept as
 * its coefficients over the tokens, so with G = X X^T, proj[c, n] = c . x_n = sum_{j in c} a_j G[j, n]
 * (a_j = w_j / sum_{j' in c} w_j') and ||c||^2 = sum_{j in c} a_j proj[c, j]. Centres start at the
 * tokens start[c]; each token joins the centre minimising ||c||^2 - 2 proj[c, n] (ties to the lowest
 * index); an empty cluster keeps its centre. An update costs N^2 multiply-adds an image (each token
 * is in one cluster), where the dense product with the (K, N) coefficients costs K N^2.
 *
 * The means (cluster_means_f32 / _f64): merge.means_partition's, the same bits (DEFINE_MEANS).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && !defined(PIPELINE_NO_CLONES)
/* __builtin_cpu_supports("x86-64-v4") and target_clones("arch=x86-64-v4"): GCC 12; Clang 18 (Clang 14-17 refuse the
   level names in __builtin_cpu_supports) */
#if !((defined(__clang__) && __clang_major__ >= 18) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 12))
#error "a clone per x86-64 level needs GCC 12 or Clang 18 (native.py then builds with -DPIPELINE_NO_CLONES)"
#endif
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define BUILT "x86-64-v4,x86-64-v3,x86-64"
#else
#define CLONES
#if defined(__x86_64__)
#define BUILT "x86-64"
#else
#define BUILT "baseline"
#endif
#endif

/* the levels this library holds a clone for, highest first */
const char *clustering_built(void) { return BUILT; }

/* the level the K-Medoids and means kernels run at on this CPU: the highest clone it supports (K-Means': the
   baseline) */
const char *clustering_isa(void) {
#if defined(__x86_64__) && !defined(PIPELINE_NO_CLONES)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("x86-64-v4")) return "x86-64-v4";
    if (__builtin_cpu_supports("x86-64-v3")) return "x86-64-v3";
#endif
    return BUILT;
}

/* the cloned kernels' helpers: inlined into each clone, so that they too are built for its instruction set (a
   function that is not inlined is built for the baseline alone) */
#define INLINE static inline __attribute__((always_inline))

/* the partial sums of a product of two tokens (K-Medoids' _dot): 16 floats fill an AVX-512 register */
#define LANES 16

/* members of each cluster in increasing token order: members[start[c] .. start[c + 1]) */
static void cluster_members(const int64_t *assign, int64_t *start, int64_t *members, int64_t n, int64_t k) {
    memset(start, 0, (size_t)(k + 1) * sizeof(int64_t));
    for (int64_t i = 0; i < n; ++i) ++start[assign[i] + 1];
    for (int64_t c = 0; c < k; ++c) start[c + 1] += start[c];
    for (int64_t i = 0; i < n; ++i) members[start[assign[i]]++] = i;
    for (int64_t c = k; c > 0; --c) start[c] = start[c - 1]; /* the fill moved each start to the end */
    start[0] = 0;
}

/* Each kernel's entry point: NAME##_batch on contiguous parts of the batch at once, one a thread (at most `threads`,
   and no more than the images), in one OpenMP parallel region (built with -fopenmp, which links libgomp.so.1: in a
   process that has loaded torch, torch's own copy, so these threads are the pool its matmuls just ran on and nothing
   is oversubscribed). The images are independent: the same bits at any number of threads. CALL is the batch
   function's call on the images s0 .. s0 + count - 1. */
#define IN_PARTS(threads, b, CALL)                                                                                   \
    const int64_t parts = threads < b ? threads : b;                                                                 \
    int failed = 0;                                                                                                  \
    _Pragma("omp parallel for num_threads(parts) schedule(static) reduction(|: failed)")                             \
    for (int64_t t = 0; t < parts; ++t) {                                                                            \
        const int64_t s0 = b * t / parts, count = b * (t + 1) / parts - s0;                                          \
        failed |= (CALL) != 0;                                                                                       \
    }                                                                                                                \
    return failed ? -1 : 0;

#define DEFINE_KMEDOIDS(NAME, REAL)                                                                                  \
    /* x_a . x_b over m features in a fixed order that vectorises without reordering a sum: LANES partial sums       \
       (lane l adds the products of features l, l + LANES, ... in increasing order), then halved pairwise (lane l    \
       plus lane l + h, h = LANES / 2, ..., 1). Every clone adds in this order, so every clone gives the same bits. */ \
    INLINE REAL NAME##_dot(const REAL *a, const REAL *b, int64_t m) {                                                \
        REAL acc[LANES] = {0};                                                                                       \
        int64_t t = 0;                                                                                               \
        for (; t + LANES <= m; t += LANES)                                                                           \
            for (int l = 0; l < LANES; ++l) acc[l] += a[t + l] * b[t + l];                                           \
        for (int l = 0; t + l < m; ++l) acc[l] += a[t + l] * b[t + l];                                               \
        for (int h = LANES / 2; h >= 1; h /= 2)                                                                      \
            for (int l = 0; l < h; ++l) acc[l] += acc[l + h];                                                        \
        return acc[0];                                                                                               \
    }                                                                                                                \
                                                                                                                     \
    /* the distance d(i, j) = d(j, i), kept at dt[j * n + i] (row j of dt is column j of d), computed on first read: \
       (|x_i|^2 + |x_j|^2) - 2 x_i . x_j, rounded as dists_from_gram rounds it */                                    \
    INLINE REAL NAME##_dist(REAL *dt, const REAL *x, const REAL *norm, int64_t n, int64_t m, int64_t i, int64_t j) { \
        REAL v = dt[j * n + i];                                                                                      \
        if (v != v) { /* NaN: not computed yet */                                                                    \
            v = (norm[i] + norm[j]) - (REAL)2 * NAME##_dot(x + i * m, x + j * m, m);                                 \
            dt[j * n + i] = v;                                                                                       \
            dt[i * n + j] = v;                                                                                       \
        }                                                                                                            \
        return v;                                                                                                    \
    }                                                                                                                \
                                                                                                                     \
    /* the nearest medoid of every token, ties to the lowest cluster (a medoid's column of d at a time, every token  \
       in the inner loop), then every medoid into its own cluster; a medoid's column is computed first where it is   \
       not whole (full[j]: column j is) */                                                                           \
    INLINE void NAME##_assign(REAL *dt, const REAL *x, const REAL *norm, char *full, const int64_t *med, REAL *best, \
                              int64_t *assign, int64_t n, int64_t m, int64_t k) {                                    \
        for (int64_t c = 0; c < k; ++c) {                                                                            \
            const int64_t j = med[c];                                                                                \
            if (full[j]) continue;                                                                                   \
            for (int64_t i = 0; i < n; ++i) NAME##_dist(dt, x, norm, n, m, i, j);                                    \
            full[j] = 1;                                                                                             \
        }                                                                                                            \
        memcpy(best, dt + med[0] * n, (size_t)n * sizeof(REAL));                                                     \
        memset(assign, 0, (size_t)n * sizeof(int64_t));                                                              \
        for (int64_t c = 1; c < k; ++c) {                                                                            \
            const REAL *col = dt + med[c] * n;                                                                       \
            for (int64_t i = 0; i < n; ++i)                                                                          \
                if (col[i] < best[i]) { best[i] = col[i]; assign[i] = c; }                                           \
        }                                                                                                            \
        for (int64_t c = 0; c < k; ++c) assign[med[c]] = c;                                                          \
    }                                                                                                                \
                                                                                                                     \
    /* the swap rule of every cluster, from the costs of its members */                                              \
    INLINE void NAME##_update(REAL *dt, const REAL *x, const REAL *norm, const REAL *w, int64_t *med,                \
                              const int64_t *assign, int64_t *start, int64_t *members, REAL *cost, int64_t n,        \
                              int64_t m, int64_t k, REAL keep) {                                                     \
        cluster_members(assign, start, members, n, k);                                                               \
        for (int64_t c = 0; c < k; ++c) {                                                                            \
            const int64_t *first = members + start[c], *last = members + start[c + 1];                               \
            REAL best_cost = 0;                                                                                      \
            int64_t best = -1;                                                                                       \
            for (const int64_t *p = first; p < last; ++p) {                                                          \
                REAL acc = 0;                                                                                        \
                for (const int64_t *q = first; q < last; ++q) {                                                      \
                    const REAL v = NAME##_dist(dt, x, norm, n, m, *p, *q);                                           \
                    acc += w ? v * w[*q] : v;                                                                        \
                }                                                                                                    \
                cost[*p] = acc;                                                                                      \
                if (best < 0 || acc < best_cost) { best_cost = acc; best = *p; }                                     \
            }                                                                                                        \
            if (best < 0) continue; /* no member: an empty cluster (two equal medoids) keeps its medoid */           \
            const REAL current = cost[med[c]] * keep; /* the medoid is a member of its own cluster */                \
            if (best_cost < current) med[c] = best;                                                                  \
        }                                                                                                            \
    }                                                                                                                \
                                                                                                                     \
    /* one image. cols (nc, n): the products x_given[c] . x_i; column given[c] of d is derived from them, and d(i, j) \
       for a token i that is not given also is d(j, i); any other distance is computed on first read */              \
    INLINE void NAME##_image(const REAL *x, const REAL *cols, const int64_t *given, const REAL *w, int64_t *med,     \
                             int64_t *assign, REAL *dt, REAL *norm, char *full, int64_t *start, int64_t *members,    \
                             REAL *cost, int64_t n, int64_t m, int64_t nc, int64_t k, int64_t iters, REAL keep) {    \
        memset(full, 0, (size_t)n);                                                                                  \
        for (int64_t c = 0; c < nc; ++c) full[given[c]] = 1;                                                         \
        for (int64_t c = 0; c < nc; ++c) norm[given[c]] = cols[c * n + given[c]];                                    \
        for (int64_t i = 0; i < n; ++i)                                                                              \
            if (!full[i]) {                                                                                          \
                norm[i] = NAME##_dot(x + i * m, x + i * m, m);                                                       \
                for (int64_t j = 0; j < n; ++j) dt[i * n + j] = (REAL)NAN; /* not computed yet */                    \
            }                                                                                                        \
        for (int64_t c = 0; c < nc; ++c) {                                                                           \
            const int64_t j = given[c];                                                                              \
            const REAL *col = cols + c * n;                                                                          \
            REAL *row = dt + j * n;                                                                                  \
            for (int64_t i = 0; i < n; ++i) row[i] = (norm[i] + norm[j]) - (REAL)2 * col[i];                         \
            for (int64_t i = 0; i < n; ++i)                                                                          \
                if (!full[i]) dt[i * n + j] = row[i];                                                                \
        }                                                                                                            \
        NAME##_assign(dt, x, norm, full, med, cost, assign, n, m, k);                                                \
        for (int64_t it = 1; it < iters; ++it) {                                                                     \
            NAME##_update(dt, x, norm, w, med, assign, start, members, cost, n, m, k, keep);                         \
            NAME##_assign(dt, x, norm, full, med, cost, assign, n, m, k);                                            \
        }                                                                                                            \
    }                                                                                                                \
                                                                                                                     \
    /* x (b, n, m) tokens; cols (b, nc, n) the products x_given[c] . x_i of every token with the tokens given (b, nc), \
       distinct in an image (a batched matmul's); each image's distances in a workspace of its own that stays in     \
       cache for its iterations */                                                                                   \
    CLONES static int NAME##_batch(const REAL *x, const REAL *cols, const int64_t *given, const REAL *w,                            \
                    const int64_t *med_in, int64_t *med_out, int64_t *assign, int64_t b, int64_t n, int64_t m,       \
                    int64_t nc, int64_t k, int64_t iters, double keep) {                                             \
        int64_t *start = malloc((size_t)(k + 1) * sizeof(int64_t));                                                  \
        int64_t *members = malloc((size_t)n * sizeof(int64_t));                                                      \
        REAL *cost = malloc((size_t)n * sizeof(REAL));                                                               \
        REAL *norm = malloc((size_t)n * sizeof(REAL));                                                               \
        char *full = malloc((size_t)n);                                                                              \
        REAL *dt = malloc((size_t)(n * n) * sizeof(REAL));                                                           \
        if (!start || !members || !cost || !norm || !full || !dt) {                                                  \
            free(start); free(members); free(cost); free(norm); free(full); free(dt);                                \
            return -1;                                                                                               \
        }                                                                                                            \
        memcpy(med_out, med_in, (size_t)(b * k) * sizeof(int64_t));                                                  \
        for (int64_t s = 0; s < b; ++s)                                                                              \
            NAME##_image(x + s * n * m, cols + s * nc * n, given + s * nc, w ? w + s * n : NULL,             \
                         med_out + s * k, assign + s * n, dt, norm, full, start, members, cost, n, m, nc, k, iters,  \
                         (REAL)keep);                                                                                \
        free(start); free(members); free(cost); free(norm); free(full); free(dt);                                    \
        return 0;                                                                                                    \
    }                                                                                                                \
                                                                                                                     \
    int NAME(const REAL *x, const REAL *cols, const int64_t *given, const REAL *w, const int64_t *med_in,            \
             int64_t *med_out, int64_t *assign, int64_t b, int64_t n, int64_t m, int64_t nc, int64_t k, int64_t iters, \
             double keep, int64_t threads) {                                                                         \
        if (b < 0 || n < 1 || m < 0 || k < 1 || k > n || nc < 0 || nc > n || !(keep > 0 && keep <= 1)) return -2;  \
        IN_PARTS(threads, b, NAME##_batch(x + s0 * n * m, cols + s0 * nc * n, given + s0 * nc, w ? w + s0 * n : NULL, \
                                          med_in + s0 * k, med_out + s0 * k, assign + s0 * n, count, n, m, nc, k,    \
                                          iters, keep))                                                              \
    }

#define DEFINE_KMEANS(NAME, REAL)                                                                        \
    /* each token's nearest centre: the clusters in the outer loop, so the inner loop runs over tokens */ \
    static void NAME##_assign(const REAL *proj, const REAL *csq, REAL *best, int64_t *assign, int64_t n,   \
                              int64_t k) {                                                               \
        for (int64_t i = 0; i < n; ++i) {                                                                \
            best[i] = csq[0] - 2 * proj[i];                                                              \
            assign[i] = 0;                                                                               \
        }                                                                                                \
        for (int64_t c = 1; c < k; ++c) {                                                                \
            const REAL *row = proj + c * n;                                                              \
            for (int64_t i = 0; i < n; ++i) {                                                            \
                const REAL v = csq[c] - 2 * row[i];                                                      \
                if (v < best[i]) { best[i] = v; assign[i] = c; }                                         \
            }                                                                                            \
        }                                                                                                \
    }                                                                                                    \
                                                                                                         \
    static int NAME##_batch(const REAL *g, const REAL *w, const int64_t *start_in, int64_t *assign, int64_t b,             \
                    int64_t n, int64_t k, int64_t iters) {                                               \
        REAL *proj = malloc((size_t)(k * n) * sizeof(REAL));                                             \
        REAL *csq = malloc((size_t)k * sizeof(REAL));                                                    \
        REAL *best = malloc((size_t)n * sizeof(REAL));                                                   \
        int64_t *start = malloc((size_t)(k + 1) * sizeof(int64_t));                                     \
        int64_t *members = malloc((size_t)n * sizeof(int64_t));                                          \
        if (!proj || !csq || !best || !start || !members) {                                              \
            free(proj); free(csq); free(best); free(start); free(members);                               \
            return -1;                                                                                   \
        }                                                                                                \
        for (int64_t s = 0; s < b; ++s) {                                                                \
            const REAL *gs = g + s * n * n, *ws = w ? w + s * n : NULL;                                   \
            const int64_t *first = start_in + s * k;                                                     \
            int64_t *as = assign + s * n;                                                                \
            for (int64_t c = 0; c < k; ++c) {                                                            \
                memcpy(proj + c * n, gs + first[c] * n, (size_t)n * sizeof(REAL));                       \
                csq[c] = gs[first[c] * n + first[c]];                                                    \
            }                                                                                            \
            NAME##_assign(proj, csq, best, as, n, k);                                                    \
            for (int64_t it = 1; it < iters; ++it) {                                                     \
                cluster_members(as, start, members, n, k);                                               \
                for (int64_t c = 0; c < k; ++c) {                                                        \
                    const int64_t *p0 = members + start[c], *p1 = members + start[c + 1];                \
                    if (p0 == p1) continue; /* an empty cluster keeps its centre */                      \
                    REAL total = 0;                                                                      \
                    for (const int64_t *p = p0; p < p1; ++p) total += ws ? ws[*p] : 1;                   \
                    REAL *row = proj + c * n;                                                            \
                    memset(row, 0, (size_t)n * sizeof(REAL));                                            \
                    for (const int64_t *p = p0; p < p1; ++p) {                                           \
                        const REAL a = (ws ? ws[*p] : 1) / total;                                        \
                        const REAL *grow = gs + *p * n;                                                  \
                        for (int64_t i = 0; i < n; ++i) row[i] += a * grow[i];                           \
                    }                                                                                    \
                    REAL sq = 0;                                                                         \
                    for (const int64_t *p = p0; p < p1; ++p) sq += (ws ? ws[*p] : 1) / total * row[*p];  \
                    csq[c] = sq;                                                                         \
                }                                                                                        \
                NAME##_assign(proj, csq, best, as, n, k);                                                \
            }                                                                                            \
        }                                                                                                \
        free(proj); free(csq); free(best); free(start); free(members);                                   \
        return 0;                                                                                        \
    }                                                                                                                \
                                                                                                                     \
    int NAME(const REAL *g, const REAL *w, const int64_t *start_in, int64_t *assign, int64_t b, int64_t n, int64_t k, \
             int64_t iters, int64_t threads) {                                                                       \
        if (b < 0 || n < 1 || k < 1) return -2;                                                                      \
        IN_PARTS(threads, b, NAME##_batch(g + s0 * n * n, w ? w + s0 * n : NULL, start_in + s0 * k, assign + s0 * n, \
                                          count, n, k, iters))                                                       \
    }

#define DEFINE_MEANS(NAME, REAL)                                                                                     \
    /* x (b, n, m) tokens, w (b, n) or NULL, assign (b, n) in [0, k), start (b, k) or NULL -> out (b, k, m): each    \
       cluster's sum of w_i x_i (each product rounded), added in increasing token order from 0, over its total weight \
       (added the same way): the bits of Partition.mean's index_add_ sums; an empty cluster gives the token at its   \
       start (0 / 0 without start) */                                                                                \
    CLONES static int NAME##_batch(const REAL *x, const REAL *w, const int64_t *assign, const int64_t *start, REAL *out,   \
                           int64_t b, int64_t n, int64_t m, int64_t k) {                                             \
        REAL *total = malloc((size_t)k * sizeof(REAL));                                                              \
        if (!total) return -1;                                                                                       \
        for (int64_t s = 0; s < b; ++s) {                                                                            \
            const REAL *xs = x + s * n * m, *ws = w ? w + s * n : NULL;                                              \
            const int64_t *as = assign + s * n;                                                                      \
            REAL *os = out + s * k * m;                                                                              \
            memset(os, 0, (size_t)(k * m) * sizeof(REAL));                                                           \
            memset(total, 0, (size_t)k * sizeof(REAL));                                                              \
            for (int64_t i = 0; i < n; ++i) {                                                                        \
                REAL *row = os + as[i] * m;                                                                          \
                const REAL *xi = xs + i * m;                                                                         \
                if (ws) {                                                                                            \
                    const REAL wi = ws[i];                                                                           \
                    for (int64_t t = 0; t < m; ++t) row[t] += xi[t] * wi;                                            \
                    total[as[i]] += wi;                                                                              \
                } else {                                                                                             \
                    for (int64_t t = 0; t < m; ++t) row[t] += xi[t];                                                 \
                    total[as[i]] += 1;                                                                               \
                }                                                                                                    \
            }                                                                                                        \
            for (int64_t c = 0; c < k; ++c) {                                                                        \
                REAL *row = os + c * m;                                                                              \
                if (start && !(total[c] > 0))                                                                        \
                    memcpy(row, xs + start[s * k + c] * m, (size_t)m * sizeof(REAL));                                \
                else                                                                                                 \
                    for (int64_t t = 0; t < m; ++t) row[t] = row[t] / total[c];                                      \
            }                                                                                                        \
        }                                                                                                            \
        free(total);                                                                                                 \
        return 0;                                                                                                    \
    }                                                                                                                \
                                                                                                                     \
    int NAME(const REAL *x, const REAL *w, const int64_t *assign, const int64_t *start, REAL *out, int64_t b, int64_t n, \
             int64_t m, int64_t k, int64_t threads) {                                                                \
        if (b < 0 || n < 0 || m < 0 || k < 1) return -2;                                                             \
        IN_PARTS(threads, b, NAME##_batch(x + s0 * n * m, w ? w + s0 * n : NULL, assign + s0 * n,                    \
                                          start ? start + s0 * k : NULL, out + s0 * k * m, count, n, m, k))          \
    }

DEFINE_KMEDOIDS(kmedoids_f32, float)
DEFINE_KMEDOIDS(kmedoids_f64, double)
DEFINE_KMEANS(kmeans_gram_f32, float)
DEFINE_KMEANS(kmeans_gram_f64, double)
DEFINE_MEANS(cluster_means_f32, float)
DEFINE_MEANS(cluster_means_f64, double)
