/* Linears on vector units, 1 to 512 rows, and the entry points every build exports:
 * - the bf16 linear for CPUs without AMX (AVX-512, AVX2, NEON: whatever the build machine has);
 * - the linear over weights kept as GGUF stores them (Q8_0, Q4_0, Q4_1), in every build: a decode step is
 *   bound by reading the weights, and these are 1.06, 0.56 and 0.63 bytes a weight against bf16's 2.
 * A step of few rows is bound by reading the weights once: each register tile of NR weight rows is loaded
 * once and multiplied with every input row (MR at a time), the inputs widened to fp32 once per call.
 * Quantized weights are expanded a tile at a time, exactly (d * q + m is exact in fp32 before its one
 * rounding, as gguf's own dequantization computes it), into the same fp32 tile the bf16 weights widen to:
 * no activation is quantized, so the result is the dequantized model's, to fp32 summation order.
 * Each output is a lane-wise fp32 sum over K, then one fixed lane sum: the same for a row whatever its
 * batch. */
#include <omp.h>
#include <stdlib.h>

#include "kernels.h"

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
#define F32_TILE(mr, m0) tile(xf, mine, bias, y, K, y_stride, n0, m0, mr)

/* x (bf16, or fp32 with f32; strided rows) as fp32, [M][K]; NULL if out of memory. */
static float *widen_rows(const void *x, int f32, int M, int K, long x_stride) {
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

/* -- weights in GGUF's quantizations, blocks of 32 along K ---------------------------------------------------
 * quant.py lays each row out in planes, the same bytes as GGUF's blocks in another order: the row's quants
 * (Q4: byte j of a block holds weight j low and j + 16 high; Q8_0: one int8 each), then every block's fp16
 * scale d, then (Q4_1) every block's fp16 minimum m. Weight = d * q + m; Q4_0: d * (q - 8); Q8_0: d * q. */
enum { FMT_Q4_0 = 2, FMT_Q4_1 = 3, FMT_Q8_0 = 8, FMT_BF16 = 30 };  /* ggml's type numbers */
/* Blocks re-cut at load (quant.py: recut), 100 + ggml's number of the type they came from. Q4_K, Q5_K, Q5_0 and
 * Q5_1: the scale and minimum each block of 32 weights really has (d * sc and -dmin * m, d and -16 d, d and m:
 * exact in fp32), then 16 bytes of nibbles in Q4_1's order or 32 bytes of 5-bit quants; they run as Q4_1 does.
 * Q6_K: its fp16 d, the two int8 scales of the block's halves, then 32 signed bytes q - 32. Only the tiled
 * (512-bit VNNI) path takes them. */
enum { FMT_Q5_0_32 = 106, FMT_Q5_1_32 = 107, FMT_Q4_K_32 = 112, FMT_Q5_K_32 = 113, FMT_Q6_K_32 = 114 };
/* The 5-bit formats share one layout: Q5_K's. */
static inline int same_layout(int format) { return format == FMT_Q5_0_32 || format == FMT_Q5_1_32 ? FMT_Q5_K_32 : format; }
static inline int from_k_quant(int format) { return format >= FMT_Q4_K_32 && format <= FMT_Q6_K_32; }
static inline int k_block_bytes(int format) {
    return format == FMT_Q4_K_32 ? 24 : format == FMT_Q5_K_32 ? 40 : format == FMT_Q6_K_32 ? 36 : 0;
}
#define MAX_BLOCKS 1024  /* K up to 32768 */

static int block_bytes(int format) {
    switch (format) {
        case FMT_Q4_0: return 18;
        case FMT_Q4_1: return 20;
        case FMT_Q8_0: return 34;
        default: return 0;
    }
}

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* n IEEE halves to floats, exactly. */
static void halves_to_floats(const uint8_t *p, int n, float *out) {
    int i = 0;
#ifdef __F16C__
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 2 * i))));
#endif
    for (; i < n; i++) {
        uint16_t h;
        memcpy(&h, p + 2 * i, 2);
        uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 31, mantissa = h & 0x3ff, bits;
        if (exponent == 0) {
            float f = mantissa * (1.0f / 16777216.0f);  /* mantissa * 2^-24 */
            out[i] = sign ? -f : f;
            continue;
        }
        bits = sign | (exponent == 31 ? 0x7f800000 | mantissa << 13 : (exponent + 112) << 23 | mantissa << 13);
        memcpy(out + i, &bits, 4);
    }
}

/* LANES bytes at p, widened to int32 lanes (sign-extended for int8). GCC's generic byte conversions come out
 * lane by lane through general registers here, so x86 gets the one instruction it has. */
