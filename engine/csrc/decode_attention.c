/* Paged attention for decode rows (one new query token each), float32, on CPU.
 *
 * Every decode row of a step in one call per layer: each row's keys and values are read in place
 * from the layer's pool through its slot list (no gather, no padding, no per-row kernel call),
 * and the query heads that share a KV head (GQA) are computed together so each key and value is
 * loaded once for all of them. Work is split over (KV head, row) with OpenMP: the process's own
 * OpenMP runtime (torch's libgomp.so.1), so no second thread pool.
 *
 *   q      element (t, h, d) at q[t * q_tok + h * q_head + d]           (the step's packed tokens)
 *   kpool  element (kv head h, slot s, d) at kpool[h * pool_head + s * dim + d]; vpool the same
 *   out    element (t, h, d) at out[t * out_tok + h * out_head + d]
 *   row r: its query token row_tok[r], its keys slots[row_off[r] .. row_off[r] + row_len[r])
 *
 * Two passes per (row, KV head): scores for every key, then softmax and the weighted sum of
 * values. exp is a vectorisable polynomial (vexp.h: Cephes' expf, ~1 ulp), not libm's scalar expf.
 * Built by engine/native.py with the host's compiler; engine/paged.py falls back to torch's SDPA
 * where it is not built.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "vexp.h"

#define MAX_GROUP 16

/* q . k over dim floats */
static inline float dot(const float *restrict q, const float *restrict k, int dim) {
#if defined(__AVX512F__)
    if ((dim & 15) == 0) {
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k));
        for (int d = 16; d < dim; d += 16)
            a = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k + d), a);
        return _mm512_reduce_add_ps(a);
    }
#endif
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int d = 0; d < dim; d++) acc += q[d] * k[d];
    return acc;
}

/* o += p v over dim floats */
static inline void axpy(float *restrict o, float p, const float *restrict v, int dim) {
#if defined(__AVX512F__)
    if ((dim & 15) == 0) {
        __m512 b = _mm512_set1_ps(p);
        for (int d = 0; d < dim; d += 16)
            _mm512_storeu_ps(o + d, _mm512_fmadd_ps(b, _mm512_loadu_ps(v + d), _mm512_loadu_ps(o + d)));
        return;
    }
#endif
#pragma omp simd
    for (int d = 0; d < dim; d++) o[d] += p * v[d];
}


#if defined(__AVX512F__)
/* The AVX-512 path, for head dims that are a multiple of 16 (up to 256). */

/* Sixteen 16-lane partial sums -> one vector of their sums. v[s] lands in lane
 * 4 * (s % 4) + s / 4, so callers feed key 4 * (s % 4) + s / 4 into slot s (and get key L in
 * lane L). 45 shuffles and adds for 16 keys, where one horizontal sum per key costs ~8. */
static inline __m512 sum16(__m512 v[16]) {
    __m512 w[8], z[4], u[2];
    for (int i = 0; i < 8; i++)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(z[2 * i], z[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(z[2 * i], z[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x88), _mm512_shuffle_ps(u[0], u[1], 0xDD));
}

/* scores[g * len + j] = scale * q_g . k_j for the row's keys, 16 keys at a time for every head
 * of the group: each key is read from L2 once, then from L1 for the other heads */
static inline void scores16(const float *const *qs, int group, const float *restrict kh,
                            const int64_t *slots, int64_t len, int dim, float scale,
                            float *restrict scores) {
    int nv = dim / 16;
    __m512 sc = _mm512_set1_ps(scale);
    int64_t j = 0;
    for (; j + 16 <= len; j += 16) {
        const float *k[16];
        for (int s = 0; s < 16; s++) k[s] = kh + slots[j + 4 * (s % 4) + s / 4] * dim;
        for (int g = 0; g < group; g++) {
            const float *q = qs[g];
            __m512 v[16];
            for (int s = 0; s < 16; s++) v[s] = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k[s]));
            for (int c = 1; c < nv; c++) {
                __m512 qc = _mm512_loadu_ps(q + 16 * c);
                for (int s = 0; s < 16; s++) v[s] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(k[s] + 16 * c), v[s]);
            }
            _mm512_storeu_ps(scores + g * len + j, _mm512_mul_ps(sum16(v), sc));
        }
    }
    for (; j < len; j++) {
        const float *k = kh + slots[j] * dim;
        for (int g = 0; g < group; g++) {
            const float *q = qs[g];
            __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k));
            for (int c = 1; c < nv; c++) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * c), _mm512_loadu_ps(k + 16 * c), a);
            scores[g * len + j] = _mm512_reduce_add_ps(a) * scale;
        }
    }
}

