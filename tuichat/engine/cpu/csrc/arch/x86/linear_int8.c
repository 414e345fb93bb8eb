/* int8 dot products over pairs of blocks (AVX512-VNNI, AVX-VNNI, or AVX2's maddubs), as llama.cpp computes Q4_0,
 * Q4_1 and Q8_0 (and Q5_0, Q5_1); quantized_linear (linear_quant.c) runs them where the tiled path does not.
 * The inputs are quantized per block of 32 to int8 with one fp32 scale (dx = max|x| / 127), the weights' quants
 * are unsigned bytes (Q4's nibbles, Q5's 5 bits, or with VNNI Q8_0's int8 + 128), and a block's dot product is
 * exact in int32:
 *   x . w = dw * dx * sum(q_w * q_x) + m * dx * sum(q_x)    (m: Q4_1's and Q5_1's minimum; -8 dw for Q4_0, -16 dw
 *                                                            for Q5_0, -128 dw for Q8_0)
 * Without VNNI, Q8_0 keeps the file's signed bytes (I8_MADDUBS): maddubs's int16 pairs would saturate at
 * 255 * 127 * 2, so it multiplies |q_w| by q_x carrying q_w's sign, at most 128 * 127 * 2, and needs no m.
 * Two blocks share a 32-byte vector, one in each 128-bit half (dpbusd or maddubs lanes sum 4 products); the
 * weights come in quads of rows, each pair of blocks of the 4 rows one run with its 8 scales (pack.c: pack_blocks),
 * and quantize_inputs lays the inputs out to meet them. */
#include <omp.h>
#include <stdlib.h>

#include "../../linear.h"

#ifdef __AVX2__
#include <immintrin.h>
int int8_path(int K) { return K % 64 == 0; }

/* The int32 sums of a pair of blocks (lanes 0-3 block A, 4-7 block B) of weights lo and hi (each block's weights
 * 0..15 and 16..31) times the inputs xlo and xhi. */
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
    /* Q4, Q5: int16 pairs up to 31 * 127 * 2, so the halves add in int16 before the one widening */
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi)), ones);
#endif
}

/* Input row m, a pair of blocks (A, B) at a time: 64 int8 quants (A's inputs 0..15, B's 0..15, A's 16..31, B's
 * 16..31: a weight pair's lo and hi meet them lane for lane) and 16 floats, the lanes the tiles multiply: dx of A
 * four times, of B four times, then sx = dx * sum(q) likewise. */
typedef struct {
    int8_t *q;
    float *scales;
    long row_step, pair_step; /* (m, p)'s slot: m * row_step + p * pair_step; the GEMM reads one pair of all rows */
} quantized_inputs;

static inline long slot(const quantized_inputs *in, int m, int p) { return m * in->row_step + p * in->pair_step; }

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
static void quantize_inputs(const void *x, int f32, int first, int last, int K, long x_stride, quantized_inputs *out) {
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
                float *lanes = out->scales + slot(out, m, p) * 16 + 4 * side;
                _mm_storeu_ps(lanes, _mm_set1_ps(d));
                _mm_storeu_ps(lanes + 8, _mm_set1_ps(d * (float)_mm_cvtsi128_si32(s4)));
            }
            int8_t *pair = out->q + slot(out, m, p) * 64;
            for (int h = 0; h < 2; h++)
                for (int side = 0; side < 2; side++) _mm_storeu_si128((__m128i *)(pair + 32 * h + 16 * side), halves[side][h]);
        }
    }
}

/* Q5's fifth bits (8 bytes at qh: block A's 32, then B's) into lo (each block's weights 0..15) and hi (16..31) as
 * 16s: each byte picks its weight's byte of qh, then tests its bit. */
