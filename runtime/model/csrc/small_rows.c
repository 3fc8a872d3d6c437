/* y = x W^T in float32 for a few rows of x (a decode step's tokens), on x86-64 with AVX2 + FMA
 * (AVX-512 where the CPU has it, same sums).
 *
 * Why: a decode step multiplies a few activation rows (a tree's nodes) by every weight matrix. The cost is reading
 * the weights from memory, so a product over R rows should cost little more than over one row.
 * BLAS libraries tile for large matrices; for 2..8 rows they pack and re-read, and one verify
 * forward of a 3-node tree costs ~1.5x a one-token forward instead of ~1.1x.
 *
 * Layout: W [N, K] is packed once as panels of 16 output rows, P [N/16][K][16] (see
 * runtime/small_rows.py), so a panel streams contiguously. For each panel and each block of up to
 * 6 input rows the micro-kernel keeps 6 x 16 partial sums in registers while it walks k: one pass
 * over the panel serves all the rows (the panel stays in cache for the next block of rows).
 *
 * Row invariance: every output y[r, n] is summed in one fixed order whatever R is and whichever
 * block or thread computes it: a chain of fused multiply-adds over each block of KBLOCK k's in
 * order, started from 0, and the blocks' sums added in order. (One chain over all of K would be
 * simpler, but its float32 rounding error grows with K: ~1.2e-4 on SmolLM2's logits against
 * transformers, where BLAS's blocked sums stay below 1e-4.) So a row's
 * result is bit-identical in a 1-row and an R-row call; the runtime's exact (row-invariant) mode
 * relies on it. Build without -ffast-math (which would allow reassociation). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define PANEL 16

/* Weights are read once per call, straight from memory: the hardware prefetcher alone falls behind
 * once a k step does several rows' work (2-12 rows cost up to 1.7x one row on the lm_head), so each
 * k step asks for the panel's line PREFETCH steps ahead (one 64-byte line per k per panel). */
#define PREFETCH 32

#define KBLOCK 64 /* k per partial sum: blocked sums keep float32 rounding near BLAS's (see above) */

#define MICRO_KERNEL(RB)                                                                        \
    static void rows_##RB(const float *x, const float *p, float *y, int64_t K, int64_t N,      \
                          int64_t r0, int64_t n0) {                                            \
        float total[RB][PANEL];                                                                 \
        for (int i = 0; i < RB; i++)                                                            \
            for (int j = 0; j < PANEL; j++) total[i][j] = 0.0f;                                 \
        const float *xr = x + r0 * K;                                                           \
        for (int64_t k0 = 0; k0 < K; k0 += KBLOCK) {                                            \
            int64_t k1 = k0 + KBLOCK < K ? k0 + KBLOCK : K;                                     \
            __m256 lo[RB], hi[RB];                                                              \
            for (int i = 0; i < RB; i++) {                                                      \
                lo[i] = _mm256_setzero_ps();                                                    \
                hi[i] = _mm256_setzero_ps();                                                    \
            }                                                                                   \
            for (int64_t k = k0; k < k1; k++) {                                                 \
                _mm_prefetch((const char *)(p + PANEL * (k + PREFETCH)), _MM_HINT_T0);           \
                __m256 w_lo = _mm256_loadu_ps(p + PANEL * k);                                   \
                __m256 w_hi = _mm256_loadu_ps(p + PANEL * k + 8);                               \
                for (int i = 0; i < RB; i++) {                                                  \
                    __m256 b = _mm256_broadcast_ss(xr + i * K + k);                             \
                    lo[i] = _mm256_fmadd_ps(w_lo, b, lo[i]);                                    \
                    hi[i] = _mm256_fmadd_ps(w_hi, b, hi[i]);                                    \
                }                                                                               \
            }                                                                                   \
            for (int i = 0; i < RB; i++) {                                                      \
                _mm256_storeu_ps(total[i], _mm256_add_ps(_mm256_loadu_ps(total[i]), lo[i]));   \
                _mm256_storeu_ps(total[i] + 8, _mm256_add_ps(_mm256_loadu_ps(total[i] + 8), hi[i])); \
            }                                                                                   \
        }                                                                                       \
        for (int i = 0; i < RB; i++)                                                            \
            for (int j = 0; j < PANEL; j++) y[(r0 + i) * N + n0 + j] = total[i][j];             \
    }

