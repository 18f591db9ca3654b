/* e^x in float32 for the kernels, one body at every width: plain C (kv_exp1), AVX2 + FMA
 * (kv_exp8), AVX-512 (kv_exp16). Cephes' expf: x clamped to [-87, 88], n = round(x / ln 2),
 * r = x - n ln 2 (ln 2 in two parts), e^r by its degree-6 polynomial, times 2^n set in the
 * exponent field (n stays in -126 .. 127: a normal number). About 1 ulp; e^0 is exactly 1. */
#ifndef KVPLAY_VEXP_H
#define KVPLAY_VEXP_H
#include <stdint.h>
#include <string.h>
#include <math.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define KV_EXP_BODY(V, FMA, FNMA, MUL, ADD, SET1, ROUND, MIN, MAX, x, n, p)                      \
    do {                                                                                         \
        x = MIN(MAX(x, SET1(-87.0f)), SET1(88.0f));                                              \
        n = ROUND(MUL(x, SET1(1.44269504088896341f)));                                           \
        V r_ = FNMA(n, SET1(0.693359375f), x);                                                   \
        r_ = FNMA(n, SET1(-2.12194440e-4f), r_);                                                 \
        p = SET1(1.9875691500e-4f);                                                              \
        p = FMA(p, r_, SET1(1.3981999507e-3f));                                                  \
        p = FMA(p, r_, SET1(8.3334519073e-3f));                                                  \
        p = FMA(p, r_, SET1(4.1665795894e-2f));                                                  \
        p = FMA(p, r_, SET1(1.6666665459e-1f));                                                  \
        p = FMA(p, r_, SET1(5.0000001201e-1f));                                                  \
        p = FMA(p, MUL(r_, r_), ADD(r_, SET1(1.0f)));                                            \
    } while (0)

#define KV_S_FMA(a, b, c) fmaf(a, b, c)
#define KV_S_FNMA(a, b, c) fmaf(-(a), b, c)
#define KV_S_MUL(a, b) ((a) * (b))
#define KV_S_ADD(a, b) ((a) + (b))
#define KV_S_SET1(a) (a)
#define KV_S_MIN(a, b) ((a) < (b) ? (a) : (b))
#define KV_S_MAX(a, b) ((a) > (b) ? (a) : (b))

static inline float kv_exp1(float x) {
    float n, p;
    KV_EXP_BODY(float, KV_S_FMA, KV_S_FNMA, KV_S_MUL, KV_S_ADD, KV_S_SET1, nearbyintf, KV_S_MIN, KV_S_MAX, x, n, p);
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
#define KV_8_ROUND(a) _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
static inline __m256 kv_exp8(__m256 x) {
    __m256 n, p;
    KV_EXP_BODY(__m256, _mm256_fmadd_ps, _mm256_fnmadd_ps, _mm256_mul_ps, _mm256_add_ps, _mm256_set1_ps,
                KV_8_ROUND, _mm256_min_ps, _mm256_max_ps, x, n, p);
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

#if defined(__AVX512F__)
#define KV_16_ROUND(a) _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
static inline __m512 kv_exp16(__m512 x) {
    __m512 n, p;
    KV_EXP_BODY(__m512, _mm512_fmadd_ps, _mm512_fnmadd_ps, _mm512_mul_ps, _mm512_add_ps, _mm512_set1_ps,
                KV_16_ROUND, _mm512_min_ps, _mm512_max_ps, x, n, p);
    return _mm512_scalef_ps(p, n);
}
#endif
#endif