static inline void add_fifth_bits(const uint8_t *qh, __m256i *lo, __m256i *hi) {
    int64_t both;
    memcpy(&both, qh, 8);
    const __m256i bits = _mm256_set1_epi64x(both), test = _mm256_set1_epi64x(0x8040201008040201);
    const __m256i low = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                         4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5);
    const __m256i high = _mm256_add_epi8(low, _mm256_set1_epi8(2)), sixteen = _mm256_set1_epi8(16);
    const __m256i l = _mm256_and_si256(_mm256_shuffle_epi8(bits, low), test);
    const __m256i h = _mm256_and_si256(_mm256_shuffle_epi8(bits, high), test);
    *lo = _mm256_or_si256(*lo, _mm256_and_si256(_mm256_cmpeq_epi8(l, test), sixteen));
    *hi = _mm256_or_si256(*hi, _mm256_and_si256(_mm256_cmpeq_epi8(h, test), sixteen));
}

/* A decode streams each thread's rows from DRAM: asking this far ahead, into L2, keeps enough loads in flight (as
 * linear_kquant.c's row tiles do). */
#define I8_AHEAD 8192
#define I8_HINT _MM_HINT_T2

/* Each output's arithmetic, whichever kernel runs it (so a row's result does not depend on its batch): per block
 * the exact int32 sum S of q_w * q_x, and per side of the pairs (A: the even blocks, B: the odd ones) in the
 * blocks' order o = fma(S, dw * dx, o), then o = fma(m, sx, o); the output is o_A + o_B (+ the bias). */

/* A quad's 4 weight rows times mr input rows. The 4 rows' pair sums are reduced (hadds) to one vector, lanes
 * (row, side) as the pack lays out the scales: one conversion and two fmas a pair for the 4 rows. */
#define I8_NR 4
#if defined(__AVX512VL__)
#define I8_MR 4
#else
#define I8_MR 2 /* AVX2's 16 registers */
#endif
static inline __attribute__((always_inline)) void int8_tile(const uint8_t *quad, const int format, int pairs,
                                                            const quantized_inputs *in, const uint16_t *bias,
                                                            void *y, long y_stride, int n0, int m0, const int mr,
                                                            int f32) {
    const int q_bytes = format == FMT_Q8_0 ? 64 : five_bit(format) ? 40 : 32, pair_bytes = 8 * block_bytes(format);
    const __m256i low = _mm256_set1_epi8(15);
    __m256 acc[I8_MR];
    for (int j = 0; j < mr; j++) acc[j] = _mm256_setzero_ps();
    for (int p = 0; p < pairs; p++) {
        const uint8_t *at = quad + (long)p * pair_bytes;
        /* a thread's quads lie one after another: one stream, asked for I8_AHEAD on */
        for (int line = 0; line < pair_bytes; line += 64) _mm_prefetch((const char *)at + I8_AHEAD + line, I8_HINT);
        __m256i sums[I8_MR], part[I8_MR];
        for (int i = 0; i < I8_NR; i++) {
            const uint8_t *q = at + i * q_bytes;
            __m256i lo, hi;
            if (format == FMT_Q8_0) {
                lo = _mm256_loadu_si256((const __m256i *)q);
                hi = _mm256_loadu_si256((const __m256i *)(q + 32));
            } else {
                const __m256i v = _mm256_loadu_si256((const __m256i *)q);
                lo = _mm256_and_si256(v, low);
                hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                if (five_bit(format)) add_fifth_bits(q + 32, &lo, &hi);
            }
            for (int j = 0; j < mr; j++) {
                const int8_t *x = in->q + slot(in, m0 + j, p) * 64;
                const __m256i dot = pair_dot(lo, hi, _mm256_loadu_si256((const __m256i *)x),
                                             _mm256_loadu_si256((const __m256i *)(x + 32)), format == FMT_Q8_0);
                /* rows 0, 1 and 2, 3 pairwise, then the two: lane k of a 128-bit half holds row k's S */
                if (i == 0 || i == 2) part[j] = dot;
                else if (i == 1) sums[j] = _mm256_hadd_epi32(part[j], dot);
                else sums[j] = _mm256_hadd_epi32(sums[j], _mm256_hadd_epi32(part[j], dot));
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(at + 4 * q_bytes)));
        const __m256 m = format == FMT_Q4_1 || format == FMT_Q5_1
                             ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(at + 4 * q_bytes + 16)))
                             : _mm256_mul_ps(d, _mm256_set1_ps(format == FMT_Q8_0 ? -128.0f : format == FMT_Q5_0 ? -16.0f : -8.0f));
        for (int j = 0; j < mr; j++) {
            const float *xs = in->scales + slot(in, m0 + j, p) * 16;
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[j]), _mm256_mul_ps(d, _mm256_loadu_ps(xs)), acc[j]);
            if (!(format == FMT_Q8_0 && I8_MADDUBS)) acc[j] = _mm256_fmadd_ps(m, _mm256_loadu_ps(xs + 8), acc[j]);
        }
    }
    for (int j = 0; j < mr; j++) {
        float out[4];
        _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(acc[j]), _mm256_extractf128_ps(acc[j], 1)));
        store_outputs(out, I8_NR, bias, y, (long)(m0 + j) * y_stride, n0, f32);
    }
}