MICRO_KERNEL(1)
MICRO_KERNEL(2)
MICRO_KERNEL(3)
MICRO_KERNEL(4)
MICRO_KERNEL(5)
MICRO_KERNEL(6)

typedef void (*micro_kernel)(const float *, const float *, float *, int64_t, int64_t, int64_t, int64_t);
static const micro_kernel BY_ROWS[7] = {0, rows_1, rows_2, rows_3, rows_4, rows_5, rows_6};

/* The same products with AVX-512 where the CPU has it: two panels (32 outputs) at a time, up to
 * 12 rows, 24 accumulators in zmm registers, so a pass over the weights serves twice as many rows
 * and each x broadcast feeds two multiply-adds. Each output lane runs the very chain of the AVX2
 * kernel (k in order within a KBLOCK, blocks added in order), so the results are bit-identical to
 * it: the choice of instruction set changes speed, never a token. */
#define WIDE_ROWS 12
#define MICRO_KERNEL_512(RB)                                                                    \
    __attribute__((target("avx512f,fma"))) static void wide_##RB(                               \
        const float *x, const float *p, float *y, int64_t K, int64_t N, int64_t r0, int64_t n0) { \
        float total[RB][2 * PANEL];                                                             \
        for (int i = 0; i < RB; i++)                                                            \
            for (int j = 0; j < 2 * PANEL; j++) total[i][j] = 0.0f;                             \
        const float *xr = x + r0 * K, *q = p + PANEL * K; /* q: the second panel */            \
        for (int64_t k0 = 0; k0 < K; k0 += KBLOCK) {                                            \
            int64_t k1 = k0 + KBLOCK < K ? k0 + KBLOCK : K;                                     \
            __m512 a[RB], b[RB];                                                                \
            for (int i = 0; i < RB; i++) {                                                      \
                a[i] = _mm512_setzero_ps();                                                     \
                b[i] = _mm512_setzero_ps();                                                     \
            }                                                                                   \
            for (int64_t k = k0; k < k1; k++) {                                                 \
                _mm_prefetch((const char *)(p + PANEL * (k + PREFETCH)), _MM_HINT_T0);           \
                _mm_prefetch((const char *)(q + PANEL * (k + PREFETCH)), _MM_HINT_T0);           \
                __m512 wa = _mm512_loadu_ps(p + PANEL * k), wb = _mm512_loadu_ps(q + PANEL * k); \
                for (int i = 0; i < RB; i++) {                                                  \
                    __m512 s = _mm512_set1_ps(xr[i * K + k]);                                   \
                    a[i] = _mm512_fmadd_ps(wa, s, a[i]);                                        \
                    b[i] = _mm512_fmadd_ps(wb, s, b[i]);                                        \
                }                                                                               \
            }                                                                                   \
            for (int i = 0; i < RB; i++) {                                                      \
                _mm512_storeu_ps(total[i], _mm512_add_ps(_mm512_loadu_ps(total[i]), a[i]));   \
                _mm512_storeu_ps(total[i] + PANEL, _mm512_add_ps(_mm512_loadu_ps(total[i] + PANEL), b[i])); \
            }                                                                                   \
        }                                                                                       \
        for (int i = 0; i < RB; i++) {                                                          \
            for (int j = 0; j < PANEL; j++) y[(r0 + i) * N + n0 + j] = total[i][j];             \
            for (int j = 0; j < PANEL; j++) y[(r0 + i) * N + n0 + PANEL + j] = total[i][PANEL + j]; \
        }                                                                                       \
    }

