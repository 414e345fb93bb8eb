/* bf16 linear for the few rows of a decode step up to a whole prefill chunk (1 to 512 rows) on CPUs with
 * AMX, which cpu_linear (linear_bf16.c) runs in builds that have it.
 *
 * Such a step multiplies a few rows by every weight matrix, so it is bound by reading weights. The weights
 * stay in their nn.Linear layout [N, K]: they are the AMX "A" operand (16 weight rows by 32 values a tile),
 * and the input rows, repacked per call into pairs in chunks of 16 rows, are the small "B" operands; each
 * weight tile is read once and multiplied with every chunk. While the tiles multiply one block of 16 weight
 * rows, the next block is prefetched: that overlap is what torch's kernels lack for these shapes.
 */
#include "../../kernels.h"

#ifdef __AMX_TILE__
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Linux hands out AMX state only to processes that ask for it. 0 on success. */
int amx_enable(void) { return (int)syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */); }


#define MAX_M 512  /* a CPU step's whole token budget */
#define CHUNK 16   /* rows per B tile */
#define GROUP 4    /* chunks multiplied per weight tile load: four accumulator tiles */

/* y[m, n] = x[m, :] . w[n, :] (+ bias[n]), fp32 sums rounded once to bf16.
 * Needs 1 <= M <= 512, K % 32 == 0, N % 16 == 0, w contiguous; x and y rows may be strided.
 * Each output row is summed in the same order whatever M is: a row's result does not depend on its batch. */
int amx_linear(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
               int M, int N, int K, long x_stride, long y_stride, int threads) {
    if (M < 1 || M > MAX_M || K % 32 || N % 16) return -1;
    int chunks = (M + CHUNK - 1) / CHUNK, last = M - (chunks - 1) * CHUNK;
    uint16_t *pairs = aligned_alloc(64, ((size_t)K * M * 2 + 63) / 64 * 64);
    if (!pairs) return -2;
    for (int c = 0; c < chunks; c++) {  /* chunk c: [K/2][rows][2] */
        int rows = c == chunks - 1 ? last : CHUNK;
        uint16_t *dst = pairs + (long)c * CHUNK * K;
        const __m512i step = column_offsets(rows);
        for (int m = 0; m < rows; m++) {
            const uint16_t *row = x + (long)(c * CHUNK + m) * x_stride;
            for (int kk = 0; kk < K / 2; kk += 16)  /* 16 pairs of row m go to 16 pair rows, column m */
                _mm512_i32scatter_epi32((int *)dst + (long)kk * rows + m, step, _mm512_loadu_si512(row + 2 * kk), 4);
        }
    }
    int blocks = N / 16;
    #pragma omp parallel num_threads(threads)
    {
        tile_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        /* Tiles 0-3: C of full chunks, 16 outputs x 16 rows, fp32; tile 7: C of the last chunk. */
        for (int c = 0; c < GROUP; c++) { cfg.rows[c] = 16; cfg.colsb[c] = CHUNK * 4; }
        cfg.rows[7] = 16; cfg.colsb[7] = last * 4;
        cfg.rows[4] = 16; cfg.colsb[4] = 64;           /* A: 16 weight rows x 32 */
        cfg.rows[5] = 16; cfg.colsb[5] = CHUNK * 4;    /* B, full chunk */
        cfg.rows[6] = 16; cfg.colsb[6] = last * 4;     /* B, last chunk */
        _tile_loadconfig(&cfg);
        float out[16 * CHUNK * GROUP];
        #pragma omp for schedule(dynamic, 4)
        for (int b = 0; b < blocks; b++) {
            int n0 = b * 16;
            const uint16_t *wb = w + (long)n0 * K, *next = wb + 16L * K;
            int ahead = N - (n0 + 16); if (ahead > 16) ahead = 16;
            __m512 bv = bias ? (__m512)load_bf16(bias + n0) : _mm512_setzero_ps();
            for (int g0 = 0; g0 < chunks; g0 += GROUP) {  /* after the first group, this block's weights are in cache */
                int in_group = chunks - g0 < GROUP ? chunks - g0 : GROUP;
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); _tile_zero(7);
                for (int k = 0; k < K; k += 32) {
                    _tile_loadd(4, wb + k, K * 2);
                    if (g0 == 0)
                        for (int r = 0; r < ahead; r++) _mm_prefetch((const char *)(next + (long)r * K + k), _MM_HINT_T0);
#define CHUNK_DP(i)                                                                                         \
                    if (in_group > i) {                                                                     \
                        const uint16_t *bp = pairs + (long)(g0 + i) * CHUNK * K;                            \
                        if (g0 + i == chunks - 1) { _tile_loadd(6, bp + (long)k * last, last * 4); _tile_dpbf16ps(7, 4, 6); } \
                        else { _tile_loadd(5, bp + (long)k * CHUNK, CHUNK * 4); _tile_dpbf16ps(i, 4, 5); } \
                    }
                    CHUNK_DP(0) CHUNK_DP(1) CHUNK_DP(2) CHUNK_DP(3)
                }
                /* out[i]: chunk g0+i's 16 x rows block */
#define CHUNK_ST(i)                                                                                         \
                if (in_group > i) {                                                                         \
                    if (g0 + i == chunks - 1) _tile_stored(7, out + i * 16 * CHUNK, last * 4);              \
                    else _tile_stored(i, out + i * 16 * CHUNK, CHUNK * 4);                                  \
                }
                CHUNK_ST(0) CHUNK_ST(1) CHUNK_ST(2) CHUNK_ST(3)
                for (int i = 0; i < in_group; i++) {
                    int c = g0 + i, rows = c == chunks - 1 ? last : CHUNK;
                    const float *o = out + i * 16 * CHUNK;
                    __m512i column = column_offsets(rows);
                    for (int m = 0; m < rows; m++) {  /* column m of the 16 x rows block is output row m, n0..n0+15 */
                        __m512 v = _mm512_add_ps(_mm512_i32gather_ps(column, o + m, 4), bv);
                        _mm256_storeu_si256((__m256i *)(y + (long)(c * CHUNK + m) * y_stride + n0), (__m256i)_mm512_cvtneps_pbh(v));
                    }
                }
            }
        }
        _tile_release();
    }
    free(pairs);
    return 0;
}
#else
int amx_enable(void) { return 0; }  /* nothing to ask for */
#endif