#if I8_MADDUBS
/* More input rows (prefill, several tabs): a GEMM over 16 weight rows (two groups of two quads), as
 * linear_kquant.c's. Each pair of blocks of a group's 8 rows is unpacked once (an 8 x 8 dword transpose) into
 * vectors of 4 weights, lane r weight row r; each 4 inputs, broadcast once, meet both groups' with maddubs
 * (a broadcast costs a vector pipe's slot on Zen 3), and a block's 8 products a lane add up in int16
 * (8 x 2 x 15 x 127 fits) before one madd: 9 multiplies per 32 x 8 products, where the tiles pay 12. Q5's
 * quants reach 31: 4 products at a time (4 x 2 x 31 x 127 fits), two madds. Not Q8_0: its signed products fill
 * the int16 lanes. */
#define IG_GROUPS 2 /* groups of 8 weight rows (two quads) per tile: each input broadcast meets both */
#define IG_ROWS (8 * IG_GROUPS)
#define IG_MR 2     /* input rows per pass over an unpacked pair */
#define IG_MIN_M 8  /* input rows from which it beats the tiles */
#define IG_AHEAD 4  /* pairs ahead that it prefetches */

typedef struct {
    __m256i w[2][8]; /* [side][group of 4 weights]: lane r, row r's */
    __m256 d[2], m[2];
} ig_half;

typedef struct {
    ig_half g[IG_GROUPS];
} ig_pair;

/* Four halves at a and four at b as 8 floats. */
static inline __m256 halves_2x4(const uint8_t *a, const uint8_t *b) {
    return _mm256_cvtph_ps(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)a), _mm_loadl_epi64((const __m128i *)b)));
}

static inline void ig_unpack(const uint8_t *quad0, const uint8_t *quad1, const int format, ig_half *u) {
    const __m256i nib = _mm256_set1_epi8(15);
    const int five = five_bit(format), q_bytes = five ? 40 : 32, scales = 4 * q_bytes;
    __m256i v[8];
    transpose_8x8(quad0, quad1, q_bytes, v); /* dwords 0-3: A's bytes (weights 4k.. low, 16 + 4k.. high), 4-7: B's */
    for (int side = 0; side < 2; side++)
        for (int k = 0; k < 4; k++) {
            u->w[side][k] = _mm256_and_si256(v[4 * side + k], nib);
            u->w[side][k + 4] = _mm256_and_si256(_mm256_srli_epi16(v[4 * side + k], 4), nib);
        }
    if (five)
        for (int side = 0; side < 2; side++) { /* each row's fifth bits of the block: bit j, weight j's */
            int32_t bits[8];
            for (int r = 0; r < 8; r++) memcpy(bits + r, (r < 4 ? quad0 : quad1) + (r % 4) * q_bytes + 32 + 4 * side, 4);
            const __m256i qh = _mm256_loadu_si256((const __m256i *)bits);
            for (int g = 0; g < 8; g++) { /* w[side][g] holds weights 4g..4g+3: bit i of the 4 to bit 4 of byte i */
                const __m256i four = _mm256_and_si256(_mm256_srli_epi32(qh, 4 * g), _mm256_set1_epi32(15));
                u->w[side][g] = _mm256_or_si256(u->w[side][g], _mm256_and_si256(
                    _mm256_mullo_epi32(four, _mm256_set1_epi32(0x02040810)), _mm256_set1_epi32(0x10101010)));
            }
        }
    for (int side = 0; side < 2; side++) {
        u->d[side] = halves_2x4(quad0 + scales + 8 * side, quad1 + scales + 8 * side);
        u->m[side] = format == FMT_Q4_1 || format == FMT_Q5_1
                         ? halves_2x4(quad0 + scales + 16 + 8 * side, quad1 + scales + 16 + 8 * side)
                         : _mm256_mul_ps(u->d[side], _mm256_set1_ps(five ? -16.0f : -8.0f));
    }
}