static inline vi widen_bytes(const uint8_t *p, const int is_signed) {
#if defined(__AVX512F__)
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    return (vi)(is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#elif defined(__AVX2__)
    __m128i b = _mm_loadl_epi64((const __m128i *)p);
    return (vi)(is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
#else
    vi out;
    for (int l = 0; l < LANES; l++) out[l] = is_signed ? (int8_t)p[l] : p[l];
    return out;
#endif
}

/* Weights c .. c + LANES of block b of a row's quants, as floats before scaling. */
static inline __attribute__((always_inline)) vf block_values(const uint8_t *quants, const int format, int b, int c) {
    if (format == FMT_Q8_0) return __builtin_convertvector(widen_bytes(quants + b * 32 + c, 1), vf);
    vi q = widen_bytes(quants + b * 16 + c % 16, 0);
    return __builtin_convertvector(c < 16 ? q & 15 : q >> 4, vf);
}

/* NR weight rows of blocks times mr input rows (fp32); scales[i][b], offsets[i][b]: row i's d and m per block,
 * as floats. Each weight is expanded in registers to exactly its dequantized value (d * q + m: the product is
 * exact, so the one rounding is gguf's) and summed lane by lane in the order the bf16 tile sums: a row's
 * result is the dequantized model's, whatever its batch. */
static inline __attribute__((always_inline)) void block_tile(const float *xf, const uint8_t *w, long row_bytes,
                                                             const int format, float (*scales)[MAX_BLOCKS],
                                                             float (*offsets)[MAX_BLOCKS], const uint16_t *bias,
                                                             void *y, int K, long y_stride, int n0, int m0,
                                                             const int mr, int f32) {
    vf acc[NR][MR] = {};
    for (int b = 0; b < K / 32; b++) {
        for (int c = 0; c < 32; c += LANES) {
            vf wv[NR];
            for (int i = 0; i < NR; i++) {
                vf q = block_values(w + (n0 + i) * row_bytes, format, b, c);
                wv[i] = format == FMT_Q8_0 ? q * scales[i][b] : q * scales[i][b] + offsets[i][b];
            }
            for (int j = 0; j < mr; j++) {
                vf xv = load_f32(xf + (long)(m0 + j) * K + b * 32 + c);
                for (int i = 0; i < NR; i++) acc[i][j] += wv[i] * xv;
            }
        }
    }
    vf sums[LANES] = {};
    for (int j = 0; j < mr; j++)
        for (int i = 0; i < NR; i++) sums[j * NR + i] = acc[i][j];
    store_tile(sums, bias, y, y_stride, n0, m0, mr, f32);
}

/* y[m, n] = x[m, :] . dequantized(w)[n, :] (+ bias[n]), the inputs in fp32: w is N planar rows of K / 32 blocks
 * of `format`, here the quants in GGUF's own order. Where the int8 path below does not run. */
static int dequantized_linear(const void *x, const uint8_t *w, int format, const uint16_t *bias, void *y, int M,
                              int N, int K, long x_stride, long y_stride, int threads, int f32) {
    int bytes = block_bytes(format), blocks = K / 32;
    long row_bytes = (long)blocks * bytes, quant_bytes = format == FMT_Q8_0 ? K : K / 2;
    float *xf = widen_rows(x, f32, M, K, x_stride);
    if (!xf) return -2;
    int full = M / MR * MR;
    #pragma omp parallel num_threads(threads)
    {
        float scales[NR][MAX_BLOCKS], offsets[NR][MAX_BLOCKS];
        #pragma omp for schedule(dynamic, 4)
        for (int n0 = 0; n0 < N; n0 += NR) {
            for (int i = 0; i < NR; i++) {
                const uint8_t *row = w + (n0 + i) * row_bytes;
                halves_to_floats(row + quant_bytes, blocks, scales[i]);
                if (format == FMT_Q4_1) halves_to_floats(row + quant_bytes + 2 * blocks, blocks, offsets[i]);
                else if (format == FMT_Q4_0)
                    for (int b = 0; b < blocks; b++) offsets[i][b] = -8.0f * scales[i][b];
            }
            /* One specialised copy per format: the format is a constant inside the tile. */
#define Q4_0_TILE(mr, m0) block_tile(xf, w, row_bytes, FMT_Q4_0, scales, offsets, bias, y, K, y_stride, n0, m0, mr, f32)
#define Q4_1_TILE(mr, m0) block_tile(xf, w, row_bytes, FMT_Q4_1, scales, offsets, bias, y, K, y_stride, n0, m0, mr, f32)
#define Q8_0_TILE(mr, m0) block_tile(xf, w, row_bytes, FMT_Q8_0, scales, offsets, bias, y, K, y_stride, n0, m0, mr, f32)
            switch (format) {
                case FMT_Q4_0: ALL_TILES(Q4_0_TILE); break;
                case FMT_Q4_1: ALL_TILES(Q4_1_TILE); break;
                default: ALL_TILES(Q8_0_TILE); break;
            }
        }
    }
    free(xf);
    return 0;
}

#ifdef __AVX2__
/* -- int8 dot products (AVX512-VNNI, AVX-VNNI, or AVX2's maddubs), as llama.cpp computes these formats ------------
 * The inputs are quantized per block of 32 to int8 with one fp32 scale (dx = max|x| / 127), the weights' quants
 * are unsigned bytes (Q4's nibbles, or Q8_0's int8 + 128), and a block's dot product is exact in int32:
 *   x . w = dw * dx * sum(q_w * q_x) + m * dx * sum(q_x)    (m: Q4_1's minimum; -8 dw for Q4_0, -128 dw for Q8_0)
 * Each dpbusd lane sums 4 products; two blocks share a 32-byte vector, their 4-byte groups alternating, so that
 * lanes 0, 2, 4, 6 hold one block and 1, 3, 5, 7 the other and one 8-byte broadcast carries both blocks' scales.
 * pack_blocks lays the weights out so; quantize_inputs does the same for the inputs. */
static inline int int8_path(int format, int K) {
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
    return K % 64 == 0;
#else
    return K % 64 == 0 && format != FMT_Q8_0;  /* maddubs would saturate Q8_0's products of up to 255 * 128 */
#endif
}

static inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* Input row m: int8 quants in pairs of blocks (64 bytes a pair: weights 0..15 of both, then 16..31, groups of 4
 * alternating), and per block dx and sx = dx * sum(q), rows `stride` blocks apart (padded to 8). */
typedef struct { int8_t *q; float *dx, *sx; } quantized_inputs;

/* 16 values (two vectors of 8 floats) times id, rounded to nearest even, as 16 int8 in order. */
static inline __m128i to_int8(__m256 a, __m256 b, __m256 id, __m256i *sum) {
    __m256i qa = _mm256_cvtps_epi32(_mm256_mul_ps(a, id)), qb = _mm256_cvtps_epi32(_mm256_mul_ps(b, id));
    *sum = _mm256_add_epi32(*sum, _mm256_add_epi32(qa, qb));
    __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(qa, qb), 0xD8);  /* |q| <= 127: no saturation */
    return _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
}

static inline __m256 bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* Input rows [first, last) (bf16, or fp32 with f32) into `out`, a pair of blocks at a time (K % 64 == 0). */
static void quantize_inputs(const void *x, int f32, int first, int last, int K, long x_stride, quantized_inputs *out,
                            int stride) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int m = first; m < last; m++) {
        const uint16_t *row = (const uint16_t *)x + (long)m * x_stride;
        const float *row_f32 = (const float *)x + (long)m * x_stride;
        for (int p = 0; p < K / 64; p++) {
            __m128i halves[2][2];  /* [block of the pair][weights 0..15, 16..31] */
            for (int side = 0; side < 2; side++) {
                int b = 2 * p + side;
                __m256 v[4];
                for (int g = 0; g < 4; g++) v[g] = f32 ? _mm256_loadu_ps(row_f32 + b * 32 + 8 * g) : bf16x8(row + b * 32 + 8 * g);
                __m256 top = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                           _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
                __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
                t = _mm_max_ps(t, _mm_movehl_ps(t, t));
                float amax = _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t))), d = amax / 127.0f;
                __m256 id = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
                __m256i sum = _mm256_setzero_si256();
                halves[side][0] = to_int8(v[0], v[1], id, &sum);
                halves[side][1] = to_int8(v[2], v[3], id, &sum);
                __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
                s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
                s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
                out->dx[(long)m * stride + b] = d;
                out->sx[(long)m * stride + b] = d * (float)_mm_cvtsi128_si32(s4);
            }
            int8_t *pair = out->q + (long)m * K + (long)p * 64;
            for (int h = 0; h < 2; h++) {  /* the two blocks' groups of 4 alternate */
                _mm_storeu_si128((__m128i *)(pair + 32 * h), _mm_unpacklo_epi32(halves[0][h], halves[1][h]));
                _mm_storeu_si128((__m128i *)(pair + 32 * h + 16), _mm_unpackhi_epi32(halves[0][h], halves[1][h]));
            }
        }
    }
}