MICRO_KERNEL_512(1)
MICRO_KERNEL_512(2)
MICRO_KERNEL_512(3)
MICRO_KERNEL_512(4)
MICRO_KERNEL_512(5)
MICRO_KERNEL_512(6)
MICRO_KERNEL_512(7)
MICRO_KERNEL_512(8)
MICRO_KERNEL_512(9)
MICRO_KERNEL_512(10)
MICRO_KERNEL_512(11)
MICRO_KERNEL_512(12)

static const micro_kernel WIDE_BY_ROWS[WIDE_ROWS + 1] = {0, wide_1, wide_2, wide_3, wide_4, wide_5, wide_6,
                                                         wide_7, wide_8, wide_9, wide_10, wide_11, wide_12};

static int wide = -1; /* AVX-512 in use: -1 = not decided yet */

/* Which instruction set the products use: want 1 = AVX-512 where the CPU has it, 0 = AVX2,
 * -1 = leave as is (AVX-512 where available if not set yet); returns the one in use (1 or 0). */
int small_rows_use_avx512(int want) {
    if (want >= 0 || wide < 0) {
        __builtin_cpu_init();
        wide = want != 0 && __builtin_cpu_supports("avx512f");
    }
    return wide;
}

/* x [R, K] row-major, P [N/16][K][16], y [R, N] row-major; N a multiple of 16. */
void small_rows_matmul(const float *x, const float *P, float *y, int64_t R, int64_t K, int64_t N,
                       int threads) {
    int64_t panels = N / PANEL;
    if (wide < 0) small_rows_use_avx512(-1);
    /* AVX-512 takes the panels in pairs; the AVX2 kernel takes all of them, or an odd last one */
    int64_t pairs = wide ? panels / 2 : 0;
    if (pairs) {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t t = 0; t < pairs; t++) {
            const float *p = P + 2 * t * PANEL * K;
            int64_t r = 0;
            for (; r + WIDE_ROWS <= R; r += WIDE_ROWS) wide_12(x, p, y, K, N, r, 2 * t * PANEL);
            if (R > r) WIDE_BY_ROWS[R - r](x, p, y, K, N, r, 2 * t * PANEL);
        }
    }
#pragma omp parallel for schedule(static) num_threads(threads) if (panels - 2 * pairs > 1)
    for (int64_t t = 2 * pairs; t < panels; t++) {
        const float *p = P + t * PANEL * K;
        int64_t r = 0;
        for (; r + 6 <= R; r += 6) rows_6(x, p, y, K, N, r, t * PANEL);
        if (R > r) BY_ROWS[R - r](x, p, y, K, N, r, t * PANEL);
    }
}

/* RMSNorm of each row: y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w. torch's CPU rms_norm runs as
 * five separate ops (~70 us for one 576-wide row, ~60 calls per forward). Each row's sum of squares
 * runs in the same order for any R (row-invariant, like the product above). */
void small_rows_rms_norm(const float *x, const float *w, float *y, int64_t R, int64_t D, float eps) {
    int64_t D8 = D & ~(int64_t)7;
    for (int64_t r = 0; r < R; r++) {
        const float *xr = x + r * D;
        float *yr = y + r * D;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t d = 0; d < D8; d += 8) {
            __m256 v = _mm256_loadu_ps(xr + d);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float lanes[8], ss = 0.0f;
        _mm256_storeu_ps(lanes, acc);
        for (int i = 0; i < 8; i++) ss += lanes[i];
        for (int64_t d = D8; d < D; d++) ss += xr[d] * xr[d];
        float scale = 1.0f / sqrtf(ss / (float)D + eps);
        __m256 s = _mm256_set1_ps(scale);
        for (int64_t d = 0; d < D8; d += 8)
            _mm256_storeu_ps(yr + d, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + d), s), _mm256_loadu_ps(w + d)));
        for (int64_t d = D8; d < D; d++) yr[d] = xr[d] * scale * w[d];
    }
}