/* Input rows m0.. against an unpacked pair: out holds per input row o_A's 16 lanes, then o_B's. */
static inline __attribute__((always_inline)) void ig_rows(const ig_pair *u, const quantized_inputs *in, int pairs,
                                                          int p, int m0, const int mr, const int five, float *out) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int8_t *xq[IG_MR]; /* the rows' inputs and scales at pair p, once: out's stores might alias `in` */
    const float *xscales[IG_MR];
    for (int j = 0; j < mr; j++) {
        xq[j] = in->q + slot(in, m0 + j, p) * 64;
        xscales[j] = in->scales + slot(in, m0 + j, p) * 16;
    }
    for (int side = 0; side < 2; side++) {
        __m256i s16[IG_MR][IG_GROUPS], s32[IG_MR][IG_GROUPS];
        for (int g = 0; g < 8; g++) {
            for (int j = 0; j < mr; j++) {
                const __m256i x = broadcast_four(xq[j] + 32 * (g / 4) + 16 * side + 4 * (g % 4));
                for (int h = 0; h < IG_GROUPS; h++) {
                    const __m256i d = _mm256_maddubs_epi16(u->g[h].w[side][g], x);
                    s16[j][h] = g == 0 || (five && g == 4) ? d : _mm256_add_epi16(s16[j][h], d);
                    __asm__("" : "+x"(s16[j][h])); /* one chain each: GCC's tree of these adds spills */
                }
            }
            if (five && g == 3) /* Q5: the first 4 products' sums to int32 before they could overflow */
                for (int j = 0; j < mr; j++)
                    for (int h = 0; h < IG_GROUPS; h++) s32[j][h] = _mm256_madd_epi16(s16[j][h], ones);
        }
        for (int j = 0; j < mr; j++)
            for (int h = 0; h < IG_GROUPS; h++) {
                const __m256i last = _mm256_madd_epi16(s16[j][h], ones);
                s32[j][h] = five ? _mm256_add_epi32(s32[j][h], last) : last;
            }
        for (int j = 0; j < mr; j++) {
            const __m256 dx = _mm256_broadcast_ss(xscales[j] + 4 * side);
            const __m256 sx = _mm256_broadcast_ss(xscales[j] + 8 + 4 * side);
            for (int h = 0; h < IG_GROUPS; h++) {
                float *o = out + (long)(m0 + j) * 2 * IG_ROWS + IG_ROWS * side + 8 * h;
                __m256 acc = _mm256_loadu_ps(o);
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[j][h]), _mm256_mul_ps(u->g[h].d[side], dx), acc);
                acc = _mm256_fmadd_ps(u->g[h].m[side], sx, acc);
                _mm256_storeu_ps(o, acc);
            }
        }
    }
}

