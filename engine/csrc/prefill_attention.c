/* Paged causal attention for prompt chunks (rows of one or more new query tokens), float32, CPU.
 *
 * Each row's keys and values are read in place from the layer's pool through its slot list (no
 * gather, no mask tensor): query i of a row sits at position past + i and sees keys 0 .. past + i,
 * the cached blocks before the chunk and the chunk itself up to the query.
 *
 *   q      element (t, h, d) at q[t * q_tok + h * q_head + d]           (the step's packed tokens)
 *   kpool  element (kv head h, slot s, d) at kpool[h * pool_head + s * dim + d]; vpool the same
 *   out    element (t, h, d) at out[t * out_tok + h * out_head + d]
 *   row r: keys slots[row_off[r] .. row_off[r] + row_len[r]), its row_len[r] - row_past[r] queries
 *          are the tokens row_tok[r] .. (positions row_past[r] ..)
 *
 * Layout: a task is (KV head, row, block of query tokens). Its queries for every head of the KV
 * head's group are the lanes of up to four 16-float vectors (lane = token x group head), so a
 * key's elements are broadcast against every query at once and the softmax runs down the lanes:
 * no horizontal sums, no transposed keys. Keys go in tiles of 16 at absolute positions (0-15,
 * 16-31, ...) with an online softmax across tiles.
 *
 * Every lane runs the same sequence of operations whatever the other lanes hold: a query's scores
 * are one FMA chain over the head dim, its tile maximum, exponentials and running sum follow the
 * key order, and a key it may not see weighs exactly 0. So a query's result depends only on its
 * own vector and its own keys — not on the chunk it came in, the other rows of the step, or the
 * thread count — which is what deterministic mode needs (engine/paged.py runs every row of a
 * deterministic step here, decode rows included).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include "vexp.h"

#define LANES 16
#define MAX_V 4          /* vectors of query lanes per task: at most 64 (token, head) pairs */
#define TILE 16          /* keys per tile */
#define MAX_GROUP_P 16

/* query tokens per task for a group of G query heads per KV head */
static inline int64_t q_block(int group) { return group <= 4 ? 16 : (LANES * MAX_V) / group; }

/* The lane vector (16 floats), the lane positions and a lane mask, per instruction set: AVX-512
 * (one register), AVX2 + FMA (two), or plain C. ACC: lane vectors of accumulators a register
 * file holds (the blocking below). */