/* exp(x) for 8 floats: x = n ln2 + r with |r| <= ln2/2, exp(r) by a degree-6 polynomial
 * (Cephes' expf coefficients), 2^n by the exponent bits. ~1 ulp; inputs below -87.3 give 0. */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f), hi = _mm256_set1_ps(88.3f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

static inline float hsum8(__m256 v) {  /* fixed order: (lo + hi), then pairs, then the last two */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float dot(const float *a, const float *b, int64_t D) {
    int64_t D8 = D & ~(int64_t)7;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < D8; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
    float s = hsum8(acc);
    for (int64_t d = D8; d < D; d++) s += a[d] * b[d];
    return s;
}

/* The scores of one query against 8 keys at once, each summed exactly as dot() sums it (8 lanes
 * of multiply-adds over d in order, then hsum8's pairing), so the result is bit-identical to 8 calls
 * of dot(). Why: one dot() is a chain of D/8 dependent multiply-adds plus a horizontal sum, so a
 * key costs the chain's latency (~50 cycles at D = 64); 8 independent chains keep both FMA units busy
 * and the 8 horizontal sums share their shuffles. Needs D a multiple of 8. */
static inline __m256 dot8(const float *qv, const float *const key[8], int64_t D) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        __m256 x = _mm256_loadu_ps(qv + d);
        for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(x, _mm256_loadu_ps(key[i] + d), a[i]);
    }
    /* hsum8 of every a[i]: first lo + hi of each (two vectors per register: i and i + 4) ... */
    __m256 y[4];
    for (int i = 0; i < 4; i++)
        y[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[i], a[i + 4], 0x20), _mm256_permute2f128_ps(a[i], a[i + 4], 0x31));
    /* ... then lanes (0 + 2, 1 + 3) of each 4-lane half ... */
    __m256 e = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(y[0]), _mm256_castps_pd(y[1]))),
                             _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(y[0]), _mm256_castps_pd(y[1]))));
    __m256 f = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(y[2]), _mm256_castps_pd(y[3]))),
                             _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(y[2]), _mm256_castps_pd(y[3]))));
    /* ... and the last two: the sums come out in key order 0..7 */
    return _mm256_add_ps(_mm256_shuffle_ps(e, f, _MM_SHUFFLE(2, 0, 2, 0)), _mm256_shuffle_ps(e, f, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* out[0..n*8) = sum over j of p[j] * vals[j][0..n*8), each lane a chain of multiply-adds in j order
 * from 0 (as a loop over j with the output in memory would sum it), but n <= 8 accumulators stay in
 * registers: no store-to-load round trip per key. */
static inline void weighted_sum(const float *p, const float *const *vals, int64_t L, int64_t d0, int n, float *out) {
    __m256 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < L; j++) {
        __m256 w = _mm256_set1_ps(p[j]);
        const float *vv = vals[j] + d0;
        for (int i = 0; i < n; i++) acc[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vv + 8 * i), acc[i]);
    }
    for (int i = 0; i < n; i++) _mm256_storeu_ps(out + d0 + 8 * i, acc[i]);
}

/* Softmax attention of R query rows, each over its own list of key slots: cache slots
 * 0..prefix-1, then slots[offsets[r] .. offsets[r+1]) (a tree token's ancestors, itself last).
 * q, out [R, H, D]; k, v: one layer's cache [KVH, S, D]; query head h reads KV head h / (H/KVH).
 * A row's result depends only on its query and its keys in that order, never on R or on where
 * the keys sit in the cache: AR (one row over contiguous slots) and a tree verify compute it alike.
 * Every sum runs in a fixed order per (row, head): scores as dot() (8 keys per pass, see dot8),
 * softmax's total in 8 lanes then hsum8, the output per lane in key order.
 * The (row, head) pairs are taken KV head by KV head, so the threads that share a KV head's keys
 * and values read them while they are in cache.
 * scores: caller's scratch, R * H * (prefix + longest list) floats. */