/* NR weight rows times mr input rows. A row's fp16 scales are read in place: one 4-byte broadcast converts a
 * pair's two scales into the alternating lanes they multiply. */
#define I8_NR 4
#if defined(__AVX512VL__)
#define I8_MR 4 /* 16 accumulators of 32 registers */
#else
#define I8_MR 1 /* 4 of 16 */
#endif
static inline __attribute__((always_inline)) void int8_tile(const uint8_t *w, long row_bytes, const int format,
                                                            const quantized_inputs *in, const uint16_t *bias,
                                                            void *y, int K, long y_stride, int n0, int m0,
                                                            const int mr, int f32) {
    const int blocks = K / 32, stride = (blocks + 7) / 8 * 8, pair_bytes = format == FMT_Q8_0 ? 64 : 32;
    const long quant_bytes = format == FMT_Q8_0 ? K : K / 2;
    const __m256i low = _mm256_set1_epi8(15);
    __m256 acc[I8_NR][I8_MR];
    for (int i = 0; i < I8_NR; i++)
        for (int j = 0; j < mr; j++) acc[i][j] = _mm256_setzero_ps();
    for (int p = 0; p < blocks / 2; p++) {
        __m256i lo[I8_NR], hi[I8_NR];
        __m256 scale[I8_NR];
        for (int i = 0; i < I8_NR; i++) {
            const uint8_t *row = w + (n0 + i) * row_bytes, *quants = row + (long)p * pair_bytes;
            if (format == FMT_Q8_0) {
                lo[i] = _mm256_loadu_si256((const __m256i *)quants);
                hi[i] = _mm256_loadu_si256((const __m256i *)(quants + 32));
            } else {
                __m256i v = _mm256_loadu_si256((const __m256i *)quants);
                lo[i] = _mm256_and_si256(v, low);
                hi[i] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            }
            int32_t halves;
            memcpy(&halves, row + quant_bytes + 4 * p, 4);
            scale[i] = _mm256_cvtph_ps(_mm_set1_epi32(halves));
        }
        for (int j = 0; j < mr; j++) {
            const int8_t *q = in->q + (long)(m0 + j) * K + (long)p * 64;
            __m256i xlo = _mm256_loadu_si256((const __m256i *)q), xhi = _mm256_loadu_si256((const __m256i *)(q + 32));
            __m256 dx = _mm256_castpd_ps(_mm256_broadcast_sd((const double *)&in->dx[(long)(m0 + j) * stride + 2 * p]));
            for (int i = 0; i < I8_NR; i++) {
                __m256i sums = dot_u8s8(dot_u8s8(_mm256_setzero_si256(), lo[i], xlo), hi[i], xhi);
                acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(scale[i], dx), acc[i][j]);
            }
        }
    }
    /* The minimums' term, sum over blocks of m * sx: Q4_1's own m, else a multiple of the scale. Then the four
     * rows' sums at once: one reduction tree, the bias, (bf16 rounding,) one store. */
    const long m_offset = quant_bytes + (format == FMT_Q4_1 ? 2 * blocks : 0);
    const __m256 factor = _mm256_set1_ps(format == FMT_Q4_1 ? 1.0f : format == FMT_Q8_0 ? -128.0f : -8.0f);
    __m128 add = _mm_setzero_ps();
    if (bias)
        for (int i = 0; i < I8_NR; i++) add[i] = bf16_to_float(bias[n0 + i]);
    for (int j = 0; j < mr; j++) {
        const float *sx = in->sx + (long)(m0 + j) * stride;
        __m256 total[I8_NR];
        for (int i = 0; i < I8_NR; i++) {
            const uint8_t *m = w + (n0 + i) * row_bytes + m_offset;
            __m256 minimum = _mm256_setzero_ps();
            for (int b = 0; b < stride; b += 8) {  /* sx is zero past the last block; the minimums are not there */
                __m128i halves = b + 8 <= blocks ? _mm_loadu_si128((const __m128i *)(m + 2 * b)) : _mm_setzero_si128();
                if (b + 8 > blocks) memcpy(&halves, m + 2 * b, 2 * (blocks - b));
                minimum = _mm256_fmadd_ps(_mm256_cvtph_ps(halves), _mm256_loadu_ps(sx + b), minimum);
            }
            total[i] = _mm256_fmadd_ps(minimum, factor, acc[i][j]);
        }
        __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(total[0], total[1]), _mm256_hadd_ps(total[2], total[3]));
        __m128 sums = _mm_add_ps(_mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1)), add);
        if (f32) {
            _mm_storeu_ps((float *)y + (long)(m0 + j) * y_stride + n0, sums);
            continue;
        }
        __m128i u = _mm_castps_si128(sums);  /* to bf16, nearest even, as to_bf16 */
        __m128i rounded = _mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(u, _mm_set1_epi32(0x7fff)),
                                                       _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1))), 16);
        __m128i nan = _mm_castps_si128(_mm_cmpunord_ps(sums, sums));
        rounded = _mm_blendv_epi8(rounded, _mm_or_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(0x40)), nan);
        __m128i packed = _mm_packus_epi32(rounded, rounded);
        _mm_storel_epi64((__m128i *)((uint16_t *)y + (long)(m0 + j) * y_stride + n0), packed);
    }
}

