/* bf16 linear for decode steps (1 to 16 rows) on CPUs with AMX; built and loaded by cpu_kernel.py.
 *
 * A decode step multiplies a handful of rows by every weight matrix, so it is bound by reading weights.
 * The weights stay in their nn.Linear layout [N, K]: they are the AMX "A" operand (16 weight rows by 32
 * values a tile), and the few input rows, repacked per call into pairs, are the small "B" operand. While
 * the tiles multiply one block of 32 weight rows, the next block is prefetched: that overlap is what
 * torch's kernels lack for these shapes.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* Linux hands out AMX state only to processes that ask for it. 0 on success. */
int amx_enable(void) { return (int)syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */); }

static inline uint16_t to_bf16(float f) {
    return (uint16_t)_mm_cvtsi128_si32((__m128i)_mm_cvtneps_pbh(_mm_set_ss(f)));
}

static inline float from_bf16(uint16_t h) {
    union { uint32_t u; float f; } v = { .u = (uint32_t)h << 16 };
    return v.f;
}

/* y[m, n] = x[m, :] . w[n, :] (+ bias[n]), fp32 sums rounded once to bf16.
 * Needs 1 <= M <= 16, K % 32 == 0, N % 16 == 0, w contiguous; x and y rows may be strided. */
int amx_linear(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
               int M, int N, int K, long x_stride, long y_stride, int threads) {
    if (M < 1 || M > 16 || K % 32 || N % 16) return -1;
    uint16_t *pairs = aligned_alloc(64, ((size_t)K * M * 2 + 63) / 64 * 64);  /* [K/2][M][2] */
    if (!pairs) return -2;
    for (int kk = 0; kk < K / 2; kk++)
        for (int m = 0; m < M; m++)
            memcpy(pairs + (kk * M + m) * 2, x + m * x_stride + 2 * kk, 4);
    int pairs_of_blocks = (N / 16 + 1) / 2;
    #pragma omp parallel num_threads(threads)
    {
        tile_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 2; t++) { cfg.rows[t] = 16; cfg.colsb[t] = M * 4; }      /* C: 16 outputs x M */
        for (int t = 2; t < 4; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }         /* A: 16 rows x 32 */
        cfg.rows[4] = 16; cfg.colsb[4] = M * 4;                                      /* B: 16 pairs x M */
        _tile_loadconfig(&cfg);
        float out[32 * 16];
        #pragma omp for schedule(static)
        for (int p = 0; p < pairs_of_blocks; p++) {
            int n0 = p * 32, both = n0 + 16 < N;
            const uint16_t *w0 = w + (long)n0 * K, *w1 = w0 + 16L * K, *next = w0 + 32L * K;
            int ahead = N - (n0 + 32);
            if (ahead > 32) ahead = 32;
            _tile_zero(0);
            _tile_zero(1);
            for (int k = 0; k < K; k += 32) {
                _tile_loadd(4, pairs + (long)k * M, M * 4);
                _tile_loadd(2, w0 + k, K * 2);
                _tile_dpbf16ps(0, 2, 4);
                if (both) {
                    _tile_loadd(3, w1 + k, K * 2);
                    _tile_dpbf16ps(1, 3, 4);
                }
                for (int r = 0; r < ahead; r++) _mm_prefetch((const char *)(next + (long)r * K + k), _MM_HINT_T0);
            }
            _tile_stored(0, out, M * 4);
            if (both) _tile_stored(1, out + 16 * M, M * 4);
            for (int r = 0; r < (both ? 32 : 16); r++) {
                float b = bias ? from_bf16(bias[n0 + r]) : 0.f;
                for (int m = 0; m < M; m++) y[m * y_stride + n0 + r] = to_bf16(out[r * M + m] + b);
            }
        }
        _tile_release();
    }
    free(pairs);
    return 0;
}
