/* int8 dot products over pairs of blocks (AVX512-VNNI, AVX-VNNI, or AVX2's maddubs), as llama.cpp computes Q4_0,
 * Q4_1 and Q8_0; quantized_linear (linear_quant.c) runs them where the tiled path does not.
 * The inputs are quantized per block of 32 to int8 with one fp32 scale (dx = max|x| / 127), the weights' quants
 * are unsigned bytes (Q4's nibbles, or with VNNI Q8_0's int8 + 128), and a block's dot product is exact in int32:
 *   x . w = dw * dx * sum(q_w * q_x) + m * dx * sum(q_x)    (m: Q4_1's minimum; -8 dw for Q4_0, -128 dw for Q8_0)
 * Without VNNI, Q8_0 keeps the file's signed bytes (I8_SIGNED_Q8): maddubs's int16 pairs would saturate at
 * 255 * 127 * 2, so it multiplies |q_w| by q_x carrying q_w's sign, at most 128 * 127 * 2, and needs no m.
 * Each dpbusd lane sums 4 products; two blocks share a 32-byte vector, their 4-byte groups alternating, so that
 * lanes 0, 2, 4, 6 hold one block and 1, 3, 5, 7 the other and one 8-byte broadcast carries both blocks' scales.
 * pack_blocks (pack.c) lays the weights out so; quantize_inputs does the same for the inputs. */
#include <omp.h>
#include <stdlib.h>

#include "../../linear.h"

#ifdef __AVX2__
#include <immintrin.h>
int int8_path(int K) { return K % 64 == 0; }

/* The int32 sums of a pair of blocks (alternating lanes) of weights lo and hi (each block's weights 0..15 and
 * 16..31) times the inputs xlo and xhi. */
static inline __m256i pair_dot(__m256i lo, __m256i hi, __m256i xlo, __m256i xhi, const int q8) {
    (void)q8;
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, xlo), hi, xhi);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), lo, xlo), hi, xhi);
#else
    const __m256i ones = _mm256_set1_epi16(1);
    if (q8) /* |q_w| times q_x with q_w's sign: int16 pairs up to 128 * 127 * 2, each half widened on its own */
        return _mm256_add_epi32(
            _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(lo), _mm256_sign_epi8(xlo, lo)), ones),
            _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(hi), _mm256_sign_epi8(xhi, hi)), ones));
    /* nibbles: int16 pairs up to 15 * 127 * 2, so the halves add in int16 before the one widening */
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi)), ones);
#endif
}

/* Input row m: int8 quants in pairs of blocks (64 bytes a pair: weights 0..15 of both, then 16..31, groups of 4
 * alternating), and per block dx and sx = dx * sum(q), rows `stride` blocks apart (padded to 8, with zeros). */
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
        for (int b = K / 32; b < stride; b++) out->dx[(long)m * stride + b] = out->sx[(long)m * stride + b] = 0.0f;
    }
}

/* The first n (even) of 8 halves at p, zeros after, loaded without reading past them or through memory (a
 * partial copy to the stack, then a full load, waited for the store every tile). */
static inline __m128i first_halves(const uint8_t *p, int n) {
    if (n >= 8) return _mm_loadu_si128((const __m128i *)p);
    __m128i v = n >= 4 ? _mm_loadl_epi64((const __m128i *)p) : _mm_setzero_si128();
    if (n % 4 == 0) return v;
    int32_t two;
    memcpy(&two, p + 2 * (n - 2), 4);
    return n == 2 ? _mm_insert_epi32(v, two, 0) : _mm_insert_epi32(v, two, 2);
}

/* A decode streams each thread's rows from DRAM: asking this far ahead, into L2, keeps enough loads in flight (as
 * linear_kquant.c's row tiles do). */
#define I8_AHEAD 8192
#define I8_HINT _MM_HINT_T2

/* NR weight rows times mr input rows. A row's fp16 scales are read in place: one 4-byte broadcast converts a
 * pair's two scales into the alternating lanes they multiply. */