static int int8_linear(const void *x, const uint8_t *w, int format, const uint16_t *bias, void *y, int M, int N,
                       int K, long x_stride, long y_stride, int threads, int f32) {
    int blocks = K / 32, padded = (blocks + 7) / 8 * 8;  /* each input row's dx and sx, padded to 8 */
    long row_bytes = (long)blocks * block_bytes(format);
    quantized_inputs in = {malloc((size_t)M * K), calloc((size_t)M * padded, sizeof(float)),
                           calloc((size_t)M * padded, sizeof(float))};
    if (!in.q || !in.dx || !in.sx) { free(in.q); free(in.dx); free(in.sx); return -2; }
    int full = M / I8_MR * I8_MR;
    #pragma omp parallel num_threads(threads)
    {
    int share = (M + omp_get_num_threads() - 1) / omp_get_num_threads(), first = omp_get_thread_num() * share;
    quantize_inputs(x, f32, first < M ? first : M, first + share < M ? first + share : M, K, x_stride, &in, padded);
    #pragma omp barrier
    #pragma omp for schedule(dynamic, 4)
    for (int n0 = 0; n0 < N; n0 += I8_NR) {
        if (n0 + I8_NR < N)  /* the next tile's rows, usually this thread's next: ask for them while this one runs */
            for (long b = 0; b < I8_NR * row_bytes; b += 64) __builtin_prefetch(w + (n0 + I8_NR) * row_bytes + b, 0, 3);
#define I4_0_TILE(mr, m0) int8_tile(w, row_bytes, FMT_Q4_0, &in, bias, y, K, y_stride, n0, m0, mr, f32)
#define I4_1_TILE(mr, m0) int8_tile(w, row_bytes, FMT_Q4_1, &in, bias, y, K, y_stride, n0, m0, mr, f32)
#define I8_0_TILE(mr, m0) int8_tile(w, row_bytes, FMT_Q8_0, &in, bias, y, K, y_stride, n0, m0, mr, f32)
#define I8_TILES(TILE) \
    do { \
        for (int m0 = 0; m0 < full; m0 += I8_MR) TILE(I8_MR, m0); \
        for (int m0 = full; m0 < M; m0++) TILE(1, m0); \
    } while (0)
        switch (format) {
            case FMT_Q4_0: I8_TILES(I4_0_TILE); break;
            case FMT_Q4_1: I8_TILES(I4_1_TILE); break;
            default: I8_TILES(I8_0_TILE); break;
        }
    }
    }
    free(in.q); free(in.dx); free(in.sx);
    return 0;
}
#else
static inline int int8_path(int format, int K) { (void)format; (void)K; return 0; }
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* -- int8 dot products on 512-bit VNNI, tiles of 16 weight rows ------------------------------------------------------
 * The same arithmetic as int8_linear (inputs quantized per block of 32, exact int32 block sums, the minimums'
 * term), with the weights laid out so that one vector holds 4 consecutive quants of 16 rows: a dpbusd against
 * 4 input quants broadcast from memory is 64 products, and one cvt and two fmadds per block scale 16 outputs.
 * The pair layout above spends that per 8 outputs, a third of the products per instruction, which left
 * prefills and batches compute-bound. Per tile of 16 rows and per block: the quants (Q4: 4 vectors, whose
 * low nibbles are weights 4h..4h+3 and high ones 16+4h..; Q8_0: 8 vectors, + 128), the 16 fp16 scales, then
 * (Q4_1) the 16 fp16 minimums: the same bytes as GGUF's, tile by tile in the order they are read. */
