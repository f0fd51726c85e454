/* K-Medoids' iterations on the CPU, on a precomputed (B, N, N) distance matrix: one call for all of them.
 *
 * Built and loaded by kmedoids_cpu.py (plain C, no Python or torch headers: it compiles in about a
 * second), called through ctypes as the CPU kernel of the custom op tokenpool::kmedoids.
 *
 * Why our own kernel: torch's CPU index reductions (argmin, min with indices) ran 10x slower than the
 * plain minimum here, and the torch iterations took as long as the distance matrix itself at DeiT-S
 * size (docs/benchmarks.md); no library runs Voronoi K-Medoids with this tie and swap rule on a batch
 * of small problems.
 *
 * Semantics are those of clustering._kmedoids and of the brute-force reference in tests/, with the
 * same floating-point operations as the torch paths, so that the results are the same bits:
 *   - assignment: each token joins the medoid nearest to it, d[n, med[c]], ties to the lowest cluster
 *     index; then every medoid joins its own cluster;
 *   - update: the cost of token n as the medoid of its own cluster c is sum_{j in c} w_j d[j, n], added
 *     in increasing j from 0 (each product rounded before the add: build with -ffp-contract=off);
 *     each cluster's cheapest member (lowest token index on ties) replaces the medoid when its cost is
 *     below keep * the medoid's cost.
 * The update visits only the members of each cluster (sum over clusters of size^2 additions, where the
 * torch path reads all N^2 distances).
 *
 * Returns 0, or -1 when the workspace could not be allocated.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define DEFINE_KMEDOIDS(NAME, REAL)                                                                      \
    /* nearest medoid of every token (4 rows at a time: independent comparison chains), then each       \
       medoid into its own cluster */                                                                    \
    static void NAME##_assign(const REAL *d, const int64_t *med, int64_t *assign, int64_t n, int64_t k) { \
        int64_t i = 0;                                                                                   \
        for (; i + 4 <= n; i += 4) {                                                                     \
            const REAL *r0 = d + i * n, *r1 = r0 + n, *r2 = r1 + n, *r3 = r2 + n;                        \
            REAL v0 = r0[med[0]], v1 = r1[med[0]], v2 = r2[med[0]], v3 = r3[med[0]];                     \
            int64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;                                                      \
            for (int64_t c = 1; c < k; ++c) {                                                            \
                const int64_t m = med[c];                                                                \
                if (r0[m] < v0) { v0 = r0[m]; a0 = c; }                                                  \
                if (r1[m] < v1) { v1 = r1[m]; a1 = c; }                                                  \
                if (r2[m] < v2) { v2 = r2[m]; a2 = c; }                                                  \
                if (r3[m] < v3) { v3 = r3[m]; a3 = c; }                                                  \
            }                                                                                            \
            assign[i] = a0; assign[i + 1] = a1; assign[i + 2] = a2; assign[i + 3] = a3;                  \
        }                                                                                                \
        for (; i < n; ++i) {                                                                             \
            const REAL *row = d + i * n;                                                                 \
            REAL v = row[med[0]];                                                                        \
            int64_t a = 0;                                                                               \
            for (int64_t c = 1; c < k; ++c)                                                              \
                if (row[med[c]] < v) { v = row[med[c]]; a = c; }                                         \
            assign[i] = a;                                                                               \
        }                                                                                                \
        for (int64_t c = 0; c < k; ++c) assign[med[c]] = c;                                              \
    }                                                                                                    \
                                                                                                         \
    /* members of each cluster in increasing token order: members[start[c] .. start[c + 1]) */           \
    static void NAME##_members(const int64_t *assign, int64_t *start, int64_t *members, int64_t n,        \
                               int64_t k) {                                                              \
        memset(start, 0, (size_t)(k + 1) * sizeof(int64_t));                                             \
        for (int64_t i = 0; i < n; ++i) ++start[assign[i] + 1];                                          \
        for (int64_t c = 0; c < k; ++c) start[c + 1] += start[c];                                        \
        for (int64_t i = 0; i < n; ++i) members[start[assign[i]]++] = i;                                 \
        for (int64_t c = k; c > 0; --c) start[c] = start[c - 1]; /* the fill moved each start to the end */ \
        start[0] = 0;                                                                                    \
    }                                                                                                    \
                                                                                                         \
    /* the swap rule of every cluster, from the costs of its members */                                  \
    static void NAME##_update(const REAL *d, const REAL *w, int64_t *med, const int64_t *assign,         \
                              int64_t *start, int64_t *members, REAL *cost, int64_t n, int64_t k,        \
                              REAL keep) {                                                               \
        NAME##_members(assign, start, members, n, k);                                                    \
        for (int64_t c = 0; c < k; ++c) {                                                                \
            const int64_t *first = members + start[c], *last = members + start[c + 1];                   \
            REAL best_cost = 0;                                                                          \
            int64_t best = -1;                                                                           \
            for (const int64_t *p = first; p < last; ++p) {                                              \
                REAL acc = 0;                                                                            \
                if (w)                                                                                   \
                    for (const int64_t *q = first; q < last; ++q) acc += d[*q * n + *p] * w[*q];          \
                else                                                                                     \
                    for (const int64_t *q = first; q < last; ++q) acc += d[*q * n + *p];                 \
                cost[*p] = acc;                                                                          \
                if (best < 0 || acc < best_cost) { best_cost = acc; best = *p; }                         \
            }                                                                                            \
            const REAL current = cost[med[c]] * keep; /* the medoid is a member of its own cluster */    \
            if (best_cost < current) med[c] = best;                                                      \
        }                                                                                                \
    }                                                                                                    \
                                                                                                         \
    int NAME(const REAL *d, const REAL *w, const int64_t *med_in, int64_t *med_out, int64_t *assign,     \
             int64_t b, int64_t n, int64_t k, int64_t iters, double keep) {                              \
        int64_t *start = malloc((size_t)(k + 1) * sizeof(int64_t));                                      \
        int64_t *members = malloc((size_t)n * sizeof(int64_t));                                          \
        REAL *cost = malloc((size_t)n * sizeof(REAL));                                                   \
        if (!start || !members || !cost) {                                                               \
            free(start); free(members); free(cost);                                                      \
            return -1;                                                                                   \
        }                                                                                                \
        memcpy(med_out, med_in, (size_t)(b * k) * sizeof(int64_t));                                      \
        for (int64_t s = 0; s < b; ++s) {                                                                \
            const REAL *ds = d + s * n * n, *ws = w ? w + s * n : NULL;                                   \
            int64_t *ms = med_out + s * k, *as = assign + s * n;                                         \
            NAME##_assign(ds, ms, as, n, k);                                                             \
            for (int64_t it = 1; it < iters; ++it) {                                                     \
                NAME##_update(ds, ws, ms, as, start, members, cost, n, k, (REAL)keep);                   \
                NAME##_assign(ds, ms, as, n, k);                                                         \
            }                                                                                            \
        }                                                                                                \
        free(start); free(members); free(cost);                                                          \
        return 0;                                                                                        \
    }

DEFINE_KMEDOIDS(kmedoids_f32, float)
DEFINE_KMEDOIDS(kmedoids_f64, double)