#define I8_NR 4
#if defined(__AVX512VL__)
#define I8_MR 4 /* 16 accumulators of 32 registers */
#else
#define I8_MR 2 /* 8 accumulators of 16 registers: some spill, still faster than one input row a pass */
#endif
static inline __attribute__((always_inline)) void int8_tile(const uint8_t *w, long row_bytes, const int format,
                                                            const quantized_inputs *in, const uint16_t *bias,
                                                            void *y, int K, long y_stride, int n0, int m0,
                                                            const int mr, int f32) {
    const int blocks = K / 32, stride = (blocks + 7) / 8 * 8, pair_bytes = format == FMT_Q8_0 ? 64 : 32;
    const int bytes = block_bytes(format);
    const long quant_bytes = format == FMT_Q8_0 ? K : K / 2;
    const __m256i low = _mm256_set1_epi8(15);
    /* The minimums' term, sum over blocks of m * sx (Q4_1's own m, else a multiple of the scale), first and into
     * memory: with its loops after the main one, GCC kept the accumulators in memory, two stores a pass each. */
    const long m_offset = quant_bytes + (format == FMT_Q4_1 ? 2 * blocks : 0);
    _Alignas(32) float minimums[I8_MR][I8_NR][8];
    for (int j = 0; j < mr; j++)
        for (int i = 0; i < I8_NR; i++) {
            if (format == FMT_Q8_0 && I8_SIGNED_Q8) break; /* no minimum */
            const float *sx = in->sx + (long)(m0 + j) * stride;
            const uint8_t *m = w + (n0 + i) * row_bytes + m_offset;
            __m256 minimum = _mm256_setzero_ps();
            for (int b = 0; b < stride; b += 8)  /* sx is zero past the last block; the minimums are not there */
                minimum = _mm256_fmadd_ps(_mm256_cvtph_ps(first_halves(m + 2 * b, blocks - b)), _mm256_loadu_ps(sx + b), minimum);
            _mm256_store_ps(minimums[j][i], minimum);
        }
    __m256 acc[I8_NR][I8_MR];
    for (int i = 0; i < I8_NR; i++)
        for (int j = 0; j < mr; j++) acc[i][j] = _mm256_setzero_ps();
    for (int p = 0; p < blocks / 2; p++) {
        /* The tile's rows lie one after another, and a thread's tiles too: one stream, asked for I8_AHEAD on */
        const char *ahead = (const char *)w + n0 * row_bytes + (long)p * I8_NR * 2 * bytes + I8_AHEAD;
        for (int line = 0; line < I8_NR * 2 * bytes; line += 64) _mm_prefetch(ahead + line, I8_HINT);
        /* A row at a time (its vectors dead before the next row's): 16 registers hold AVX2's tile */
        __m256i xlo[I8_MR], xhi[I8_MR];
        __m256 dx[I8_MR];
        for (int j = 0; j < mr; j++) {
            const int8_t *q = in->q + (long)(m0 + j) * K + (long)p * 64;
            xlo[j] = _mm256_loadu_si256((const __m256i *)q);
            xhi[j] = _mm256_loadu_si256((const __m256i *)(q + 32));
            dx[j] = _mm256_castpd_ps(_mm256_broadcast_sd((const double *)&in->dx[(long)(m0 + j) * stride + 2 * p]));
        }
        for (int i = 0; i < I8_NR; i++) {
            const uint8_t *row = w + (n0 + i) * row_bytes, *quants = row + (long)p * pair_bytes;
            __m256i lo, hi;
            if (format == FMT_Q8_0) {
                lo = _mm256_loadu_si256((const __m256i *)quants);
                hi = _mm256_loadu_si256((const __m256i *)(quants + 32));
            } else {
                __m256i v = _mm256_loadu_si256((const __m256i *)quants);
                lo = _mm256_and_si256(v, low);
                hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            }
            int32_t halves;
            memcpy(&halves, row + quant_bytes + 4 * p, 4);
            const __m256 scale = _mm256_cvtph_ps(_mm_set1_epi32(halves));
            for (int j = 0; j < mr; j++) {
                __m256i sums = pair_dot(lo, hi, xlo[j], xhi[j], format == FMT_Q8_0);
                acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(scale, dx[j]), acc[i][j]);
            }
        }
    }
    /* The minimums' term, sum over blocks of m * sx: Q4_1's own m, else a multiple of the scale. Then the four
     * rows' sums at once: one reduction tree, the bias, (bf16 rounding,) one store. */
    /* The four rows' sums at once: one reduction tree, the bias, (bf16 rounding,) one store. */
    const __m256 factor = _mm256_set1_ps(format == FMT_Q4_1 ? 1.0f : format == FMT_Q8_0 ? -128.0f : -8.0f);
    __m128 add = _mm_setzero_ps();
    if (bias)
        for (int i = 0; i < I8_NR; i++) add[i] = bf16_to_float(bias[n0 + i]);
    for (int j = 0; j < mr; j++) {
        __m256 total[I8_NR];
        for (int i = 0; i < I8_NR; i++)
            total[i] = format == FMT_Q8_0 && I8_SIGNED_Q8 ? acc[i][j]
                                                          : _mm256_fmadd_ps(_mm256_load_ps(minimums[j][i]), factor, acc[i][j]);
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

int int8_linear(scratch *s, const void *x, const uint8_t *w, int format, const uint16_t *bias, void *y, int M,
                int N, int K, long x_stride, long y_stride, int threads, int f32) {
    int blocks = K / 32, padded = (blocks + 7) / 8 * 8;  /* each input row's dx and sx, padded to 8 */
    long row_bytes = (long)blocks * block_bytes(format), floats = (long)M * padded;
    char *memory = scratch_reserve(s, SCRATCH_LINEAR, (size_t)M * K + 2 * sizeof(float) * floats);
    if (!memory) return -2;
    quantized_inputs in = {(int8_t *)(memory + 2 * sizeof(float) * floats), (float *)memory, (float *)memory + floats};
    int full = M / I8_MR * I8_MR;
    #pragma omp parallel num_threads(threads)
    {
    int share = (M + omp_get_num_threads() - 1) / omp_get_num_threads(), first = omp_get_thread_num() * share;
    quantize_inputs(x, f32, first < M ? first : M, first + share < M ? first + share : M, K, x_stride, &in, padded);
    #pragma omp barrier
    #pragma omp for schedule(static)
    for (int t = 0; t < N / I8_NR; t++) {
        const int n0 = t * I8_NR;
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
    return 0;
}
#else
int int8_path(int K) { (void)K; return 0; }
#endif

