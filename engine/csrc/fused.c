/* The element-wise work around a Llama-family layer's GEMMs, one pass each, float32, on CPU.
 *
 *   kvplay_rms_norm    x += delta (the residual, optional), out = x / rms(x) * w
 *   kvplay_silu_mul    out = silu(gate) * up, gate and up the two halves of one GEMM's row
 *   kvplay_rope_write  rotary on q and k, q into a packed buffer, k and v into the pool's slots
 *
 * Each token's row is computed by one thread in a fixed order (a row's result does not depend on
 * the other rows, their number or the thread count: deterministic mode runs them too). Rows are
 * split over OpenMP threads when there are enough of them to pay for the region.
 */
#include <stdint.h>
#include <math.h>
#include <string.h>
#include "vexp.h"

#define PAR_ROWS 16  /* fewer rows run on the calling thread alone */

static inline float rsum16(const float *p) {
    /* a fixed tree over 16 partial sums */
    float a[8], b[4];
    for (int i = 0; i < 8; i++) a[i] = p[i] + p[i + 8];
    for (int i = 0; i < 4; i++) b[i] = a[i] + a[i + 4];
    return (b[0] + b[2]) + (b[1] + b[3]);
}

static void rms_row(float *x, const float *delta, int64_t hidden, const float *w, float eps, float *out) {
    float part[16] = {0};
    int64_t h = 0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; h + 16 <= hidden; h += 16) {
        __m512 v = _mm512_loadu_ps(x + h);
        if (delta) {
            v = _mm512_add_ps(v, _mm512_loadu_ps(delta + h));
            _mm512_storeu_ps(x + h, v);
        }
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    _mm512_storeu_ps(part, acc);
#endif
    for (; h < hidden; h++) {
        float v = x[h];
        if (delta) x[h] = v = v + delta[h];
        part[h & 15] = fmaf(v, v, part[h & 15]);
    }
    float r = 1.0f / sqrtf(rsum16(part) / (float)hidden + eps);
    h = 0;
#if defined(__AVX512F__)
    __m512 rv = _mm512_set1_ps(r);
    for (; h + 16 <= hidden; h += 16)
        _mm512_storeu_ps(out + h, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + h), rv), _mm512_loadu_ps(w + h)));
#endif
    for (; h < hidden; h++) out[h] = x[h] * r * w[h];
}

/* rows of `hidden` floats, row i at x + i * x_stride (delta and out: i * hidden) */
void kvplay_rms_norm(float *x, int64_t x_stride, const float *delta, int64_t n, int64_t hidden,
                     const float *w, float eps, float *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (n >= PAR_ROWS && threads > 1)
    for (int64_t i = 0; i < n; i++)
        rms_row(x + i * x_stride, delta ? delta + i * hidden : 0, hidden, w, eps, out + i * hidden);
}

static inline float silu_one(float g) { return g / (1.0f + kv_exp1(-g)); }

/* gu row i at gu + i * 2 * inter: gate = its first half, up = its second; out row i at i * inter */
void kvplay_silu_mul(const float *gu, int64_t n, int64_t inter, float *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (n >= PAR_ROWS && threads > 1)
    for (int64_t i = 0; i < n; i++) {
        const float *g = gu + i * 2 * inter, *u = g + inter;
        float *o = out + i * inter;
        int64_t j = 0;
#if defined(__AVX512F__)
        __m512 one = _mm512_set1_ps(1.0f);
        for (; j + 16 <= inter; j += 16) {
            __m512 gv = _mm512_loadu_ps(g + j);
            __m512 e = kv_exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
            __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, e));
            _mm512_storeu_ps(o + j, _mm512_mul_ps(s, _mm512_loadu_ps(u + j)));
        }
#endif
        for (; j < inter; j++) o[j] = silu_one(g[j]) * u[j];
    }
}

/* x (dim floats) rotated: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1) */
static inline void rope_head(const float *x, const float *c, const float *s, int dim, float *y) {
    int half = dim / 2, i = 0;
#if defined(__AVX512F__)
    if ((half & 15) == 0) {
        for (; i < half; i += 16) {
            __m512 x1 = _mm512_loadu_ps(x + i), x2 = _mm512_loadu_ps(x + half + i);
            _mm512_storeu_ps(y + i, _mm512_fnmadd_ps(x2, _mm512_loadu_ps(s + i), _mm512_mul_ps(x1, _mm512_loadu_ps(c + i))));
            _mm512_storeu_ps(y + half + i, _mm512_fmadd_ps(x1, _mm512_loadu_ps(s + half + i),
                                                           _mm512_mul_ps(x2, _mm512_loadu_ps(c + half + i))));
        }
        return;
    }
#endif
    for (; i < half; i++) {
        float x1 = x[i], x2 = x[half + i];
        y[i] = fmaf(-x2, s[i], x1 * c[i]);
        y[half + i] = fmaf(x1, s[half + i], x2 * c[half + i]);
    }
}

/* qkv row t at qkv + t * qkv_stride: hq query heads, hk key heads, hk value heads of dim floats;
 * cos/sin row t at t * cs_stride (dim floats). q rotated into qout [n][hq][dim]; k rotated and v
 * copied to slot slots[t] of every kv head's pool (element (h, s, d) at h * pool_head + s * dim + d). */
void kvplay_rope_write(const float *qkv, int64_t n, int64_t qkv_stride, int hq, int hk, int dim,
                       const float *cos, const float *sin, int64_t cs_stride, const int64_t *slots,
                       float *kpool, float *vpool, int64_t pool_head, float *qout, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (n >= PAR_ROWS && threads > 1)
    for (int64_t t = 0; t < n; t++) {
        const float *row = qkv + t * qkv_stride, *c = cos + t * cs_stride, *s = sin + t * cs_stride;
        for (int h = 0; h < hq; h++)
            rope_head(row + (int64_t)h * dim, c, s, dim, qout + (t * hq + h) * dim);
        for (int h = 0; h < hk; h++) {
            int64_t at = h * pool_head + slots[t] * dim;
            rope_head(row + (int64_t)(hq + h) * dim, c, s, dim, kpool + at);
            memcpy(vpool + at, row + (int64_t)(hq + hk + h) * dim, sizeof(float) * (size_t)dim);
        }
    }
}