static void ig_tile(const uint8_t *w, long row_bytes, const int format, int pairs, const quantized_inputs *in, int M,
                    int n0, ig_pair *u, float *out, const uint16_t *bias, void *y, long y_stride, int f32) {
    memset(out, 0, sizeof(float) * 2 * IG_ROWS * (size_t)M);
    const int pair_bytes = 8 * block_bytes(format), full = M / IG_MR * IG_MR;
    const uint8_t *first = w + (long)n0 * row_bytes; /* quad q at first + q * 4 * row_bytes */
    for (int p = 0; p < pairs; p++) {
        if (p + IG_AHEAD < pairs)
            for (int q = 0; q < 2 * IG_GROUPS; q++)
                for (int line = 0; line < pair_bytes + 64; line += 64)
                    _mm_prefetch((const char *)first + q * 4 * row_bytes + (long)(p + IG_AHEAD) * pair_bytes + line, _MM_HINT_T0);
        for (int h = 0; h < IG_GROUPS; h++)
            ig_unpack(first + 8 * h * row_bytes + (long)p * pair_bytes, first + (8 * h + 4) * row_bytes + (long)p * pair_bytes,
                      format, &u->g[h]);
        if (five_bit(format)) {
            for (int m0 = 0; m0 < full; m0 += IG_MR) ig_rows(u, in, pairs, p, m0, IG_MR, 1, out);
            for (int m0 = full; m0 < M; m0++) ig_rows(u, in, pairs, p, m0, 1, 1, out);
        } else {
            for (int m0 = 0; m0 < full; m0 += IG_MR) ig_rows(u, in, pairs, p, m0, IG_MR, 0, out);
            for (int m0 = full; m0 < M; m0++) ig_rows(u, in, pairs, p, m0, 1, 0, out);
        }
    }
    for (int m = 0; m < M; m++) {
        float *o = out + (long)m * 2 * IG_ROWS;
        for (int h = 0; h < IG_GROUPS; h++)
            _mm256_storeu_ps(o + 8 * h, _mm256_add_ps(_mm256_loadu_ps(o + 8 * h), _mm256_loadu_ps(o + IG_ROWS + 8 * h)));
        store_outputs(o, IG_ROWS, bias, y, (long)m * y_stride, n0, f32);
    }
}
#endif

/* The quad of weight rows at `quad` (its first row n0) against the M input rows: passes of I8_MR rows, then one
 * at a time, the format a constant in each copy. */
static inline __attribute__((always_inline)) void int8_quad(const uint8_t *quad, int format, int pairs,
                                                            const quantized_inputs *in, const uint16_t *bias, void *y,
                                                            long y_stride, int n0, int M, int f32) {
    const int full = M / I8_MR * I8_MR;
#define I8_TILES(FMT)                                                                                   \
    do {                                                                                                \
        for (int m0 = 0; m0 < full; m0 += I8_MR) int8_tile(quad, FMT, pairs, in, bias, y, y_stride, n0, m0, I8_MR, f32); \
        for (int m0 = full; m0 < M; m0++) int8_tile(quad, FMT, pairs, in, bias, y, y_stride, n0, m0, 1, f32); \
    } while (0)
    switch (format) {
        case FMT_Q4_0: I8_TILES(FMT_Q4_0); break;
        case FMT_Q4_1: I8_TILES(FMT_Q4_1); break;
        case FMT_Q5_0: I8_TILES(FMT_Q5_0); break;
        case FMT_Q5_1: I8_TILES(FMT_Q5_1); break;
        default: I8_TILES(FMT_Q8_0); break;
    }
#undef I8_TILES
}

int int8_linear(scratch *s, const void *x, const uint8_t *w, int format, const uint16_t *bias, void *y, int M,
                int N, int K, long x_stride, long y_stride, int threads, int f32) {
    const int pairs = K / 64;
    const long row_bytes = (long)(K / 32) * block_bytes(format);
    const size_t x_bytes = ((size_t)M * K + sizeof(float) * 16 * (size_t)M * pairs + 63) / 64 * 64;
#if I8_MADDUBS
    const int gemm = format != FMT_Q8_0 && M >= IG_MIN_M && N % IG_ROWS == 0;
    const size_t own = (sizeof(ig_pair) + sizeof(float) * 2 * IG_ROWS * (size_t)M + 63) / 64 * 64; /* each thread's */
#else
    const int gemm = 0;
    const size_t own = 0;
#endif
    char *memory = scratch_reserve(s, SCRATCH_LINEAR, x_bytes + (gemm ? own * threads + 64 : 0));
    if (!memory) return -2;
    quantized_inputs in = {(int8_t *)memory, (float *)(memory + (size_t)M * K), gemm ? 1 : pairs, gemm ? M : 1};
    #pragma omp parallel num_threads(threads)
    {
    const int share = (M + omp_get_num_threads() - 1) / omp_get_num_threads(), first = omp_get_thread_num() * share;
    quantize_inputs(x, f32, first < M ? first : M, first + share < M ? first + share : M, K, x_stride, &in);
    #pragma omp barrier
#if I8_MADDUBS
    if (gemm) {
        char *mine = (char *)(((uintptr_t)(memory + x_bytes) + 63) / 64 * 64) + own * omp_get_thread_num();
        #pragma omp for schedule(dynamic, M >= 64 ? 1 : 64 / M) nowait /* as kquant_linear's GEMM */
        for (int t = 0; t < N / IG_ROWS; t++)
            ig_tile(w, row_bytes, format, pairs, &in, M, t * IG_ROWS, (ig_pair *)mine,
                    (float *)(mine + sizeof(ig_pair)), bias, y, y_stride, f32);
    } else
#endif
    #pragma omp for schedule(guided, 8) nowait /* as kquant_linear's row tiles */
    for (int t = 0; t < N / I8_NR; t++)
        int8_quad(w + (long)t * I8_NR * row_bytes, format, pairs, &in, bias, y, y_stride, t * I8_NR, M, f32);
    }
    return 0;
}