/* scores -> e^(score - max) in place; returns their sum */
static inline float softmax16(float *restrict s, int64_t len) {
    __m512 m = _mm512_set1_ps(-3.4e38f);
    int64_t j = 0;
    for (; j + 16 <= len; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + j));
    float mx = _mm512_reduce_max_ps(m);
    for (; j < len; j++) mx = s[j] > mx ? s[j] : mx;
    __m512 mv = _mm512_set1_ps(mx), sum = _mm512_setzero_ps();
    for (j = 0; j + 16 <= len; j += 16) {
        __m512 e = kv_exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv));
        _mm512_storeu_ps(s + j, e);
        sum = _mm512_add_ps(sum, e);
    }
    if (j < len) {
        __mmask16 k = (__mmask16)((1u << (len - j)) - 1);
        __m512 e = kv_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), mv));
        _mm512_mask_storeu_ps(s + j, k, e);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, e));
    }
    return _mm512_reduce_add_ps(sum);
}

/* o_g = sum_j p_gj v_j for G heads over one 64-float (4-vector) chunk of the dims: the
 * accumulators stay in registers (G is a constant in each instance) */
static inline __attribute__((always_inline)) void values_chunk(
        const float *restrict vh, const int64_t *slots, int64_t len, int dim, int c0, int nc,
        const float *const *p, float *const *o, float *const inv, const int G) {
    __m512 acc[4][4];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < 4; c++) acc[g][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < len; j++) {
        const float *v = vh + slots[j] * dim + 16 * c0;
        __m512 vv[4];
        for (int c = 0; c < 4; c++) vv[c] = c < nc ? _mm512_loadu_ps(v + 16 * c) : _mm512_setzero_ps();
        for (int g = 0; g < G; g++) {
            __m512 b = _mm512_set1_ps(p[g][j]);
            for (int c = 0; c < 4; c++) acc[g][c] = _mm512_fmadd_ps(b, vv[c], acc[g][c]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < nc; c++)
            _mm512_storeu_ps(o[g] + 16 * (c0 + c), _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv[g])));
}

static void task16(const float *const *qs, const float *kh, const float *vh, const int64_t *slots,
                   int64_t len, int group, int dim, float scale, float *scores, float *const *os) {
    float inv[MAX_GROUP];
    const float *ps[MAX_GROUP];
    scores16(qs, group, kh, slots, len, dim, scale, scores);
    for (int g = 0; g < group; g++) {
        ps[g] = scores + g * len;
        inv[g] = 1.0f / softmax16(scores + g * len, len);
    }
    int nv = dim / 16;
    for (int g0 = 0; g0 < group; g0 += 4) {
        int G = group - g0 < 4 ? group - g0 : 4;
        for (int c0 = 0; c0 < nv; c0 += 4) {
            int nc = nv - c0 < 4 ? nv - c0 : 4;
            switch (G) {  /* one instance per head count: the accumulators in registers */
            case 1: values_chunk(vh, slots, len, dim, c0, nc, ps + g0, os + g0, inv + g0, 1); break;
            case 2: values_chunk(vh, slots, len, dim, c0, nc, ps + g0, os + g0, inv + g0, 2); break;
            case 3: values_chunk(vh, slots, len, dim, c0, nc, ps + g0, os + g0, inv + g0, 3); break;
            default: values_chunk(vh, slots, len, dim, c0, nc, ps + g0, os + g0, inv + g0, 4); break;
            }
        }
    }
}
#endif

