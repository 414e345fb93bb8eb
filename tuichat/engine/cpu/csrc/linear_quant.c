/* The linear over weights kept as GGUF stores them (Q8_0, Q4_0, Q4_1 and blocks re-cut from the K-quants), in
 * every build: a decode step is bound by reading the weights, and these are 1.06, 0.56 and 0.63 bytes a weight
 * against bf16's 2. quantized_linear picks the fastest path the build has for a format and shape: the tiled int8 one
 * (arch/x86/linear_vnni512.c), the paired int8 one (arch/x86/linear_int8.c), else the portable fp32 one here.
 * Here quantized weights are expanded a tile at a time, exactly (d * q + m is exact in fp32 before its one
 * rounding, as gguf's own dequantization computes it), into the same fp32 tile the bf16 weights widen to: no
 * activation is quantized, so the result is the dequantized model's, to fp32 summation order. */
#include <omp.h>
#include <stdlib.h>

#include "linear.h"

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
 * of `format`, here the quants in GGUF's own order. Where no int8 path runs. */
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
/* y = x . w (+ bias) for weights in a GGUF quantization laid out by pack_blocks, or K-quants as the file holds
 * them; x and y bf16, or fp32 with f32. */
int quantized_linear(scratch *s, const void *x, const uint8_t *w, int format, const uint16_t *bias, void *y, int M, int N,
                     int K, long x_stride, long y_stride, int threads, int f32) {
    if (kquant_format(format)) return kquant_linear(s, x, w, format, bias, y, M, N, K, x_stride, y_stride, threads, f32);
    format = same_layout(format);
    if (M < 1 || M > 512 || K % 32 || N % 16 || K / 32 > MAX_BLOCKS) return -1;
    if (!block_bytes(format) && !(tiled_only(format) && tiled_path(K))) return -1;
    if (five_bit(format) && !tiled_path(K) && !int8_path(K)) return -1; /* no rows layout */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (tiled_path(K)) return tiled_linear(s, x, w, format, bias, y, M, N, K, x_stride, y_stride, threads, f32);
#endif
#ifdef __AVX2__
    if (int8_path(K)) return int8_linear(s, x, w, format, bias, y, M, N, K, x_stride, y_stride, threads, f32);
#endif
    return dequantized_linear(x, w, format, bias, y, M, N, K, x_stride, y_stride, threads, f32);
}

/* How quantized_linear computes `format` with K inputs: "int8 VNNI", "int8 AVX-VNNI", "int8 maddubs" (inputs
 * quantized per block, as llama.cpp does), "int8 AVX-512" or "int8" (K-quants in place, inputs per 256), or "fp32"
 * (weights dequantized in registers, inputs as they are). */
const char *quant_math(int format, int K) {
#if defined(__AVX512BW__)
    if (kquant_format(format)) return "int8 AVX-512";
#else
    if (kquant_format(format)) return "int8";
#endif
    if (tiled_path(K)) return "int8 VNNI";
    if (!int8_path(K)) return "fp32";
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return "int8 VNNI";
#elif defined(__AVXVNNI__)
    return "int8 AVX-VNNI";
#else
    return "int8 maddubs";
#endif
}