#define TILED_ROWS 16
#define TILED_MR 6  /* input rows per pass over a tile: 6 accumulators, 8 weight vectors, of 32 registers */
/* A decode's tiles stream from DRAM, each thread through one contiguous range of them (static schedule):
 * asking for the bytes this far ahead keeps enough loads in flight, where the hardware prefetcher, restarted
 * at every short range a dynamic schedule handed out, did not. */
#define PREFETCH_BYTES 4096
#define OWN_COPY_ROWS 8  /* up to this many input rows, each thread quantizes them all (see tiled_linear) */
static inline int tiled_path(int K) { return K % 32 == 0; }

static inline int tiled_block_bytes(int format) {
    switch (format) {
        case FMT_Q8_0: return 512 + 32;
        case FMT_Q4_1: return 256 + 64;
        case FMT_Q4_K_32: return 256 + 128;
        case FMT_Q5_K_32: return 512 + 128;
        case FMT_Q6_K_32: return 512 + 32 + 32;
        default: return 256 + 32;
    }
}

/* Whether a format's quants take a byte each in a tile (else a nibble). */
static inline int byte_quants(int format) { return format == FMT_Q8_0 || format == FMT_Q5_K_32 || format == FMT_Q6_K_32; }

/* Q6_K's block of 16 rows: its weights are signed (q - 32), so dpbusd takes them as its signed operand and the
 * inputs as the unsigned one, shifted by 128 (x + 128 in 1..255); 128 times the weights' sum over each half, a
 * product of the weights alone, comes back out in int32. Each half then has its own scale, d * sc. */
static inline __attribute__((always_inline)) void q6_block(const uint8_t *block, const int8_t *q, const float *dx,
                                                           int K, int blocks, int b, int m0, const int mr, __m512 *acc) {
    __m512i w[8];
    for (int g = 0; g < 8; g++) w[g] = _mm512_loadu_si512(block + 64 * g);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(block + 512)));
    const __m512i pairs = _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(block + 544)));  /* hi:lo */
    const __m512 scale_lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(pairs, 24), 24)));
    const __m512 scale_hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_srai_epi32(pairs, 8)));
    const __m512i shift = _mm512_set1_epi8((char)0x80);
    __m512i back_lo = _mm512_setzero_si512(), back_hi = _mm512_setzero_si512();
    for (int g = 0; g < 4; g++) {
        back_lo = _mm512_dpbusd_epi32(back_lo, shift, w[g]);
        back_hi = _mm512_dpbusd_epi32(back_hi, shift, w[g + 4]);
    }
    for (int j = 0; j < mr; j++) {
        const int8_t *xq = q + (long)(m0 + j) * K + b * 32;
        __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
        for (int g = 0; g < 4; g++) {
            uint32_t four, four_hi;
            memcpy(&four, xq + 4 * g, 4);
            memcpy(&four_hi, xq + 16 + 4 * g, 4);
            lo = _mm512_dpbusd_epi32(lo, _mm512_set1_epi32((int)(four ^ 0x80808080u)), w[g]);
            hi = _mm512_dpbusd_epi32(hi, _mm512_set1_epi32((int)(four_hi ^ 0x80808080u)), w[g + 4]);
        }
        __m512 sum = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(lo, back_lo)), scale_lo);
        sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(hi, back_hi)), scale_hi, sum);
        acc[j] = _mm512_fmadd_ps(sum, _mm512_set1_ps(dx[(long)(m0 + j) * blocks + b]), acc[j]);
    }
}

/* Input rows [first, last) (bf16, or fp32 with f32): int8 quants in their own order (q, M x K), and per block dx
 * and sx = dx * sum(q). */