/* Up to 4 input rows (a decode) against several weights of this path side by side (a file's separate q, k and v,
 * or gate and up: y's row holds their outputs one after another), in one parallel region, as
 * kquant_linear_parts: the inputs quantized once (their layout is every format's), every part's quads handed out
 * from one loop. Each output's arithmetic is int8_linear's. -1 for what it does not take (part by part). */
int int8_linear_parts(scratch *s, const void *x, const void *const *weights, const int32_t *formats, const int *sizes,
                      int parts, const uint16_t *bias, void *y, int M, int K, long x_stride, long y_stride, int threads,
                      int f32) {
    enum { MAX_PARTS = 4 };
    if (M < 1 || M > 4 || parts < 1 || parts > MAX_PARTS || !int8_path(K) || tiled_path(K) || K / 32 > MAX_BLOCKS)
        return -1;
    int first[MAX_PARTS + 1] = {0}, at[MAX_PARTS] = {0}; /* first[i]: part i's first quad; at: its first column */
    for (int i = 0; i < parts; i++) {
        if (!block_bytes(formats[i]) || formats[i] != same_layout(formats[i]) || sizes[i] % 16) return -1;
        first[i + 1] = first[i] + sizes[i] / I8_NR;
        if (i) at[i] = at[i - 1] + sizes[i - 1];
    }
    const int pairs = K / 64;
    const size_t x_bytes = ((size_t)M * K + sizeof(float) * 16 * (size_t)M * pairs + 63) / 64 * 64;
    char *memory = scratch_reserve(s, SCRATCH_LINEAR, x_bytes);
    if (!memory) return -2;
    quantized_inputs in = {(int8_t *)memory, (float *)(memory + (size_t)M * K), pairs, 1};
    #pragma omp parallel num_threads(threads)
    {
    const int share = (M + omp_get_num_threads() - 1) / omp_get_num_threads(), from = omp_get_thread_num() * share;
    quantize_inputs(x, f32, from < M ? from : M, from + share < M ? from + share : M, K, x_stride, &in);
    #pragma omp barrier
    #pragma omp for schedule(guided, 8) nowait
    for (int t = 0; t < first[parts]; t++) {
        int i = 0;
        while (t >= first[i + 1]) i++;
        const long row_bytes = (long)(K / 32) * block_bytes(formats[i]);
        int8_quad((const uint8_t *)weights[i] + (long)(t - first[i]) * I8_NR * row_bytes, formats[i], pairs, &in,
                  bias ? bias + at[i] : NULL, (char *)y + (long)at[i] * (f32 ? 4 : 2), y_stride, (t - first[i]) * I8_NR, M, f32);
    }
    }
    return 0;
}
#else
int int8_path(int K) { (void)K; return 0; }
int int8_linear_parts(scratch *s, const void *x, const void *const *weights, const int32_t *formats, const int *sizes,
                      int parts, const uint16_t *bias, void *y, int M, int K, long x_stride, long y_stride, int threads,
                      int f32) {
    (void)s, (void)x, (void)weights, (void)formats, (void)sizes, (void)parts, (void)bias, (void)y, (void)M, (void)K;
    (void)x_stride, (void)y_stride, (void)threads, (void)f32;
    return -1;
}
#endif

