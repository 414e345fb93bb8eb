/* bf16 linear for CPUs without AMX (AVX-512, AVX2, NEON: whatever the build machine has), 1 to 512 rows,
 * and the entry points every build exports. A step of few rows is bound by reading the weights once: each
 * register tile of NR weight rows is loaded once and multiplied with every input row (MR at a time), the
 * inputs widened to fp32 once per call. Each output is a lane-wise fp32 sum over K, then one fixed lane sum:
 * the same for a row whatever its batch. */
#include <omp.h>
#include <stdlib.h>

#include "kernels.h"

#ifndef __AMX_TILE__
#define NR 4
#if LANES == 16
#define MR 4 /* 16 accumulators of 32 registers */
#else
#define MR 2 /* 8 of 16 */
#endif

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
    for (int j = 0; j < mr; j++)
        for (int i = 0; i < NR; i++)
            y[(long)(m0 + j) * y_stride + n0 + i] = float_to_bf16(hsum(acc[i][j]) + (bias ? bf16_to_float(bias[n0 + i]) : 0.0f));
}

/* Same contract as amx_linear: y[m, n] = x[m, :] . w[n, :] (+ bias[n]); 1 <= M <= 512, K % 32, N % 16.
 * Weight rows are widened once per call into a per-thread buffer, inputs once per call. */
static int vector_linear(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int M, int N,
                         int K, long x_stride, long y_stride, int threads) {
    if (M < 1 || M > 512 || K % 32 || N % 16) return -1;
    float *xf = malloc(sizeof(float) * (size_t)M * K), *wf = malloc(sizeof(float) * (size_t)threads * NR * K);
    if (!xf || !wf) { free(xf); free(wf); return -2; }
    for (int m = 0; m < M; m++)
        for (int k = 0; k < K; k += LANES) store_f32(xf + (long)m * K + k, load_bf16(x + (long)m * x_stride + k));
    int full = M / MR * MR;
    #pragma omp parallel num_threads(threads)
    {
        float *mine = wf + (size_t)omp_get_thread_num() * NR * K;
        #pragma omp for schedule(dynamic, 4)
        for (int n0 = 0; n0 < N; n0 += NR) {
            const uint16_t *next = w + (long)(n0 + NR) * K;  /* the next tile of this thread's chunk, usually */
            for (int i = 0; i < NR; i++)
                for (int k = 0; k < K; k += LANES) {
                    if (n0 + NR < N && k % 32 == 0) __builtin_prefetch(next + (long)i * K + k, 0, 3);
                    store_f32(mine + (long)i * K + k, load_bf16(w + (long)(n0 + i) * K + k));
                }
            for (int m0 = 0; m0 < full; m0 += MR) tile(xf, mine, bias, y, K, y_stride, n0, m0, MR);
            switch (M - full) {  /* the rest, with tile sizes known at compile time */
                case 1: tile(xf, mine, bias, y, K, y_stride, n0, full, 1); break;
#if MR > 2
                case 2: tile(xf, mine, bias, y, K, y_stride, n0, full, 2); break;
                case 3: tile(xf, mine, bias, y, K, y_stride, n0, full, 3); break;
#endif
            }
        }
    }
    free(xf);
    free(wf);
    return 0;
}
#endif

int amx_linear(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int M, int N, int K,
               long x_stride, long y_stride, int threads);

/* The linear every caller uses: AMX where the build has it, the vector kernel elsewhere. */
int cpu_linear(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int M, int N, int K,
               long x_stride, long y_stride, int threads) {
#ifdef __AMX_TILE__
    return amx_linear(x, w, bias, y, M, N, K, x_stride, y_stride, threads);
#else
    return vector_linear(x, w, bias, y, M, N, K, x_stride, y_stride, threads);
#endif
}

const char *kernel_isa(void) {
#if defined(__AMX_TILE__)
    return "amx";
#elif defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__)
    return "avx2";
#elif defined(__ARM_NEON)
    return "neon";
#else
    return "scalar";
#endif
}

#ifndef __AMX_TILE__
int amx_enable(void) { return 0; }  /* nothing to ask for */
#endif