void small_rows_attention(const float *q, const float *k, const float *v, int64_t S, int64_t prefix,
                          const int64_t *offsets, const int64_t *slots, float *out, float *scores,
                          int64_t R, int64_t H, int64_t KVH, int64_t D, int64_t longest, float scale,
                          int threads) {
    int64_t group = H / KVH, width = prefix + longest, D8 = D & ~(int64_t)7;
#pragma omp parallel num_threads(threads)
    {
    /* where each pair's j-th key (then value) sits: one list per thread, reused pair after pair */
    const float **at = (const float **)malloc(sizeof(float *) * (size_t)width);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < R * H; t++) {
        /* t runs KV head by KV head: g, then row r, then query head h within the group */
        int64_t g = t / (R * group), r = (t / group) % R, h = g * group + t % group;
        const float *qv = q + (r * H + h) * D;
        const float *kh = k + g * S * D, *vh = v + g * S * D;
        const int64_t *own = slots + offsets[r];
        int64_t L = prefix + (offsets[r + 1] - offsets[r]);
        float *s = scores + t * width;
        for (int64_t j = 0; j < L; j++) at[j] = kh + (j < prefix ? j : own[j - prefix]) * D;
        int64_t j = 0;
        if (D8 == D) {
            const float *key[8];
            __m256 sc = _mm256_set1_ps(scale);
            for (; j + 8 <= L; j += 8) {
                for (int i = 0; i < 8; i++) key[i] = at[j + i];
                _mm256_storeu_ps(s + j, _mm256_mul_ps(dot8(qv, key, D), sc));
            }
        }
        for (; j < L; j++) s[j] = dot(qv, at[j], D) * scale;
        int64_t L8 = L & ~(int64_t)7;
        float m = s[0];  /* the maximum is exact in any order: 8 lanes, then the lanes and the tail */
        if (L8) {
            __m256 top = _mm256_loadu_ps(s);
            for (int64_t i = 8; i < L8; i += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(s + i));
            float lanes[8];
            _mm256_storeu_ps(lanes, top);
            for (int i = 0; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
        }
        for (int64_t i = L8; i < L; i++) m = s[i] > m ? s[i] : m;
        __m256 mv = _mm256_set1_ps(m), total = _mm256_setzero_ps();
        for (int64_t i = 0; i < L8; i += 8) {
            __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
            _mm256_storeu_ps(s + i, e);
            total = _mm256_add_ps(total, e);
        }
        if (L > L8) {  /* the tail through the same exp, padded with -inf-like values that give 0 */
            float tail[8];
            for (int i = 0; i < 8; i++) tail[i] = L8 + i < L ? s[L8 + i] - m : -100.0f;
            __m256 e = exp8(_mm256_loadu_ps(tail));
            _mm256_storeu_ps(tail, e);
            for (int64_t i = L8; i < L; i++) s[i] = tail[i - L8];
            total = _mm256_add_ps(total, e);
        }
        float inv = 1.0f / hsum8(total);
        float *o = out + (r * H + h) * D;
        for (int64_t i = 0; i < L; i++) at[i] = vh + (at[i] - kh); /* now the values' rows */
        int64_t d = 0;
        for (; d + 64 <= D8; d += 64) weighted_sum(s, at, L, d, 8, o);
        for (; d < D8; d += 8) weighted_sum(s, at, L, d, 1, o);
        for (; d < D; d++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < L; i++) acc += s[i] * at[i][d];
            o[d] = acc;
        }
        for (int64_t i = 0; i < D; i++) o[i] *= inv;
    }
    free((void *)at);
    }
}

/* The sha256 of this file as it was compiled (setup.py passes it): runtime/small_rows.py compares it
 * with the installed source and refuses a stale build. */
#ifndef SMALL_ROWS_SOURCE_SHA
#define SMALL_ROWS_SOURCE_SHA "unknown"
#endif
const char *small_rows_source_sha(void) { return SMALL_ROWS_SOURCE_SHA; }