static void quantize_rows(const void *x, int f32, int first, int last, int K, long x_stride, int8_t *q, float *dx,
                          float *sx) {
    const int blocks = K / 32;
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int m = first; m < last; m++)
        for (int b = 0; b < blocks; b++) {
            __m512 v0, v1;
            if (f32) {
                const float *p = (const float *)x + (long)m * x_stride + b * 32;
                v0 = _mm512_loadu_ps(p);
                v1 = _mm512_loadu_ps(p + 16);
            } else {
                const uint16_t *p = (const uint16_t *)x + (long)m * x_stride + b * 32;
                v0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
                v1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + 16))), 16));
            }
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1)));
            float d = amax / 127.0f;
            __m512 id = _mm512_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
            __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, id)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, id));
            int8_t *out = q + (long)m * K + b * 32;
            _mm_storeu_si128((__m128i *)out, _mm512_cvtsepi32_epi8(q0));  /* |q| <= 127: no saturation */
            _mm_storeu_si128((__m128i *)(out + 16), _mm512_cvtsepi32_epi8(q1));
            dx[(long)m * blocks + b] = d;
            sx[(long)m * blocks + b] = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        }
}

static inline __attribute__((always_inline)) void tiled_tile(const uint8_t *tile, const int format, int blocks,
                                                             const int8_t *q, const float *dx, const float *sx,
                                                             int K, const uint16_t *bias, void *y,
                                                             long y_stride, int n0, int m0, const int mr, int f32) {
    const int quants = byte_quants(format) ? 512 : 256, bytes = tiled_block_bytes(format);
    const __m512i low = _mm512_set1_epi8(15);
    const __m512 offset = _mm512_set1_ps(format == FMT_Q8_0 ? -128.0f : -8.0f);
    __m512 acc[TILED_MR];
    for (int j = 0; j < mr; j++) acc[j] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const uint8_t *block = tile + (long)b * bytes;
        for (int l = 0; l < bytes; l += 64) __builtin_prefetch(block + PREFETCH_BYTES + l, 0, 0);
        if (format == FMT_Q6_K_32) {
            q6_block(block, q, dx, K, blocks, b, m0, mr, acc);
            continue;
        }
        __m512i w[8];
        if (byte_quants(format)) {
            for (int g = 0; g < 8; g++) w[g] = _mm512_loadu_si512(block + 64 * g);
        } else {
            for (int h = 0; h < 4; h++) {
                __m512i v = _mm512_loadu_si512(block + 64 * h);
                w[h] = _mm512_and_si512(v, low);
                w[h + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
        }
        __m512 d, minimum;
        if (from_k_quant(format)) {
            d = _mm512_loadu_ps(block + quants);
            minimum = _mm512_loadu_ps(block + quants + 64);
        } else {
            d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(block + quants)));
            minimum = format == FMT_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(block + quants + 32)))
                                         : _mm512_mul_ps(d, offset);
        }
        for (int j = 0; j < mr; j++) {
            const int8_t *xq = q + (long)(m0 + j) * K + b * 32;
            __m512i sums = _mm512_setzero_si512();
            for (int g = 0; g < 8; g++) {
                int32_t four;
                memcpy(&four, xq + 4 * g, 4);
                sums = _mm512_dpbusd_epi32(sums, w[g], _mm512_set1_epi32(four));
            }
            long at = (long)(m0 + j) * blocks + b;
            acc[j] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(dx[at])), d, acc[j]);
            acc[j] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(sx[at]), acc[j]);
        }
    }
    __m512 add = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(bias + n0))), 16))
                      : _mm512_setzero_ps();
    for (int j = 0; j < mr; j++) {  /* fp32, or to bf16, nearest even, as to_bf16 */
        __m512 v = _mm512_add_ps(acc[j], add);
        if (f32) {
            _mm512_storeu_ps((float *)y + (long)(m0 + j) * y_stride + n0, v);
            continue;
        }
        __m512i u = _mm512_castps_si512(v);
        __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                                             _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
        __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
        _mm256_storeu_si256((__m256i *)((uint16_t *)y + (long)(m0 + j) * y_stride + n0), _mm512_cvtepi32_epi16(rounded));
    }
}

