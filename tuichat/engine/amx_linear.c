/* bf16 linear for decode steps and short prefills (1 to 64 rows) on CPUs with AMX; built and loaded by
 * cpu_kernel.py.
 *
 * Such a step multiplies a few rows by every weight matrix, so it is bound by reading weights. The weights
 * stay in their nn.Linear layout [N, K]: they are the AMX "A" operand (16 weight rows by 32 values a tile),
 * and the input rows, repacked per call into pairs in chunks of 16 rows, are the small "B" operands; each
 * weight tile is read once and multiplied with every chunk. While the tiles multiply one block of 16 weight
 * rows, the next block is prefetched: that overlap is what torch's kernels lack for these shapes.
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

/* 0, s, 2s, ... 15s: the offsets of one column of a row-major block with s columns. */
static inline __m512i column_offsets(int s) {
    return _mm512_mullo_epi32(_mm512_set1_epi32(s), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}

#define MAX_M 64   /* four accumulator tiles of 16 rows */
#define CHUNK 16

/* y[m, n] = x[m, :] . w[n, :] (+ bias[n]), fp32 sums rounded once to bf16.
 * Needs 1 <= M <= 64, K % 32 == 0, N % 16 == 0, w contiguous; x and y rows may be strided. */
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
        for (int c = 0; c < 4; c++) { cfg.rows[c] = 16; cfg.colsb[c] = (c == chunks - 1 ? last : CHUNK) * 4; }
        /* Tiles 0-3: C, 16 outputs x the chunk's rows, fp32. */
        cfg.rows[4] = 16; cfg.colsb[4] = 64;           /* A: 16 weight rows x 32 */
        cfg.rows[5] = 16; cfg.colsb[5] = CHUNK * 4;    /* B, full chunk */
        cfg.rows[6] = 16; cfg.colsb[6] = last * 4;     /* B, last chunk */
        _tile_loadconfig(&cfg);
        float out[16 * MAX_M];
        #pragma omp for schedule(static)
        for (int b = 0; b < blocks; b++) {
            int n0 = b * 16;
            const uint16_t *wb = w + (long)n0 * K, *next = wb + 16L * K;
            int ahead = N - (n0 + 16); if (ahead > 16) ahead = 16;
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int k = 0; k < K; k += 32) {
                _tile_loadd(4, wb + k, K * 2);
                for (int r = 0; r < ahead; r++) _mm_prefetch((const char *)(next + (long)r * K + k), _MM_HINT_T0);
#define CHUNK_DP(c)                                                                                         \
                if (chunks > c) {                                                                           \
                    if (c == chunks - 1) { _tile_loadd(6, pairs + (long)c * CHUNK * K + (long)k * last, last * 4); _tile_dpbf16ps(c, 4, 6); } \
                    else { _tile_loadd(5, pairs + (long)c * CHUNK * K + (long)k * CHUNK, CHUNK * 4); _tile_dpbf16ps(c, 4, 5); } \
                }
                CHUNK_DP(0) CHUNK_DP(1) CHUNK_DP(2) CHUNK_DP(3)
            }
            /* out[c][r][m]: chunk c's 16 x rows block */
#define CHUNK_ST(c) if (chunks > c) _tile_stored(c, out + c * 16 * CHUNK, (c == chunks - 1 ? last : CHUNK) * 4);
            CHUNK_ST(0) CHUNK_ST(1) CHUNK_ST(2) CHUNK_ST(3)
            __m512 bv = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(bias + n0))), 16))
                             : _mm512_setzero_ps();
            for (int c = 0; c < chunks; c++) {
                int rows = c == chunks - 1 ? last : CHUNK;
                const float *o = out + c * 16 * CHUNK;
                __m512i column = column_offsets(rows);
                for (int m = 0; m < rows; m++) {  /* column m of the 16 x rows block is output row m, n0..n0+15 */
                    __m512 v = _mm512_add_ps(_mm512_i32gather_ps(column, o + m, 4), bv);
                    _mm256_storeu_si256((__m256i *)(y + (long)(c * CHUNK + m) * y_stride + n0), (__m256i)_mm512_cvtneps_pbh(v));
                }
            }
        }
        _tile_release();
    }
    free(pairs);
    return 0;
}