#if defined(__AVX512F__)
#define ACC 24
typedef __m512 vf;
typedef __m512i vpos;
typedef __mmask16 vm;
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vf x) { _mm512_storeu_ps(p, x); }
static inline vf vbcast(float x) { return _mm512_set1_ps(x); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vzero(void) { return _mm512_setzero_ps(); }

static inline vf vexp(vf x) { return kv_exp16(x); }
static inline vpos vload_pos(const int32_t *p) { return _mm512_loadu_si512((const void *)p); }
/* lanes whose position is >= key position j */
static inline vm vvisible(vpos pos, int64_t j) {
    return _mm512_cmp_epi32_mask(pos, _mm512_set1_epi32((int32_t)j), _MM_CMPINT_NLT);
}
static inline vm vnone(void) { return 0; }
static inline vf vmask_neg_inf(vm keep, vf x) { return _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), keep, x); }
static inline vf vmaskz(vm keep, vf x) { return _mm512_maskz_mov_ps(keep, x); }
#elif defined(__AVX2__) && defined(__FMA__)
#define ACC 6
typedef struct { __m256 a, b; } vf;
typedef struct { __m256i a, b; } vpos;
typedef struct { __m256 a, b; } vm;
static inline vf vload(const float *p) { return (vf){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void vstore(float *p, vf x) { _mm256_storeu_ps(p, x.a); _mm256_storeu_ps(p + 8, x.b); }
static inline vf vbcast(float x) { __m256 v = _mm256_set1_ps(x); return (vf){v, v}; }
static inline vf vfma(vf a, vf b, vf c) { return (vf){_mm256_fmadd_ps(a.a, b.a, c.a), _mm256_fmadd_ps(a.b, b.b, c.b)}; }
static inline vf vmax(vf a, vf b) { return (vf){_mm256_max_ps(a.a, b.a), _mm256_max_ps(a.b, b.b)}; }
static inline vf vadd(vf a, vf b) { return (vf){_mm256_add_ps(a.a, b.a), _mm256_add_ps(a.b, b.b)}; }
static inline vf vsub(vf a, vf b) { return (vf){_mm256_sub_ps(a.a, b.a), _mm256_sub_ps(a.b, b.b)}; }
static inline vf vmul(vf a, vf b) { return (vf){_mm256_mul_ps(a.a, b.a), _mm256_mul_ps(a.b, b.b)}; }
static inline vf vzero(void) { return (vf){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline vf vexp(vf x) { return (vf){kv_exp8(x.a), kv_exp8(x.b)}; }
static inline vpos vload_pos(const int32_t *p) {
    return (vpos){_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)(p + 8))};
}
static inline vm vvisible(vpos pos, int64_t j) {
    __m256i jm1 = _mm256_set1_epi32((int32_t)j - 1);  /* pos >= j  <=>  pos > j - 1 */
    return (vm){_mm256_castsi256_ps(_mm256_cmpgt_epi32(pos.a, jm1)), _mm256_castsi256_ps(_mm256_cmpgt_epi32(pos.b, jm1))};
}
static inline vm vnone(void) { return (vm){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline vf vmask_neg_inf(vm keep, vf x) {
    __m256 ninf = _mm256_set1_ps(-INFINITY);
    return (vf){_mm256_blendv_ps(ninf, x.a, keep.a), _mm256_blendv_ps(ninf, x.b, keep.b)};
}
static inline vf vmaskz(vm keep, vf x) { return (vf){_mm256_and_ps(keep.a, x.a), _mm256_and_ps(keep.b, x.b)}; }
#else
/* Plain C lanes: the same operations, one lane at a time. */
#define ACC 4
typedef struct { float f[LANES]; } vf;
typedef struct { int32_t i[LANES]; } vpos;
typedef uint32_t vm;
static inline vf vload(const float *p) { vf r; memcpy(r.f, p, sizeof r.f); return r; }
static inline void vstore(float *p, vf x) { memcpy(p, x.f, sizeof x.f); }
static inline vf vbcast(float x) { vf r; for (int i = 0; i < LANES; i++) r.f[i] = x; return r; }
static inline vf vfma(vf a, vf b, vf c) { vf r; for (int i = 0; i < LANES; i++) r.f[i] = fmaf(a.f[i], b.f[i], c.f[i]); return r; }
static inline vf vmax(vf a, vf b) { vf r; for (int i = 0; i < LANES; i++) r.f[i] = a.f[i] > b.f[i] ? a.f[i] : b.f[i]; return r; }
static inline vf vadd(vf a, vf b) { vf r; for (int i = 0; i < LANES; i++) r.f[i] = a.f[i] + b.f[i]; return r; }
static inline vf vsub(vf a, vf b) { vf r; for (int i = 0; i < LANES; i++) r.f[i] = a.f[i] - b.f[i]; return r; }
static inline vf vmul(vf a, vf b) { vf r; for (int i = 0; i < LANES; i++) r.f[i] = a.f[i] * b.f[i]; return r; }
static inline vf vzero(void) { return vbcast(0.0f); }
static inline vf vexp(vf x) { vf r; for (int i = 0; i < LANES; i++) r.f[i] = kv_exp1(x.f[i]); return r; }
static inline vpos vload_pos(const int32_t *p) { vpos r; memcpy(r.i, p, sizeof r.i); return r; }
static inline vm vvisible(vpos pos, int64_t j) {
    vm m = 0;
    for (int i = 0; i < LANES; i++) m |= (uint32_t)(pos.i[i] >= j) << i;
    return m;
}
static inline vm vnone(void) { return 0; }
static inline vf vmask_neg_inf(vm keep, vf x) {
    for (int i = 0; i < LANES; i++) if (!((keep >> i) & 1)) x.f[i] = -INFINITY;
    return x;
}
static inline vf vmaskz(vm keep, vf x) {
    for (int i = 0; i < LANES; i++) if (!((keep >> i) & 1)) x.f[i] = 0.0f;
    return x;
}
#endif

/* keys a score block takes (KB) and dims a value block takes (DC) for V lane vectors: KB x V
 * accumulators and DC x V plus V in registers */
static inline int kb_for(int V) {
    int kb = ACC / V;
    return kb >= 16 ? 16 : kb >= 8 ? 8 : kb >= 4 ? 4 : kb >= 2 ? 2 : 1;
}
static inline int dc_for(int V) {
    int dc = ACC / V;
    return dc >= 8 ? 8 : dc >= 4 ? 4 : dc >= 2 ? 2 : 1;
}

/* scores s[j][v] = sum_d k_j[d] q[d][v] for KB keys from key pointers kp, V vectors of lanes;
 * one FMA chain per (key, lane) over d in order */
static inline __attribute__((always_inline)) void scores_kb(
        const float *const *kp, const float *qt, int dim, float *s, const int V, const int KB) {
    vf acc[16][MAX_V];
    for (int j = 0; j < KB; j++)
        for (int v = 0; v < V; v++) acc[j][v] = vzero();
    for (int d = 0; d < dim; d++) {
        vf q[MAX_V];
        for (int v = 0; v < V; v++) q[v] = vload(qt + ((int64_t)d * V + v) * LANES);
        for (int j = 0; j < KB; j++) {
            vf k = vbcast(kp[j][d]);
            for (int v = 0; v < V; v++) acc[j][v] = vfma(k, q[v], acc[j][v]);
        }
    }
    for (int j = 0; j < KB; j++)
        for (int v = 0; v < V; v++) vstore(s + ((int64_t)j * V + v) * LANES, acc[j][v]);
}

/* o[d][v] = o[d][v] * alpha[v] + sum_j p[j][v] v_j[d], j in key order, DC dims at a time */
static inline __attribute__((always_inline)) void values_dc(
        const float *const *vp, int kn, const float *p, const vf *alpha, float *o, int d0,
        const int V, const int DC) {
    vf acc[16][MAX_V];
    for (int c = 0; c < DC; c++)
        for (int v = 0; v < V; v++)
            acc[c][v] = vmul(vload(o + ((int64_t)(d0 + c) * V + v) * LANES), alpha[v]);
    for (int j = 0; j < kn; j++) {
        vf pj[MAX_V];
        for (int v = 0; v < V; v++) pj[v] = vload(p + ((int64_t)j * V + v) * LANES);
        for (int c = 0; c < DC; c++) {
            vf x = vbcast(vp[j][d0 + c]);
            for (int v = 0; v < V; v++) acc[c][v] = vfma(x, pj[v], acc[c][v]);
        }
    }
    for (int c = 0; c < DC; c++)
        for (int v = 0; v < V; v++) vstore(o + ((int64_t)(d0 + c) * V + v) * LANES, acc[c][v]);
}

static inline __attribute__((always_inline)) void tile_scores(
        const float *const *kp, int kn, const float *qt, int dim, float *s, const int V) {
    /* keys in groups that keep KB x V accumulators in registers; a partial tile's missing keys
     * are computed against its first key (finite) and masked out by the caller */
    const float *k16[TILE];
    for (int j = 0; j < TILE; j++) k16[j] = kp[j < kn ? j : 0];
    const int KB = kb_for(V);
    for (int j = 0; j < TILE; j += KB) scores_kb(k16 + j, qt, dim, s + (int64_t)j * V * LANES, V, KB);
}

static inline __attribute__((always_inline)) void tile_values(
        const float *const *vp, int kn, const float *p, const vf *alpha, float *o, int dim, const int V) {
    const int DC = dc_for(V);
    int d = 0;
    for (; d + DC <= dim; d += DC) values_dc(vp, kn, p, alpha, o, d, V, DC);
    for (; d < dim; d++) values_dc(vp, kn, p, alpha, o, d, V, 1);
}

static inline __attribute__((always_inline)) void run_task(
        const float *kh, const float *vh, const int64_t *slots, int64_t n_keys, const int32_t *pos,
        int dim, float *qt, float *o, float *s, const int V) {
    vf m[MAX_V], l[MAX_V];
    for (int v = 0; v < V; v++) { m[v] = vbcast(-INFINITY); l[v] = vzero(); }
    memset(o, 0, sizeof(float) * (size_t)dim * V * LANES);
    vpos posv[MAX_V];
    for (int v = 0; v < V; v++) posv[v] = vload_pos(pos + v * LANES);
    for (int64_t j0 = 0; j0 < n_keys; j0 += TILE) {
        int kn = n_keys - j0 < TILE ? (int)(n_keys - j0) : TILE;
        const float *kp[TILE], *vp[TILE];
        for (int j = 0; j < kn; j++) {
            kp[j] = kh + slots[j0 + j] * dim;
            vp[j] = vh + slots[j0 + j] * dim;
        }
        tile_scores(kp, kn, qt, dim, s, V);
        vf alpha[MAX_V];
        for (int v = 0; v < V; v++) {
            vm keep[TILE];
            for (int j = 0; j < TILE; j++) keep[j] = j < kn ? vvisible(posv[v], j0 + j) : vnone();
            vf mt = vbcast(-INFINITY);
            for (int j = 0; j < kn; j++)
                mt = vmax(mt, vmask_neg_inf(keep[j], vload(s + ((int64_t)j * V + v) * LANES)));
            vf mn = vmax(m[v], mt);
            alpha[v] = vexp(vsub(m[v], mn));
            m[v] = mn;
            vf sum = vzero();
            for (int j = 0; j < kn; j++) {
                float *sj = s + ((int64_t)j * V + v) * LANES;
                vf pj = vmaskz(keep[j], vexp(vsub(vload(sj), mn)));
                vstore(sj, pj);
                sum = vadd(sum, pj);
            }
            l[v] = vadd(vmul(l[v], alpha[v]), sum);
        }
        tile_values(vp, kn, s, alpha, o, dim, V);
    }
    /* o / l, in place */
    for (int v = 0; v < V; v++) {
        float lv[LANES];
        vstore(lv, l[v]);
        for (int i = 0; i < LANES; i++) lv[i] = 1.0f / lv[i];
        vf inv = vload(lv);
        for (int d = 0; d < dim; d++) {
            float *od = o + ((int64_t)d * V + v) * LANES;
            vstore(od, vmul(vload(od), inv));
        }
    }
}

/* Returns 0; -1 when a work buffer could not be allocated, -2 for a head layout it does not take. */
int kvplay_prefill_attention(const float *q, int64_t q_tok, int64_t q_head, const float *kpool,
                             const float *vpool, int64_t pool_head, float *out, int64_t out_tok,
                             int64_t out_head, const int64_t *slots, const int64_t *row_off,
                             const int64_t *row_len, const int64_t *row_past, const int64_t *row_tok,
                             int64_t rows, int heads, int kv_heads, int dim, float scale, int threads) {
    if (kv_heads < 1 || heads % kv_heads || dim < 1) return -2;
    int group = heads / kv_heads;
    if (group > MAX_GROUP_P) return -2;
    int64_t qb = q_block(group);
    /* tasks: (row, query block) for every KV head, heaviest first (the last blocks see most keys) */
    int64_t blocks = 0;
    for (int64_t r = 0; r < rows; r++) {
        int64_t n = row_len[r] - row_past[r];
        if (n < 1 || row_len[r] > INT32_MAX / 2) return -2;
        blocks += (n + qb - 1) / qb;
    }
    int64_t *task_row = malloc(sizeof(int64_t) * 2 * (size_t)(blocks ? blocks : 1));
    if (!task_row) return -1;
    int64_t *task_i0 = task_row + blocks;
    {
        int64_t b = 0;
        for (int64_t r = 0; r < rows; r++) {
            int64_t n = row_len[r] - row_past[r];
            for (int64_t i0 = ((n - 1) / qb) * qb; i0 >= 0; i0 -= qb) { task_row[b] = r; task_i0[b] = i0; b++; }
        }
    }
    int64_t tasks = blocks * kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        size_t vec = (size_t)MAX_V * LANES;
        /* queries [dim][V][16], outputs [dim][V][16], scores [TILE][V][16]; a multiple of 64 bytes */
        size_t bytes = sizeof(float) * vec * (2 * (size_t)dim + TILE);
        float *buf = aligned_alloc(64, (bytes + 63) / 64 * 64);
        int32_t pos[MAX_V * LANES];
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            if (!buf) { failed = 1; continue; }
            int64_t b = t / kv_heads;
            int kvh = (int)(t % kv_heads);
            int64_t r = task_row[b], i0 = task_i0[b];
            int64_t past = row_past[r], n = row_len[r] - past;
            int64_t nq = n - i0 < qb ? n - i0 : qb;
            int lanes = (int)(nq * group);
            int V = (lanes + LANES - 1) / LANES;
            float *qt = buf, *o = buf + vec * dim, *s = buf + 2 * vec * dim;
            /* lane (i, g) = i * group + g: token i0 + i of the block, head kvh * group + g */
            for (int l = 0; l < V * LANES; l++) pos[l] = INT32_MAX;  /* idle lanes see every key */
            memset(qt, 0, sizeof(float) * (size_t)dim * V * LANES);
            for (int64_t i = 0; i < nq; i++) {
                const float *qi = q + (row_tok[r] + i0 + i) * q_tok;
                for (int g = 0; g < group; g++) {
                    int l = (int)(i * group + g);
                    const float *qh = qi + (int64_t)(kvh * group + g) * q_head;
                    pos[l] = (int32_t)(past + i0 + i);
                    for (int d = 0; d < dim; d++) qt[((int64_t)d * V + l / LANES) * LANES + l % LANES] = qh[d] * scale;
                }
            }
            int64_t n_keys = past + i0 + nq;  /* keys up to the block's last query */
            const float *kh = kpool + kvh * pool_head, *vh = vpool + kvh * pool_head;
            const int64_t *rs = slots + row_off[r];
            switch (V) {
            case 1: run_task(kh, vh, rs, n_keys, pos, dim, qt, o, s, 1); break;
            case 2: run_task(kh, vh, rs, n_keys, pos, dim, qt, o, s, 2); break;
            case 3: run_task(kh, vh, rs, n_keys, pos, dim, qt, o, s, 3); break;
            default: run_task(kh, vh, rs, n_keys, pos, dim, qt, o, s, 4); break;
            }
            for (int64_t i = 0; i < nq; i++) {
                float *oi = out + (row_tok[r] + i0 + i) * out_tok;
                for (int g = 0; g < group; g++) {
                    int l = (int)(i * group + g);
                    float *oh = oi + (int64_t)(kvh * group + g) * out_head;
                    for (int d = 0; d < dim; d++) oh[d] = o[((int64_t)d * V + l / LANES) * LANES + l % LANES];
                }
            }
        }
        free(buf);
    }
    free(task_row);
    return failed ? -1 : 0;
}
