/* What the linears share: the register tile of the vector paths, the weight formats and their blocks, and the
 * paths one file defines for another (linear_bf16.c, linear_quant.c, pack.c, linear.c and arch/). Every path
 * takes 1 to 512 rows; each output is a lane-wise fp32 sum over K, then one fixed lane sum: the same for a row
 * whatever its batch. */
#pragma once
#include "kernels.h"

/* -- the vector paths' register tile: NR weight rows times MR input rows ----------------------------------------- */
#define NR 4
#if LANES == 16
#define MR 4 /* 16 accumulators of 32 registers */
#else
#define MR 2 /* 8 of 16 */
#endif

/* An NR x mr tile's sums (sums[j * NR + i]: weight row n0 + i, input row m0 + j; NR * MR == LANES), plus
 * the bias, into y: fp32 as they are, or rounded to bf16. */
static inline void store_tile(const vf *sums, const uint16_t *bias, void *y, long y_stride, int n0, int m0, int mr,
                              const int f32) {
    vf out = sum_each(sums);
    if (bias)
        for (int l = 0; l < LANES; l++) out[l] += bf16_to_float(bias[n0 + l % NR]);
    if (f32) {
        for (int j = 0; j < mr; j++) memcpy((float *)y + (long)(m0 + j) * y_stride + n0, (float *)&out + j * NR, NR * sizeof(float));
        return;
    }
    vh rounded = to_bf16(out);
    for (int j = 0; j < mr; j++) memcpy((uint16_t *)y + (long)(m0 + j) * y_stride + n0, (uint16_t *)&rounded + j * NR, NR * sizeof(uint16_t));
}

/* n outputs of one input row (weight rows n0...), plus the bias, into y at `at` + n0: fp32, or rounded to bf16. */
static inline void store_outputs(const float *acc, int n, const uint16_t *bias, void *y, long at, int n0, int f32) {
    int r = 0;
    for (; r + LANES <= n; r += LANES) { /* a GEMM tile's row: vectors, the same rounding lane by lane */
        vf v = load_f32(acc + r);
        if (bias) v += load_bf16(bias + n0 + r);
        if (f32) store_f32((float *)y + at + n0 + r, v);
        else store_bf16((uint16_t *)y + at + n0 + r, v);
    }
    for (; r < n; r++) {
        float v = acc[r];
        if (bias) v += bf16_to_float(bias[n0 + r]);
        if (f32) ((float *)y)[at + n0 + r] = v;
        else ((uint16_t *)y)[at + n0 + r] = to_bf16(splat(v))[0];
    }
}

#if defined(__AVX2__)
#include <immintrin.h>
/* 32 bytes of each of 8 rows (rows 0-3 at a + i * stride, 4-7 at b + i * stride) as 8 vectors: vector k, lane r =
 * row r's dword k. The AVX2 GEMMs' unpacking (linear_kquant.c, arch/x86/linear_int8.c). */
