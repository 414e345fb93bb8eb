/* The bf16 linear on vector units, 1 to 512 rows, for CPUs without AMX (AVX-512, AVX2, NEON: whatever the
 * build machine has), and cpu_linear, which every bf16 caller uses: AMX where the build has it
 * (arch/x86/amx.c), this elsewhere.
 * A step of few rows is bound by reading the weights once: each register tile of NR weight rows is loaded
 * once and multiplied with every input row (MR at a time), the inputs widened to fp32 once per call. */
#include <omp.h>
#include <stdlib.h>

#include "linear.h"

/* NR weight rows (fp32, wf[i * K + k]) times mr input rows (fp32, xf[(m0 + j) * K + k]). */
static inline __attribute__((always_inline)) void tile(const float *xf, const float *wf, const uint16_t *bias,
                                                       uint16_t *y, int K, long y_stride, int n0, int m0, const int mr) {
    vf acc[NR][MR] = {};
    for (int k = 0; k < K; k += LANES) {
        vf wv[NR];
        for (int i = 0; i < NR; i++) wv[i] = load_f32(wf + (long)i * K + k);
        for (int j = 0; j < mr; j++) {
            vf xv = load_f32(xf + (long)(m0 + j) * K + k);
            for (int i = 0; i < NR; i++) acc[i][j] += wv[i] * xv;
        }
    }
    vf sums[LANES] = {};
    for (int j = 0; j < mr; j++)
        for (int i = 0; i < NR; i++) sums[j * NR + i] = acc[i][j];
    store_tile(sums, bias, y, y_stride, n0, m0, mr, 0);
}

#define F32_TILE(mr, m0) tile(xf, mine, bias, y, K, y_stride, n0, m0, mr)

float *widen_rows(const void *x, int f32, int M, int K, long x_stride) {
    float *xf = malloc(sizeof(float) * (size_t)M * K);
    if (xf)
        for (int m = 0; m < M; m++) {
            if (f32) memcpy(xf + (long)m * K, (const float *)x + (long)m * x_stride, sizeof(float) * K);
            else
                for (int k = 0; k < K; k += LANES)
                    store_f32(xf + (long)m * K + k, load_bf16((const uint16_t *)x + (long)m * x_stride + k));
        }
    return xf;
}

#if defined(__AVX512BF16__) && !defined(__AMX_TILE__)
#include <immintrin.h>
/* With AVX512-BF16 (Zen 4, Cooper Lake) the products come straight from bf16 in memory: each lane sums a pair
 * of products per instruction, twice the work of an fp32 FMA and no widening. */
static inline __attribute__((always_inline)) void tile_bf16(const uint16_t *x, long x_stride, const uint16_t *w,
                                                            const uint16_t *bias, uint16_t *y, int K, long y_stride,
                                                            int n0, int m0, const int mr) {
    __m512 acc[NR][MR];
    for (int i = 0; i < NR; i++)
        for (int j = 0; j < mr; j++) acc[i][j] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 32) {
        __m512bh wv[NR];
        for (int i = 0; i < NR; i++) wv[i] = (__m512bh)_mm512_loadu_si512(w + (long)(n0 + i) * K + k);
        for (int j = 0; j < mr; j++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (long)(m0 + j) * x_stride + k);
            for (int i = 0; i < NR; i++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[i], xv);
        }
    }
    vf sums[LANES] = {};
    for (int j = 0; j < mr; j++)
        for (int i = 0; i < NR; i++) sums[j * NR + i] = (vf)acc[i][j];
    store_tile(sums, bias, y, y_stride, n0, m0, mr, 0);
}
#endif

#ifndef __AMX_TILE__
/* Same contract as amx_linear: y[m, n] = x[m, :] . w[n, :] (+ bias[n]); 1 <= M <= 512, K % 32, N % 16.
 * Without AVX512-BF16, weight rows are widened a tile at a time into a per-thread buffer, inputs once per call. */
static int vector_linear(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int M, int N,
                         int K, long x_stride, long y_stride, int threads) {
    if (M < 1 || M > 512 || K % 32 || N % 16) return -1;
#ifndef __AVX512BF16__
    float *xf = widen_rows(x, 0, M, K, x_stride), *wf = malloc(sizeof(float) * (size_t)threads * NR * K);
    if (!xf || !wf) { free(xf); free(wf); return -2; }
#endif
    int full = M / MR * MR;
    #pragma omp parallel num_threads(threads)
    {
#ifndef __AVX512BF16__
        float *mine = wf + (size_t)omp_get_thread_num() * NR * K;
#endif
        #pragma omp for schedule(dynamic, 4)
        for (int n0 = 0; n0 < N; n0 += NR) {
            const uint16_t *next = w + (long)(n0 + NR) * K;  /* the next tile of this thread's chunk, usually */
            if (n0 + NR < N)
                for (int i = 0; i < NR; i++)
                    for (int k = 0; k < K; k += 32) __builtin_prefetch(next + (long)i * K + k, 0, 3);
#ifdef __AVX512BF16__
#define BF16_TILE(mr, m0) tile_bf16(x, x_stride, w, bias, y, K, y_stride, n0, m0, mr)
            ALL_TILES(BF16_TILE);
#else
            for (int i = 0; i < NR; i++)
                for (int k = 0; k < K; k += LANES) store_f32(mine + (long)i * K + k, load_bf16(w + (long)(n0 + i) * K + k));
            ALL_TILES(F32_TILE);
#endif
        }
    }
#ifndef __AVX512BF16__
    free(xf);
    free(wf);
#endif
    return 0;
}
#endif

/* The bf16 linear every caller uses: AMX where the build has it, the vector kernel elsewhere. */
int cpu_linear(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int M, int N, int K,
               long x_stride, long y_stride, int threads) {
#ifdef __AMX_TILE__
    return amx_linear(x, w, bias, y, M, N, K, x_stride, y_stride, threads);
#else
    return vector_linear(x, w, bias, y, M, N, K, x_stride, y_stride, threads);
#endif
}