/* The quantized inputs live in the call's scratch (SCRATCH_LINEAR): no allocation per step. */
static int tiled_linear(scratch *s, const void *x, const uint8_t *w, int format, const uint16_t *bias, void *y, int M, int N,
                        int K, long x_stride, long y_stride, int threads, int f32) {
    const int blocks = K / 32;
    const long tile_bytes = (long)blocks * tiled_block_bytes(format);
    /* A few rows: every thread quantizes all of them into a copy of its own (the same bytes: one code path),
     * which costs less than the barrier that sharing the work needs before any tile can start. */
    const int own_copy = M <= OWN_COPY_ROWS;
    const size_t copy = ((size_t)M * K + 2 * sizeof(float) * (size_t)M * blocks + 63) / 64 * 64;
    const size_t need = copy * (own_copy ? threads : 1);
    char *memory = scratch_reserve(s, SCRATCH_LINEAR, need);  /* with own_copy, a part for each worker */
    if (!memory) return -2;
    const int full = M / TILED_MR * TILED_MR;
    #pragma omp parallel num_threads(threads)
    {
    float *dx = (float *)(memory + (own_copy ? copy * omp_get_thread_num() : 0));
    float *sx = dx + (size_t)M * blocks;
    int8_t *q = (int8_t *)(sx + (size_t)M * blocks);
    if (own_copy) {
        quantize_rows(x, f32, 0, M, K, x_stride, q, dx, sx);
    } else {
        int share = (M + omp_get_num_threads() - 1) / omp_get_num_threads(), first = omp_get_thread_num() * share;
        quantize_rows(x, f32, first < M ? first : M, first + share < M ? first + share : M, K, x_stride, q, dx, sx);
        #pragma omp barrier
    }
    #pragma omp for schedule(static) nowait
    for (int t = 0; t < N / TILED_ROWS; t++) {
        const uint8_t *tile = w + t * tile_bytes;
        const int n0 = t * TILED_ROWS;
#define T4_0(mr, m0) tiled_tile(tile, FMT_Q4_0, blocks, q, dx, sx, K, bias, y, y_stride, n0, m0, mr, f32)
#define T4_1(mr, m0) tiled_tile(tile, FMT_Q4_1, blocks, q, dx, sx, K, bias, y, y_stride, n0, m0, mr, f32)
#define T8_0(mr, m0) tiled_tile(tile, FMT_Q8_0, blocks, q, dx, sx, K, bias, y, y_stride, n0, m0, mr, f32)
#define T4_K(mr, m0) tiled_tile(tile, FMT_Q4_K_32, blocks, q, dx, sx, K, bias, y, y_stride, n0, m0, mr, f32)
#define T5_K(mr, m0) tiled_tile(tile, FMT_Q5_K_32, blocks, q, dx, sx, K, bias, y, y_stride, n0, m0, mr, f32)
#define T6_K(mr, m0) tiled_tile(tile, FMT_Q6_K_32, blocks, q, dx, sx, K, bias, y, y_stride, n0, m0, mr, f32)
#define T_TILES(TILE) \
    do { \
        for (int m0 = 0; m0 < full; m0 += TILED_MR) TILE(TILED_MR, m0); \
        switch (M - full) { \
            case 1: TILE(1, full); break; case 2: TILE(2, full); break; case 3: TILE(3, full); break; \
            case 4: TILE(4, full); break; case 5: TILE(5, full); break; default: break; \
        } \
    } while (0)
        switch (format) {
            case FMT_Q4_0: T_TILES(T4_0); break;
            case FMT_Q4_1: T_TILES(T4_1); break;
            case FMT_Q4_K_32: T_TILES(T4_K); break;
            case FMT_Q5_K_32: T_TILES(T5_K); break;
            case FMT_Q6_K_32: T_TILES(T6_K); break;
            default: T_TILES(T8_0); break;
        }
    }
    }
    return 0;
}

/* GGUF blocks (or a K-quant's blocks of 32) into tiles (see above). */
static void pack_tiles(const uint8_t *src, int format, int N, int K, uint8_t *dst) {
    const int k = from_k_quant(format), bytes = k ? k_block_bytes(format) : block_bytes(format), blocks = K / 32;
    /* the block's head: its scale (an fp32 one for Q4_K, Q5_K), then a minimum (or Q6_K's two int8 scales) */
    const int scale = format == FMT_Q4_K_32 || format == FMT_Q5_K_32 ? 4 : 2;
    const int head = k || format == FMT_Q4_1 ? 2 * scale : 2;
    const int quants = byte_quants(format) ? 512 : 256, out_bytes = tiled_block_bytes(format);
    for (int t = 0; t < N / TILED_ROWS; t++)
        for (int b = 0; b < blocks; b++) {
            uint8_t *out = dst + ((long)t * blocks + b) * out_bytes;
            for (int r = 0; r < TILED_ROWS; r++) {
                const uint8_t *block = src + ((long)(t * TILED_ROWS + r) * blocks + b) * bytes;
                memcpy(out + quants + scale * r, block, scale);
                if (head > scale) memcpy(out + quants + 16 * scale + scale * r, block + scale, scale);
                for (int i = 0; i < bytes - head; i++)  /* quant byte i: vector i / 4, lane r, byte i % 4 */
                    out[64 * (i / 4) + 4 * r + i % 4] = format == FMT_Q8_0 ? (uint8_t)(block[head + i] ^ 0x80)
                                                                           : block[head + i];
            }
        }
}
#else
static inline int tiled_path(int K) { (void)K; return 0; }
#endif

/* y = x . w (+ bias) for weights in a GGUF quantization laid out by pack_blocks; x and y bf16, or fp32 with f32. */
static int quantized_linear(scratch *s, const void *x, const uint8_t *w, int format, const uint16_t *bias, void *y, int M, int N,
                            int K, long x_stride, long y_stride, int threads, int f32) {
    format = same_layout(format);
    if (M < 1 || M > 512 || K % 32 || N % 16 || K / 32 > MAX_BLOCKS) return -1;
    if (!block_bytes(format) && !(from_k_quant(format) && tiled_path(K))) return -1;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (tiled_path(K)) return tiled_linear(s, x, w, format, bias, y, M, N, K, x_stride, y_stride, threads, f32);
#endif
#ifdef __AVX2__
    if (int8_path(format, K)) return int8_linear(x, w, format, bias, y, M, N, K, x_stride, y_stride, threads, f32);
#endif
    return dequantized_linear(x, w, format, bias, y, M, N, K, x_stride, y_stride, threads, f32);
}

/* How pack_blocks lays out `format` with K inputs: "tiles" (512-bit VNNI), "pairs" (the int8 path), "rows". */
const char *pack_layout(int format, int K) {
    format = same_layout(format);
    if (tiled_path(K)) return "tiles";
    if (from_k_quant(format)) return "none";
    return int8_path(format, K) ? "pairs" : "rows";
}