static inline void transpose_8x8(const uint8_t *a, const uint8_t *b, long stride, __m256i out[8]) {
    __m256i z[8], t[8], u[8];
    for (int i = 0; i < 8; i++) z[i] = _mm256_loadu_si256((const __m256i *)((i < 4 ? a : b) + (i % 4) * stride));
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(z[i], z[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(z[i], z[i + 1]);
    }
    for (int i = 0; i < 8; i += 4)
        for (int j = 0; j < 2; j++) {
            u[i + 2 * j] = _mm256_unpacklo_epi64(t[i + j], t[i + j + 2]);
            u[i + 2 * j + 1] = _mm256_unpackhi_epi64(t[i + j], t[i + j + 2]);
        }
    /* u[e] (rows 0-3) and u[4 + e] (rows 4-7): dword e in the low 128-bit lane, e + 4 in the high one */
    for (int e = 0; e < 4; e++) {
        out[e] = _mm256_permute2x128_si256(u[e], u[4 + e], 0x20);
        out[e + 4] = _mm256_permute2x128_si256(u[e], u[4 + e], 0x31);
    }
}

/* The 4 int8 inputs at q in every dword: what the GEMMs' maddubs meet a vector of 4 weights a row with. */
static inline __m256i broadcast_four(const int8_t *q) {
    int32_t four;
    memcpy(&four, q, 4);
    return _mm256_set1_epi32(four);
}
#endif

/* Every MR-row tile of the M input rows, then the rest, with tile sizes known at compile time. */
#if MR > 2
#define REST_TILES(TILE) case 2: TILE(2, full); break; case 3: TILE(3, full); break;
#else
#define REST_TILES(TILE)
#endif
#define ALL_TILES(TILE)                                                 \
    do {                                                                \
        for (int m0 = 0; m0 < full; m0 += MR) TILE(MR, m0);             \
        switch (M - full) { case 1: TILE(1, full); break; REST_TILES(TILE) } \
    } while (0)

/* x (bf16, or fp32 with f32; strided rows) as fp32, [M][K]; NULL if out of memory (linear_bf16.c). */
float *widen_rows(const void *x, int f32, int M, int K, long x_stride);

/* -- weights in GGUF's quantizations, blocks of 32 along K ---------------------------------------------------
 * quant.py lays each row out in planes, the same bytes as GGUF's blocks in another order: the row's quants
 * (Q4: byte j of a block holds weight j low and j + 16 high; Q8_0: one int8 each), then every block's fp16
 * scale d, then (Q4_1) every block's fp16 minimum m. Weight = d * q + m; Q4_0: d * (q - 8); Q8_0: d * q. */
enum { FMT_Q4_0 = 2, FMT_Q4_1 = 3, FMT_Q8_0 = 8, FMT_BF16 = 30 };  /* ggml's type numbers */
/* Q5_0 (fp16 d, 4 bytes of fifth bits, 16 of nibbles: weight = d * (q - 16)) and Q5_1 (fp16 d and m, then the
 * same: d * q + m) in their own 22 and 24 bytes: the tiled path's (linear_vnni512.c) or the pairs'. */
enum { FMT_Q5_0 = 6, FMT_Q5_1 = 7 };
/* Blocks re-cut at load (quant.py: recut), 100 + ggml's number of the type they came from. Q4_K, Q5_K, Q5_0 and
 * Q5_1: the scale and minimum each block of 32 weights really has (d * sc and -dmin * m, d and -16 d, d and m:
 * exact in fp32), then 16 bytes of nibbles in Q4_1's order or 32 bytes of 5-bit quants; they run as Q4_1 does.
 * Q6_K: its fp16 d, the two int8 scales of the block's halves, then 32 signed bytes q - 32. Only the tiled
 * (512-bit VNNI) path takes them. */
enum { FMT_Q5_0_32 = 106, FMT_Q5_1_32 = 107, FMT_Q4_K_32 = 112, FMT_Q5_K_32 = 113, FMT_Q6_K_32 = 114 };
/* The 5-bit formats share one layout: Q5_K's. */
static inline int same_layout(int format) { return format == FMT_Q5_0_32 || format == FMT_Q5_1_32 ? FMT_Q5_K_32 : format; }
static inline int from_k_quant(int format) { return format >= FMT_Q4_K_32 && format <= FMT_Q6_K_32; }
static inline int five_bit(int format) { return format == FMT_Q5_0 || format == FMT_Q5_1; }
/* Formats only the tiled path takes: the re-cut ones. (The 5-bit ones in their own blocks take the tiled or the
 * pairs' layout, not the rows'.) */
static inline int tiled_only(int format) { return from_k_quant(format); }
static inline int k_block_bytes(int format) {
    return format == FMT_Q4_K_32 ? 24 : format == FMT_Q5_K_32 ? 40 : format == FMT_Q6_K_32 ? 36 : 0;
}
#define MAX_BLOCKS 1024  /* K up to 32768 */

static inline int block_bytes(int format) {
    switch (format) {
        case FMT_Q4_0: return 18;
        case FMT_Q4_1: return 20;
        case FMT_Q8_0: return 34;
        case FMT_Q5_0: return 22;
        case FMT_Q5_1: return 24;
        default: return 0;
    }
}

/* -- K-quants in the file's own layout (linear_kquant.c): ggml's super-blocks of 256, row after row ------------ */
enum { FMT_Q4_K = 12, FMT_Q5_K = 13, FMT_Q6_K = 14 };  /* ggml's type numbers */
#define KQ_MAX_BLOCKS 128  /* super-blocks a row may have: K up to 32768 */
/* The builds with a vector kernel for them (512-bit or AVX2) serve the K-quants in place; the others (no AVX2)
 * have only the scalar reference loops, slower than dequantizing to bf16. */
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define KQ_VECTOR 1
/* Q5_K in place too where the 256-bit kernels are the ones built (512-bit builds re-cut it for their tiles). */
#if !defined(__AVX512BW__)
#define KQ_Q5_K 1
#endif
#endif
int kquant_format(int format);
int kquant_linear(scratch *s, const void *x, const uint8_t *w, int format, const uint16_t *bias, void *y, int M,
                  int N, int K, long x_stride, long y_stride, int threads, int f32);

/* -- the quantized paths, by instruction set: each says whether it takes a shape (0 where the build lacks it) -- */
/* linear_quant.c: any format and shape, in fp32; the dispatch over the paths below. */
int quantized_linear(scratch *s, const void *x, const uint8_t *w, int format, const uint16_t *bias, void *y, int M,
                     int N, int K, long x_stride, long y_stride, int threads, int f32);

/* arch/x86/linear_int8.c (AVX2 and up): int8 dot products over pairs of blocks (Q4_0, Q4_1, Q8_0). Builds without
 * VNNI multiply with maddubs (I8_MADDUBS): their Q8_0 keeps the file's signed bytes, VNNI's dpbusd takes them
 * + 128 (see there). */
#if defined(__AVX2__) && !defined(__AVX512VNNI__) && !defined(__AVXVNNI__)
#define I8_MADDUBS 1
#else
#define I8_MADDUBS 0
#endif
int int8_path(int K);
int int8_linear(scratch *s, const void *x, const uint8_t *w, int format, const uint16_t *bias, void *y, int M, int N,
                int K, long x_stride, long y_stride, int threads, int f32);

/* arch/x86/linear_vnni512.c (AVX512-VNNI and BW): int8 dot products over tiles of 16 weight rows, every format. */
int tiled_path(int K);
int tiled_linear(scratch *s, const void *x, const uint8_t *w, int format, const uint16_t *bias, void *y, int M, int N,
                 int K, long x_stride, long y_stride, int threads, int f32);
int pack_tiles(const uint8_t *src, int format, int N, int K, uint8_t *dst);  /* -1: N not a whole number of tiles */