static void one_task(const float *q, int64_t q_tok, int64_t q_head, const float *kpool,
                     const float *vpool, int64_t pool_head, float *out, int64_t out_tok,
                     int64_t out_head, const int64_t *slots, int64_t len, int64_t tok, int kvh,
                     int group, int dim, float scale, float *scores) {
    const float *kh = kpool + kvh * pool_head;
    const float *vh = vpool + kvh * pool_head;
    const float *qs[MAX_GROUP];
    for (int g = 0; g < group; g++) qs[g] = q + tok * q_tok + (int64_t)(kvh * group + g) * q_head;
#if defined(__AVX512F__)
    if ((dim & 15) == 0 && dim <= 256) {
        float *os[MAX_GROUP];
        for (int g = 0; g < group; g++) os[g] = out + tok * out_tok + (int64_t)(kvh * group + g) * out_head;
        task16(qs, kh, vh, slots, len, group, dim, scale, scores, os);
        return;
    }
#endif
    /* scores[g * len + j] = scale * q_g . k_j */
    for (int64_t j = 0; j < len; j++) {
        const float *k = kh + slots[j] * dim;
        for (int g = 0; g < group; g++) scores[g * len + j] = dot(qs[g], k, dim) * scale;
    }
    float sums[MAX_GROUP];
    for (int g = 0; g < group; g++) {
        float *s = scores + g * len;
        float m = s[0];
        for (int64_t j = 1; j < len; j++) m = s[j] > m ? s[j] : m;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < len; j++) {
            float e = kv_exp1(s[j] - m);
            s[j] = e;
            sum += e;
        }
        sums[g] = sum;
        float *o = out + tok * out_tok + (int64_t)(kvh * group + g) * out_head;
        memset(o, 0, sizeof(float) * dim);
    }
    /* out_g = sum_j p_gj v_j / sum_j p_gj, every value row read once for the whole group */
    for (int64_t j = 0; j < len; j++) {
        const float *v = vh + slots[j] * dim;
        for (int g = 0; g < group; g++)
            axpy(out + tok * out_tok + (int64_t)(kvh * group + g) * out_head, scores[g * len + j], v, dim);
    }
    for (int g = 0; g < group; g++) {
        float inv = 1.0f / sums[g];
        float *o = out + tok * out_tok + (int64_t)(kvh * group + g) * out_head;
#pragma omp simd
        for (int d = 0; d < dim; d++) o[d] *= inv;
    }
}

/* Returns 0; -1 when a work buffer could not be allocated, -2 for a head layout it does not
 * take (the caller then computes these rows itself: what was written is overwritten). */
int kvplay_decode_attention(const float *q, int64_t q_tok, int64_t q_head, const float *kpool,
                            const float *vpool, int64_t pool_head, float *out, int64_t out_tok,
                            int64_t out_head, const int64_t *slots, const int64_t *row_off,
                            const int64_t *row_len, const int64_t *row_tok, int64_t rows,
                            int heads, int kv_heads, int dim, float scale, int threads) {
    int group = heads / kv_heads;
    if (group < 1 || group > MAX_GROUP || heads % kv_heads) return -2;
    int64_t longest = 0;
    for (int64_t r = 0; r < rows; r++) longest = row_len[r] > longest ? row_len[r] : longest;
    int64_t tasks = rows * kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)(group * longest + 1));
        /* every thread meets the loop (a work-sharing construct), with or without its buffer */
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            if (!scores) {
                failed = 1;
                continue;
            }
            /* KV head major: the rows of one head run back to back, so rows sharing prefix
             * blocks find them still in cache */
            int kvh = (int)(t / rows);
            int64_t r = t % rows;
            one_task(q, q_tok, q_head, kpool, vpool, pool_head, out, out_tok, out_head,
                     slots + row_off[r], row_len[r], row_tok[r], kvh, group, dim, scale, scores);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