/* GGUF blocks (N rows of K / 32 blocks) into the layout quantized_linear reads, the same number of bytes: per
 * row the quants (pairs of blocks interleaved for the int8 path, GGUF's order otherwise), then the fp16 scales,
 * then (Q4_1) the fp16 minimums. 0, or -1 for a format or shape it does not take. */
int pack_blocks(const uint8_t *src, int format, int N, int K, uint8_t *dst) {
    format = same_layout(format);
    int bytes = block_bytes(format), blocks = K / 32, head = format == FMT_Q4_1 ? 4 : 2, q_bytes = bytes - head;
    if ((!bytes && !from_k_quant(format)) || K % 32 || blocks > MAX_BLOCKS) return -1;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (tiled_path(K)) {
        if (N % TILED_ROWS) return -1;
        pack_tiles(src, format, N, K, dst);
        return 0;
    }
#endif
    if (from_k_quant(format)) return -1;  /* the tiled path's only */
    int paired = int8_path(format, K);
    for (long n = 0; n < N; n++) {
        const uint8_t *row = src + n * blocks * bytes;
        uint8_t *out = dst + n * blocks * bytes, *scales = out + (long)blocks * q_bytes;
        for (int b = 0; b < blocks; b++) {
            const uint8_t *block = row + (long)b * bytes;
            memcpy(scales + 2 * b, block, 2);
            if (format == FMT_Q4_1) memcpy(scales + 2 * blocks + 2 * b, block + 2, 2);
            for (int t = 0; t < q_bytes; t++) {
                uint8_t v = block[head + t];
                if (!paired) { out[(long)b * q_bytes + t] = v; continue; }
                /* byte t of the block: Q4 holds weights t and t + 16; Q8_0 weight t (stored + 128) */
                int side = b % 2, within = format == FMT_Q8_0 ? t % 16 : t, half = format == FMT_Q8_0 ? t / 16 : 0;
                long at = (long)(b / 2) * 2 * q_bytes + half * 32 + 8 * (within / 4) + 4 * side + within % 4;
                out[at] = format == FMT_Q8_0 ? (uint8_t)(v ^ 0x80) : v;
            }
        }
    }
    return 0;
}

/* The bf16 linear every caller uses: AMX where the build has it, the vector kernel elsewhere. */
int cpu_linear(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int M, int N, int K,
               long x_stride, long y_stride, int threads) {
#ifdef __AMX_TILE__
    return amx_linear(x, w, bias, y, M, N, K, x_stride, y_stride, threads);
#else
    return vector_linear(x, w, bias, y, M, N, K, x_stride, y_stride, threads);
#endif
}

/* Any weight format: bf16 (30) or a GGUF quantization (2, 3, 8). x and y are bf16, or with f32 fp32 (the
 * activations of the quantized path, as llama.cpp keeps them); a bf16 weight then reads x rounded to bf16.
 * Intermediates in s. */
int scratch_linear(scratch *s, const void *x, const void *w, int format, const uint16_t *bias, void *y, int M, int N,
                   int K, long x_stride, long y_stride, int threads, int f32) {
    if (format != FMT_BF16) return quantized_linear(s, x, (const uint8_t *)w, format, bias, y, M, N, K, x_stride, y_stride, threads, f32);
    if (!f32) return cpu_linear(x, (const uint16_t *)w, bias, y, M, N, K, x_stride, y_stride, threads);
    if (M < 1 || M > 512 || K % 32 || N % 16) return -1;
    uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)M * K), *yb = malloc(sizeof(uint16_t) * (size_t)M * N);
    int status = xb && yb ? 0 : -2;
    for (int m = 0; m < M && status == 0; m++)
        for (int k = 0; k < K; k += LANES) store_bf16(xb + (long)m * K + k, load_f32((const float *)x + m * x_stride + k));
    if (status == 0) status = cpu_linear(xb, (const uint16_t *)w, bias, yb, M, N, K, K, N, threads);
    for (int m = 0; m < M && status == 0; m++)
        for (int n = 0; n < N; n += LANES) store_f32((float *)y + m * y_stride + n, load_bf16(yb + (long)m * N + n));
    free(xb);
    free(yb);
    return status;
}

/* scratch_linear with a scratch of the pool's: the export for Python. */
int any_linear(const void *x, const void *w, int format, const uint16_t *bias, void *y, int M, int N, int K,
               long x_stride, long y_stride, int threads, int f32) {
    scratch *s = scratch_take();
    if (!s) return -2;
    int status = scratch_linear(s, x, w, format, bias, y, M, N, K, x_stride, y_stride, threads, f32);
    scratch_give(s);
    return status;
}

/* How quantized_linear computes `format` with K inputs: "int8 VNNI", "int8 AVX-VNNI", "int8 maddubs" (inputs
 * quantized per block, as llama.cpp does), or "fp32" (weights dequantized in registers, inputs as they are). */
const char *quant_math(int format, int K) {
    if (tiled_path(K)) return "int8 VNNI";
    if (!int8_path(format, K)) return "fp32";
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return "int8 VNNI";
#elif defined(__AVXVNNI__)
    return "int8 AVX-VNNI";
#else
    return "int8 maddubs";
#endif
}

const char *kernel_isa(void) {
#if defined(__AMX_TILE__)
    return "amx";
#elif defined(__AVX512BF16__)
    return "avx512-bf16";
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
