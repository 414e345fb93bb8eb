/* Q4_K and Q6_K (and, in AVX2 builds, Q5_K) weights read where the GGUF file keeps them: ggml's super-blocks of 256 weights, row after row,
 * byte for byte the file's (no re-cut, no copy: the engine hands in a pointer into the mapped file).
 *
 * Q4_K (144 bytes): fp16 d and dmin, 12 bytes of eight 6-bit scales and eight 6-bit minimums, then 128 bytes of
 * nibbles: byte i of each 32-byte chunk c holds weight 64c + i (low nibble) and 64c + 32 + i (high). A weight
 * is d * sc[s] * q - dmin * m[s], s its sub-block of 32.
 * Q5_K (176 bytes, AVX2 builds only): Q4_K's header and scales, then 32 bytes of fifth bits (bit s of byte i:
 * weight i of sub-block s), then Q4_K's 128 bytes of nibbles. The same arithmetic as Q4_K, q up to 31.
 * Q6_K (210 bytes): 128 bytes of low nibbles, 64 of high 2-bit pairs, sixteen int8 scales (one per 16
 * weights), fp16 d. A weight is d * sc[g] * (q - 32).
 *
 * The inputs are quantized once per call to int8 per 256 (one scale each, with the sums of every 16 and 32 for
 * the -32's and the minimums' terms), as llama.cpp's Q8_K. Per output and super-block the arithmetic is fixed:
 * two exact int32 sums, S (the sub-blocks' dot products times their scales) and, for Q4_K, Ms (the minimums
 * times the inputs' sums), then acc = fma(S, d * dx, acc) and acc = fma(Ms, -dmin * dx, acc) in fp32, block
 * after block. Any way of getting the integers gives the same output, so three kernels share the work:
 * - rows (up to 4 input rows: a decode): a tile is 4 weight rows, each read whole before the next (one stream
 *   per thread), against up to 4 input rows; the inputs are stored in the order the weights' vectors come out of
 *   their bytes, so that every weight vector meets its inputs with one load. The integers are kept until the
 *   tile's end, whose fmas run on its 4 weight rows at once (kq_fmas).
 * - lanes (5 to 48 input rows: tabs decoding together, speculation's verify rows; 512-bit VNNI builds): a lane
 *   per input row and weight row of a pair, each two rows' 4 weights broadcast against 8 rows' inputs at once
 *   (kx_tile below).
 * - a GEMM (more rows: prefill): 32 weight rows (two groups of 16) are unpacked per super-block (loads and
 *   transposes) into one vector per 4 weights and group (a lane per row), which each input row meets with dpbusd:
 *   64 products an instruction, a group's 16 fp32 sums in the lanes.
 * AVX2 builds (256-bit, no VNNI) have the rows kernel (up to 8 input rows a pass) and a GEMM of 16 weight rows
 * in two groups of 8 (maddubs and madd; Q4_K from 5 input rows, Q5_K from 16, Q6_K from 24), no lanes kernel.
 * A row's outputs are thus the same whatever its batch, and whichever kernel ran it. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "linear.h"

#define QK 256
#define Q4_K_BYTES 144
#define Q5_K_BYTES 176
#define Q6_K_BYTES 210
#define KQ_NR 4 /* weight rows per tile */
/* The row tiles' least share (schedule(guided): shares halving from half the tiles down to this). */
#define KQ_MIN_CHUNK 8
#define KQ_MR 4 /* input rows per pass over a tile: NR x MR accumulators = the 16 sums store_tile takes */
/* Input rows per pass of the row tiles over a weight tile beyond a decode's KQ_MR (kquant_linear): 8 with AVX2,
 * whose row tiles also take 5 to 63 rows (8 tabs) of the formats its GEMM leaves them, and then read each weight
 * once rather than twice. */
#if defined(KQ_Q5_K)
#define KQ_PASS 8
#else
#define KQ_PASS KQ_MR
#endif

/* Q4_K's sub-blocks in the order its nibble vectors come out of the bytes: chunk c's low nibbles (sub-block 2c),
 * then its high ones (2c + 1), two chunks a vector. Position p of a Q4_K input row holds sub-block Q4_K_ORDER[p]
 * (the order is its own inverse). */
static const int Q4_K_ORDER[8] = {0, 2, 1, 3, 4, 6, 5, 7};

/* One input row's 256 values: its scale, the sums of its quants in the weights' natural order, then
 * the quants (for Q4_K in Q4_K_ORDER). */
typedef struct {
    float d;
    int16_t sums[16];  /* of each 16 (Q6_K's groups) */
    int16_t halves[8]; /* of each 32 (Q4_K's sub-blocks) */
    int8_t q[QK];
} q8_block;

int kquant_format(int format) {
#if defined(KQ_Q5_K)
    if (format == FMT_Q5_K) return 1;
#endif
    return format == FMT_Q4_K || format == FMT_Q6_K;
}

static inline long kq_block_bytes(int format) {
    return format == FMT_Q4_K ? Q4_K_BYTES : format == FMT_Q5_K ? Q5_K_BYTES : Q6_K_BYTES;
}

static inline float half_to_float(uint16_t h) {
    _Float16 f;
    memcpy(&f, &h, 2);
    return (float)f;
}

/* Q4_K's eight scales and eight minimums from their 12 bytes (ggml's get_scale_min_k4, four at a time). */
static inline void q4_k_scales(const uint8_t *s, uint8_t sc[8], uint8_t m[8]) {
    uint32_t u0, u1, u2;
    memcpy(&u0, s, 4);
    memcpy(&u1, s + 4, 4);
    memcpy(&u2, s + 8, 4);
    const uint32_t lo[2] = {u0 & 0x3f3f3f3f, (u2 & 0x0f0f0f0f) | ((u0 >> 2) & 0x30303030)};
    const uint32_t mins[2] = {u1 & 0x3f3f3f3f, ((u2 >> 4) & 0x0f0f0f0f) | ((u1 >> 2) & 0x30303030)};
    memcpy(sc, lo, 8);
    memcpy(m, mins, 8);
}

/* v rounded to the nearest integers, ties to even, as lrintf (the default rounding mode). */
static inline vi round_to_int(vf v) {
#if defined(__AVX512F__)
    return (vi)_mm512_cvtps_epi32((__m512)v);
#elif defined(__AVX__)
    return (vi)_mm256_cvtps_epi32((__m256)v);
#else
    vi n;
    for (int l = 0; l < LANES; l++) n[l] = (int32_t)lrintf(v[l]);
    return n;
#endif
}

/* Row m of x into K / 256 blocks. The order of the quants is Q4_K's when q4. */
static void quantize_row(const void *x, int f32, long offset, int K, int q4, q8_block *out, long step) {
    typedef int8_t vq __attribute__((vector_size(LANES)));
    vf v[QK / LANES];
    for (int b = 0; b < K / QK; b++) {
        vf top = splat(0.0f);
        for (int i = 0; i < QK / LANES; i++) {
            v[i] = f32 ? load_f32((const float *)x + offset + b * QK + LANES * i)
                       : load_bf16((const uint16_t *)x + offset + b * QK + LANES * i);
            const vf a = pick((vi)v[i] < 0, -v[i], v[i]);
            top = pick(a > top, a, top);
        }
        const float amax = hmax(top), d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        q8_block *o = out + b * step;
        o->d = d;
        int8_t q[QK];
        vf whole[QK / LANES]; /* the quants as floats (exact), whose lane sums sum_each takes LANES at a time */
        for (int i = 0; i < QK / LANES; i++) {
            const vi n = round_to_int(v[i] * id);
            const vq n8 = __builtin_convertvector(n, vq);
            memcpy(q + LANES * i, &n8, LANES);
            whole[i] = __builtin_convertvector(n, vf);
        }
        float sum[QK / LANES];
        for (int i = 0; i < QK / LANES; i += LANES) store_f32(sum + i, sum_each(whole + i));
        for (int g = 0; g < 16; g++) o->sums[g] = (int16_t)(LANES == 16 ? sum[g] : sum[2 * g] + sum[2 * g + 1]);
        for (int h = 0; h < 8; h++) o->halves[h] = (int16_t)(o->sums[2 * h] + o->sums[2 * h + 1]);
        if (!q4) {
            memcpy(o->q, q, QK);
            continue;
        }
        for (int s = 0; s < 8; s++) memcpy(o->q + 32 * s, q + 32 * Q4_K_ORDER[s], 32);
    }
}

#if defined(KQ_VECTOR)
#include <immintrin.h>
/* A decode streams each thread's rows from DRAM one after another: asking for the bytes this far ahead keeps
 * enough loads in flight. Into L2 (T2): into L1 measured slower, most likely because those prefetches hold the
 * L1's few miss buffers that the loads need (docs/design/kernels.md: the distance and the level were measured). */
#define KQ_AHEAD 8192
#define KQ_HINT _MM_HINT_T2

static inline int hsum4(__m128i v) {
    v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(v, _mm_shuffle_epi32(v, 0xb1)));
}

/* Q4_K's 12 bytes of scales and minimums (at s; 16 bytes are read) as one vector: bytes 0-7 the eight 6-bit scales,
 * 8-15 the eight minimums (ggml's get_scale_min_k4, all sixteen at once). */
static inline __m128i q4_k_scales_v(const uint8_t *s) {
    const __m128i x = _mm_loadu_si128((const __m128i *)s); /* dwords u0 u1 u2 */
    const __m128i a = _mm_and_si128(x, _mm_set1_epi32(0x3f3f3f3f));
    const __m128i b = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(x, 0xaa), _mm_set_epi32(0, 0, 4, 0)), _mm_set1_epi32(0x0f0f0f0f));
    const __m128i c = _mm_and_si128(_mm_srli_epi32(x, 2), _mm_set1_epi32(0x30303030));
    return _mm_unpacklo_epi32(a, _mm_or_si128(b, c));
}

#define KQ_GROUP 4 /* super-blocks whose sums are reduced together */

/* A tile's exact integers, kept until its fmas: per input row, weight row and super-block S (and Q4_K's Ms), and
 * each super-block's fp16 d (and dmin) as one dword. The fmas then run on the tile's four weight rows at once. */
typedef struct {
    int32_t S[KQ_PASS][KQ_NR][KQ_MAX_BLOCKS];
    int32_t Ms[KQ_PASS][KQ_NR][KQ_MAX_BLOCKS];
    uint32_t head[KQ_NR][KQ_MAX_BLOCKS];
} kq_sums;

#if defined(__AVX512BW__)
/* Index vectors for vpermw: each of a vector's four groups of 8 int16 lanes (the pair sums of 16 weights)
 * takes the scale of those 16 weights. */
static inline __m512i lanes_of(int a, int b, int c, int d) {
    return _mm512_set_epi16(d, d, d, d, d, d, d, d, c, c, c, c, c, c, c, c, b, b, b, b, b, b, b, b, a, a, a, a, a, a, a, a);
}

/* vpshufb masks for Q4_K's scales: in each 128-bit lane of vector j, eight int16 copies of the scale of its
 * sub-block (Q4_K_ORDER's 2j and 2j + 1 for lanes 0-1 and 2-3), the high bytes zero. */
#define Z -128
#define EIGHT(s) s, Z, s, Z, s, Z, s, Z, s, Z, s, Z, s, Z, s, Z
#define LANES4(a, b) EIGHT(a), EIGHT(a), EIGHT(b), EIGHT(b)
static const int8_t q4_k_scale_bytes[4][64] __attribute__((aligned(64))) = {
    {LANES4(0, 2)}, {LANES4(1, 3)}, {LANES4(4, 6)}, {LANES4(5, 7)}};
#undef LANES4
#undef EIGHT
#undef Z

/* q4_k_scales_v of four 12-byte groups at once, one a 128-bit lane of x (dwords u0 u1 u2). */
static inline __m512i q4_k_decode4(__m512i x) {
    const __m512i a = _mm512_and_si512(x, _mm512_set1_epi32(0x3f3f3f3f));
    const __m512i b = _mm512_and_si512(_mm512_srlv_epi32(_mm512_shuffle_epi32(x, 0xaa), _mm512_set4_epi32(0, 0, 4, 0)),
                                       _mm512_set1_epi32(0x0f0f0f0f));
    const __m512i c = _mm512_and_si512(_mm512_srli_epi32(x, 2), _mm512_set1_epi32(0x30303030));
    return _mm512_unpacklo_epi32(a, _mm512_or_si512(b, c));
}

/* q4_k_scales_v of four super-blocks one after another (at s, 144 bytes apart), a 128-bit lane each: one
 * decode for the four, where a one-row pass is bound by its instructions. */
static inline __m512i q4_k_scales_v4(const uint8_t *s) {
    __m512i x = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)s));
    x = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i *)(s + Q4_K_BYTES)), 1);
    x = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i *)(s + 2 * Q4_K_BYTES)), 2);
    x = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i *)(s + 3 * Q4_K_BYTES)), 3);
    return q4_k_decode4(x);
}

/* 128-bit lane i of v (a constant once the caller's loop is unrolled: the instruction wants an immediate). */
static inline __attribute__((always_inline)) __m128i lane_of(__m512i v, int i) {
    switch (i) {
        case 0: return _mm512_castsi512_si128(v);
        case 1: return _mm512_extracti32x4_epi32(v, 1);
        case 2: return _mm512_extracti32x4_epi32(v, 2);
        default: return _mm512_extracti32x4_epi32(v, 3);
    }
}

/* A super-block's 256 unsigned weights (4 vectors) times its 256 int8 inputs, each pair sum times its scale
 * (sv: int16, lanes as the weights'): 16 int32 lanes whose sum is the block's scaled dot product. */
static inline __m512i scaled_dots(const __m512i wv[4], const __m512i sv[4], const int8_t *q) {
    __m512i sum = _mm512_setzero_si512();
    for (int j = 0; j < 4; j++) {
        const __m512i pairs = _mm512_maddubs_epi16(wv[j], _mm512_loadu_si512(q + 64 * j));
#if defined(__AVX512VNNI__)
        sum = _mm512_dpwssd_epi32(sum, pairs, sv[j]);
#else
        sum = _mm512_add_epi32(sum, _mm512_madd_epi16(pairs, sv[j]));
#endif
    }
    return sum;
}

/* Two vectors' lanes folded into one: 128-bit lanes 0-1 hold a's halves summed, 2-3 b's. */
static inline __m512i fold2(__m512i a, __m512i b) {
    return _mm512_add_epi32(_mm512_shuffle_i64x2(a, b, 0x44), _mm512_shuffle_i64x2(a, b, 0xee));
}

/* The lane sums of the four vectors folded into ab and cd, [a, b, c, d]: one shuffle network for the four (a full
 * reduction of each, a super-block at a time, was ~30 % of a one-row pass). */
static inline __m128i sum4(__m512i ab, __m512i cd) {
    __m512i v = _mm512_add_epi32(_mm512_shuffle_i64x2(ab, cd, 0x88), _mm512_shuffle_i64x2(ab, cd, 0xdd));
    v = _mm512_add_epi32(v, _mm512_shuffle_epi32(v, 0x4e));
    v = _mm512_add_epi32(v, _mm512_shuffle_epi32(v, 0xb1));
    return _mm512_castsi512_si128(_mm512_permutexvar_epi32(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0), v));
}

/* Super-block b of weight row `row`: each input row's S as 16 lanes to sum (and Q4_K's Ms as 4), its header. */
static inline __attribute__((always_inline)) void q4_k_block(const uint8_t *row, int b, const q8_block *xq, int blocks,
                                                             const int mr, const __m128i both, __m512i *sums,
                                                             __m128i *msums, uint32_t *head) {
    const __m512i nib = _mm512_set1_epi8(0x0f);
    const uint8_t *blk = row + (long)b * Q4_K_BYTES;
    _mm_prefetch((const char *)blk + KQ_AHEAD, KQ_HINT);
    _mm_prefetch((const char *)blk + KQ_AHEAD + 64, KQ_HINT);
    _mm_prefetch((const char *)blk + KQ_AHEAD + 128, KQ_HINT);
    memcpy(head, blk, 4);
    const __m512i scales = _mm512_broadcast_i32x4(both);
    const __m128i mins = _mm_cvtepu8_epi16(_mm_unpackhi_epi64(both, both));
    const __m512i q0 = _mm512_loadu_si512(blk + 16), q1 = _mm512_loadu_si512(blk + 80);
    const __m512i wv[4] = {_mm512_and_si512(q0, nib), _mm512_and_si512(_mm512_srli_epi16(q0, 4), nib),
                           _mm512_and_si512(q1, nib), _mm512_and_si512(_mm512_srli_epi16(q1, 4), nib)};
    __m512i sv[4];
    for (int j = 0; j < 4; j++) sv[j] = _mm512_shuffle_epi8(scales, _mm512_load_si512(q4_k_scale_bytes[j]));
    for (int m = 0; m < mr; m++) {
        const q8_block *a = xq + (long)m * blocks + b;
        sums[m] = scaled_dots(wv, sv, a->q);
        /* the minimums' term: m[s] times the sum of sub-block s's inputs (two sums of 16 each) */
        msums[m] = _mm_madd_epi16(mins, _mm_loadu_si128((const __m128i *)a->halves));
    }
}

static inline __attribute__((always_inline)) void q6_k_block(const uint8_t *row, int b, const q8_block *xq, int blocks,
                                                             const int mr, __m512i *sums, uint32_t *head) {
    const __m512i nib = _mm512_set1_epi8(0x0f), two = _mm512_set1_epi8(0x03);
    const __m512i idx[4] = {lanes_of(0, 1, 2, 3), lanes_of(4, 5, 6, 7), lanes_of(8, 9, 10, 11), lanes_of(12, 13, 14, 15)};
    const uint8_t *blk = row + (long)b * Q6_K_BYTES;
    for (int line = 0; line < Q6_K_BYTES; line += 64) _mm_prefetch((const char *)blk + KQ_AHEAD + line, KQ_HINT);
    uint16_t dh;
    memcpy(&dh, blk + 208, 2);
    *head = dh;
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
    const __m512i scales = _mm512_castsi256_si512(sc16);
    __m512i wv[4], sv[4];
    for (int h = 0; h < 2; h++) {
        const __m512i ql = _mm512_loadu_si512(blk + 64 * h);
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
        const __m512i hi = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
        wv[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, nib), _mm512_slli_epi16(_mm512_and_si512(hi, two), 4));
        wv[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), nib),
                                        _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hi, 4), two), 4));
    }
    for (int j = 0; j < 4; j++) sv[j] = _mm512_permutexvar_epi16(idx[j], scales);
    for (int m = 0; m < mr; m++) {
        const q8_block *a = xq + (long)m * blocks + b;
        /* q - 32: 32 times each group's scale times its inputs' sum */
        const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)a->sums)), 5);
        sums[m] = _mm512_sub_epi32(scaled_dots(wv, sv, a->q), _mm512_zextsi256_si512(offset));
    }
}

/* Weight row r's super-blocks into u, KQ_GROUP at a time (each input row's sums of four blocks reduced together),
 * the last ones alone. */
static inline __attribute__((always_inline)) void kq_row(const uint8_t *row, const int q4, int blocks,
                                                         const q8_block *xq, const int mr, kq_sums *u, int r) {
    int b = 0;
    for (; b + KQ_GROUP <= blocks; b += KQ_GROUP) {
        __m512i s[KQ_MR], ab[KQ_MR], cd[KQ_MR];
        __m128i ms[KQ_MR], msa[KQ_MR], msb[KQ_MR];
        const __m512i four = q4 ? q4_k_scales_v4(row + (long)b * Q4_K_BYTES + 4) : _mm512_setzero_si512();
        for (int i = 0; i < KQ_GROUP; i++) {
            __m512i t[KQ_MR];
            __m128i mt[KQ_MR];
            if (q4) q4_k_block(row, b + i, xq, blocks, mr, lane_of(four, i), t, mt, &u->head[r][b + i]);
            else q6_k_block(row, b + i, xq, blocks, mr, t, &u->head[r][b + i]);
            for (int m = 0; m < mr; m++) {
                if (i % 2 == 0) s[m] = t[m];
                else if (i == 1) ab[m] = fold2(s[m], t[m]);
                else cd[m] = fold2(s[m], t[m]);
                if (!q4) continue;
                if (i % 2 == 0) ms[m] = mt[m];
                else if (i == 1) msa[m] = _mm_hadd_epi32(ms[m], mt[m]);
                else msb[m] = _mm_hadd_epi32(ms[m], mt[m]);
            }
        }
        for (int m = 0; m < mr; m++) {
            _mm_storeu_si128((__m128i *)&u->S[m][r][b], sum4(ab[m], cd[m]));
            if (q4) _mm_storeu_si128((__m128i *)&u->Ms[m][r][b], _mm_hadd_epi32(msa[m], msb[m]));
        }
    }
    for (; b < blocks; b++) {
        __m512i t[KQ_MR];
        __m128i mt[KQ_MR];
        if (q4) q4_k_block(row, b, xq, blocks, mr, q4_k_scales_v(row + (long)b * Q4_K_BYTES + 4), t, mt, &u->head[r][b]);
        else q6_k_block(row, b, xq, blocks, mr, t, &u->head[r][b]);
        for (int m = 0; m < mr; m++) {
            u->S[m][r][b] = _mm512_reduce_add_epi32(t[m]);
            if (q4) u->Ms[m][r][b] = hsum4(mt[m]);
        }
    }
}

#else
/* 256-bit builds (AVX2: most laptops, Zen 3): a vector per 32 weights, maddubs then madd by its scale, as ggml's
 * AVX2 dot products do; each super-block's 8 lanes are reduced four blocks at a time (hadds). */
#define Z -128
#define SIXTEEN(s) s, Z, s, Z, s, Z, s, Z, s, Z, s, Z, s, Z, s, Z
#define HALVES(a, b) a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, \
                     b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1
/* vpshufb masks: Q4_K's scale s (byte s) as sixteen int16; Q6_K's int16 scales 2t and 2t + 1 (of eight in each
 * 128-bit lane) as eight copies in the low lane and eight in the high one. */
static const int8_t q4_k_scale_mask[8][32] __attribute__((aligned(32))) = {
    {SIXTEEN(0), SIXTEEN(0)}, {SIXTEEN(1), SIXTEEN(1)}, {SIXTEEN(2), SIXTEEN(2)}, {SIXTEEN(3), SIXTEEN(3)},
    {SIXTEEN(4), SIXTEEN(4)}, {SIXTEEN(5), SIXTEEN(5)}, {SIXTEEN(6), SIXTEEN(6)}, {SIXTEEN(7), SIXTEEN(7)}};
static const int8_t q6_k_scale_mask[4][32] __attribute__((aligned(32))) = {
    {HALVES(0, 2)}, {HALVES(4, 6)}, {HALVES(8, 10)}, {HALVES(12, 14)}};
#undef HALVES
#undef SIXTEEN
#undef Z

/* acc[m] += input row m's 64 products with two weight vectors (unsigned, 32 weights each: input positions p and
 * p + 2), each pair sum times its scale (int16 lanes). */
static inline __attribute__((always_inline)) void scaled_pair(__m256i lo, __m256i hi, __m256i slo, __m256i shi,
                                                              const q8_block *xq, int blocks, int b, int p,
                                                              const int mr, __m256i *acc) {
    for (int m = 0; m < mr; m++) {
        const int8_t *q = xq[(long)m * blocks + b].q + 32 * p;
        const __m256i a = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)q)), slo);
        const __m256i c = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(q + 64))), shi);
        acc[m] = _mm256_add_epi32(acc[m], _mm256_add_epi32(a, c));
    }
}

/* [sum of a, of b, of c, of d] */
static inline __m128i sum4(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i v = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
    return _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
}

/* Q5_K's fifth bits of sub-block s (bit s of each byte) as 16s. */
static inline __m256i fifth_bits(__m256i qh, int s) {
    const __m256i at = s <= 4 ? _mm256_slli_epi16(qh, 4 - s) : _mm256_srli_epi16(qh, s - 4);
    return _mm256_and_si256(at, _mm256_set1_epi8(0x10));
}

/* Super-block b of weight row `row`: each input row's S as 8 lanes to sum (and Q4_K's Ms as 4), its header. The
 * weight vectors are made as the inputs need them: sixteen live at once would not fit AVX2's 16 registers. */
static inline __attribute__((always_inline)) void q4_k_block(const uint8_t *row, int b, const q8_block *xq, int blocks,
                                                             const int mr, const int five, __m256i *sums, __m128i *msums,
                                                             uint32_t *head) {
    const __m256i nib = _mm256_set1_epi8(0x0f);
    const uint8_t *blk = row + (long)b * (five ? Q5_K_BYTES : Q4_K_BYTES);
    _mm_prefetch((const char *)blk + KQ_AHEAD, KQ_HINT);
    _mm_prefetch((const char *)blk + KQ_AHEAD + 64, KQ_HINT);
    _mm_prefetch((const char *)blk + KQ_AHEAD + 128, KQ_HINT);
    memcpy(head, blk, 4);
    const __m128i both = q4_k_scales_v(blk + 4);
    const __m256i scales = _mm256_broadcastsi128_si256(both);
    const __m128i mins = _mm_cvtepu8_epi16(_mm_unpackhi_epi64(both, both));
    for (int m = 0; m < mr; m++) sums[m] = _mm256_setzero_si256();
    const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) { /* chunk c: sub-blocks 2c (low nibbles, input position p) and 2c + 1 (p + 2) */
        const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + (five ? 48 : 16) + 32 * c));
        const int p = 4 * (c / 2) + c % 2;
        __m256i lo = _mm256_and_si256(q, nib), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), nib);
        if (five) {
            lo = _mm256_or_si256(lo, fifth_bits(qh, 2 * c));
            hi = _mm256_or_si256(hi, fifth_bits(qh, 2 * c + 1));
        }
        scaled_pair(lo, hi,
                    _mm256_shuffle_epi8(scales, _mm256_load_si256((const __m256i *)q4_k_scale_mask[2 * c])),
                    _mm256_shuffle_epi8(scales, _mm256_load_si256((const __m256i *)q4_k_scale_mask[2 * c + 1])),
                    xq, blocks, b, p, mr, sums);
    }
    for (int m = 0; m < mr; m++)
        msums[m] = _mm_madd_epi16(mins, _mm_loadu_si128((const __m128i *)xq[(long)m * blocks + b].halves));
}

static inline __attribute__((always_inline)) void q6_k_block(const uint8_t *row, int b, const q8_block *xq, int blocks,
                                                             const int mr, __m256i *sums, uint32_t *head) {
    const __m256i nib = _mm256_set1_epi8(0x0f), high = _mm256_set1_epi8(0x30);
    const uint8_t *blk = row + (long)b * Q6_K_BYTES;
    for (int line = 0; line < Q6_K_BYTES; line += 64) _mm_prefetch((const char *)blk + KQ_AHEAD + line, KQ_HINT);
    uint16_t dh;
    memcpy(&dh, blk + 208, 2);
    *head = dh;
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
    for (int m = 0; m < mr; m++) /* q - 32: minus 32 times each group's scale times its inputs' sum */
        sums[m] = _mm256_sub_epi32(_mm256_setzero_si256(),
                                   _mm256_slli_epi32(_mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)xq[(long)m * blocks + b].sums)), 5));
    for (int h = 0; h < 2; h++) { /* weights 128h + 32t + l: ql byte 64h + 32(t % 2) + l, nibble t / 2; qh bits 2t */
        const __m256i half = h ? _mm256_permute2x128_si256(sc16, sc16, 0x11) /* an immediate, unrolled or not */
                                : _mm256_permute2x128_si256(sc16, sc16, 0x00);
        for (int t = 0; t < 2; t++) { /* groups t and t + 2 of the half: input positions 4h + t and that + 2 */
            const __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32 * t));
            const __m256i qh = _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h)), 2 * t);
            scaled_pair(_mm256_or_si256(_mm256_and_si256(ql, nib), _mm256_and_si256(_mm256_slli_epi16(qh, 4), high)),
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql, 4), nib), _mm256_and_si256(qh, high)),
                        _mm256_shuffle_epi8(half, _mm256_load_si256((const __m256i *)q6_k_scale_mask[t])),
                        _mm256_shuffle_epi8(half, _mm256_load_si256((const __m256i *)q6_k_scale_mask[t + 2])),
                        xq, blocks, b, 4 * h + t, mr, sums);
        }
    }
}

/* Weight row r's super-blocks into u (q4: 1 Q4_K, 2 Q5_K, 0 Q6_K). One input row: four blocks' sums reduced
 * together; more: each block's, its input rows' sums together (four blocks of four rows' would not fit the
 * registers). */
static inline __attribute__((always_inline)) void kq_row(const uint8_t *row, const int q4, int blocks,
                                                         const q8_block *xq, const int mr, kq_sums *u, int r) {
    int b = 0;
    if (mr == 1)
        for (; b + KQ_GROUP <= blocks; b += KQ_GROUP) {
            __m256i t[KQ_GROUP];
            __m128i mt[KQ_GROUP];
            for (int i = 0; i < KQ_GROUP; i++) {
                if (q4) q4_k_block(row, b + i, xq, blocks, 1, q4 == 2, t + i, mt + i, &u->head[r][b + i]);
                else q6_k_block(row, b + i, xq, blocks, 1, t + i, &u->head[r][b + i]);
            }
            _mm_storeu_si128((__m128i *)&u->S[0][r][b], sum4(t[0], t[1], t[2], t[3]));
            if (q4) _mm_storeu_si128((__m128i *)&u->Ms[0][r][b], _mm_hadd_epi32(_mm_hadd_epi32(mt[0], mt[1]), _mm_hadd_epi32(mt[2], mt[3])));
        }
    for (; b < blocks; b++) {
        __m256i t[KQ_PASS];
        __m128i mt[KQ_PASS];
        if (q4) q4_k_block(row, b, xq, blocks, mr, q4 == 2, t, mt, &u->head[r][b]);
        else q6_k_block(row, b, xq, blocks, mr, t, &u->head[r][b]);
        for (int m0 = 0; m0 < mr; m0 += 4) { /* lane i: input row m0 + i's (rows past mr repeat m0's, not stored) */
            const int i1 = m0 + 1 < mr ? m0 + 1 : m0, i2 = m0 + 2 < mr ? m0 + 2 : m0, i3 = m0 + 3 < mr ? m0 + 3 : m0;
            const __m128i S = sum4(t[m0], t[i1], t[i2], t[i3]);
            const __m128i Ms = q4 ? _mm_hadd_epi32(_mm_hadd_epi32(mt[m0], mt[i1]), _mm_hadd_epi32(mt[i2], mt[i3]))
                                  : _mm_setzero_si128();
            int32_t s4[4], m4[4];
            _mm_storeu_si128((__m128i *)s4, S);
            _mm_storeu_si128((__m128i *)m4, Ms);
            for (int m = m0; m < mr && m < m0 + 4; m++) {
                u->S[m][r][b] = s4[m - m0];
                if (q4) u->Ms[m][r][b] = m4[m - m0];
            }
        }
    }
}
#endif

/* The 4 x 4 dwords at a[r][b..b+3] for r = 0..3 as four vectors, one a super-block (lane r: weight row r). */
static inline void transpose4(const int32_t *a, long stride, __m128i out[4]) {
    const __m128i r0 = _mm_loadu_si128((const __m128i *)a), r1 = _mm_loadu_si128((const __m128i *)(a + stride));
    const __m128i r2 = _mm_loadu_si128((const __m128i *)(a + 2 * stride)), r3 = _mm_loadu_si128((const __m128i *)(a + 3 * stride));
    const __m128i t0 = _mm_unpacklo_epi32(r0, r1), t1 = _mm_unpackhi_epi32(r0, r1);
    const __m128i t2 = _mm_unpacklo_epi32(r2, r3), t3 = _mm_unpackhi_epi32(r2, r3);
    out[0] = _mm_unpacklo_epi64(t0, t2);
    out[1] = _mm_unpackhi_epi64(t0, t2);
    out[2] = _mm_unpacklo_epi64(t1, t3);
    out[3] = _mm_unpackhi_epi64(t1, t3);
}

static inline __m128i column(const int32_t *a, long stride) {
    return _mm_set_epi32(a[3 * stride], a[2 * stride], a[stride], a[0]);
}

/* The fmas of a tile, the four weight rows' in the lanes of one vector, block after block: each lane's are exactly
 * a block at a time's, fma(S, d * dx) then fma(Ms, -dmin * dx), in fp32. */
static inline __attribute__((always_inline)) void kq_fmas(const kq_sums *u, const int q4, int blocks,
                                                          const q8_block *xq, const int mr, float *acc) {
    /* a header dword per row, d | dmin << 16: the rows' d in halves 0-3, dmin in 4-7 */
    const __m128i split = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    const __m128 sign = _mm_set1_ps(-0.0f);
    for (int m = 0; m < mr; m++) {
        __m128 o = _mm_loadu_ps(acc + m * KQ_NR);
        int b = 0;
#define KQ_FMA(S, Ms, head, bb)                                                                             \
        do {                                                                                                \
            const __m256 dd = _mm256_mul_ps(_mm256_cvtph_ps(_mm_shuffle_epi8(head, split)),                  \
                                            _mm256_set1_ps(xq[(long)m * blocks + (bb)].d));                  \
            o = _mm_fmadd_ps(_mm_cvtepi32_ps(S), _mm256_castps256_ps128(dd), o);                            \
            if (q4) o = _mm_fmadd_ps(_mm_cvtepi32_ps(Ms), _mm_xor_ps(_mm256_extractf128_ps(dd, 1), sign), o); \
        } while (0)
        for (; b + KQ_GROUP <= blocks; b += KQ_GROUP) {
            __m128i S[4], Ms[4], head[4];
            transpose4(&u->S[m][0][b], KQ_MAX_BLOCKS, S);
            if (q4) transpose4(&u->Ms[m][0][b], KQ_MAX_BLOCKS, Ms);
            transpose4((const int32_t *)&u->head[0][b], KQ_MAX_BLOCKS, head);
            for (int i = 0; i < KQ_GROUP; i++) KQ_FMA(S[i], Ms[i], head[i], b + i);
        }
        for (; b < blocks; b++) {
            const __m128i Ms = q4 ? column(&u->Ms[m][0][b], KQ_MAX_BLOCKS) : _mm_setzero_si128();
            KQ_FMA(column(&u->S[m][0][b], KQ_MAX_BLOCKS), Ms, column((const int32_t *)&u->head[0][b], KQ_MAX_BLOCKS), b);
        }
#undef KQ_FMA
        _mm_storeu_ps(acc + m * KQ_NR, o);
    }
}

static inline __attribute__((always_inline)) void q4_k_tile(const uint8_t *w, long row_bytes, int blocks,
                                                            const q8_block *xq, int mr, float *acc) {
    kq_sums u;
    for (int r = 0; r < KQ_NR; r++) kq_row(w + r * row_bytes, 1, blocks, xq, mr, &u, r);
    kq_fmas(&u, 1, blocks, xq, mr, acc);
}

static inline __attribute__((always_inline)) void q6_k_tile(const uint8_t *w, long row_bytes, int blocks,
                                                            const q8_block *xq, int mr, float *acc) {
    kq_sums u;
    for (int r = 0; r < KQ_NR; r++) kq_row(w + r * row_bytes, 0, blocks, xq, mr, &u, r);
    kq_fmas(&u, 0, blocks, xq, mr, acc);
}

#if defined(KQ_Q5_K)
static inline __attribute__((always_inline)) void q5_k_tile(const uint8_t *w, long row_bytes, int blocks,
                                                            const q8_block *xq, int mr, float *acc) {
    kq_sums u;
    for (int r = 0; r < KQ_NR; r++) kq_row(w + r * row_bytes, 2, blocks, xq, mr, &u, r);
    kq_fmas(&u, 1, blocks, xq, mr, acc);
}
#endif
#else
/* Without AVX2: the same exact integer sums, one at a time (the reference the vector kernels match). */
static inline __attribute__((always_inline)) void q4_k_tile(const uint8_t *w, long row_bytes, int blocks,
                                                            const q8_block *xq, int mr, float *acc) {
    for (int b = 0; b < blocks; b++)
        for (int r = 0; r < KQ_NR; r++) {
            const uint8_t *blk = w + r * row_bytes + (long)b * Q4_K_BYTES;
            uint16_t h[2];
            memcpy(h, blk, 4);
            const float d = half_to_float(h[0]), dmin = half_to_float(h[1]);
            uint8_t sc[8], mn[8];
            q4_k_scales(blk + 4, sc, mn);
            for (int m = 0; m < mr; m++) {
                const q8_block *a = xq + (long)m * blocks + b;
                int sum = 0, msum = 0;
                for (int p = 0; p < 8; p++) { /* p: position in the inputs' order; s: the sub-block */
                    const int s = Q4_K_ORDER[p], chunk = s / 2, shift = 4 * (s % 2);
                    int dot = 0;
                    for (int i = 0; i < 32; i++) dot += ((blk[16 + 32 * chunk + i] >> shift) & 15) * a->q[32 * p + i];
                    sum += sc[s] * dot;
                    msum += mn[s] * a->halves[s];
                }
                acc[m * KQ_NR + r] = fmaf((float)sum, d * a->d, acc[m * KQ_NR + r]);
                acc[m * KQ_NR + r] = fmaf((float)msum, -dmin * a->d, acc[m * KQ_NR + r]);
            }
        }
}

static inline __attribute__((always_inline)) void q6_k_tile(const uint8_t *w, long row_bytes, int blocks,
                                                            const q8_block *xq, int mr, float *acc) {
    for (int b = 0; b < blocks; b++)
        for (int r = 0; r < KQ_NR; r++) {
            const uint8_t *blk = w + r * row_bytes + (long)b * Q6_K_BYTES;
            uint16_t dh;
            memcpy(&dh, blk + 208, 2);
            const float d = half_to_float(dh);
            const int8_t *sc = (const int8_t *)(blk + 192);
            for (int m = 0; m < mr; m++) {
                const q8_block *a = xq + (long)m * blocks + b;
                int sum = 0;
                for (int g = 0; g < 16; g++) { /* weights 16g..16g+15: half h, group t of 32 in it */
                    const int h = g / 8, t = (g % 8) / 2, lo = 16 * (g % 2);
                    int dot = 0;
                    for (int i = lo; i < lo + 16; i++) {
                        const int low = (blk[64 * h + 32 * (t % 2) + i] >> (4 * (t / 2))) & 15;
                        const int high = (blk[128 + 32 * h + i] >> (2 * t)) & 3;
                        dot += (low | high << 4) * a->q[16 * g + i - lo];
                    }
                    sum += sc[g] * (dot - 32 * a->sums[g]);
                }
                acc[m * KQ_NR + r] = fmaf((float)sum, d * a->d, acc[m * KQ_NR + r]);
            }
        }
}
#endif

static inline __attribute__((always_inline)) void kquant_tile(const uint8_t *w, const int format, long row_bytes,
                                                              int blocks, const q8_block *xq, const uint16_t *bias,
                                                              void *y, long y_stride, int n0, int m0, const int mr,
                                                              int f32) {
    float acc[KQ_NR * KQ_PASS] = {};
    if (format == FMT_Q4_K) q4_k_tile(w + n0 * row_bytes, row_bytes, blocks, xq + (long)m0 * blocks, mr, acc);
#if defined(KQ_Q5_K)
    else if (format == FMT_Q5_K) q5_k_tile(w + n0 * row_bytes, row_bytes, blocks, xq + (long)m0 * blocks, mr, acc);
#endif
    else q6_k_tile(w + n0 * row_bytes, row_bytes, blocks, xq + (long)m0 * blocks, mr, acc);
    for (int m = 0; m < mr; m++) store_outputs(acc + m * KQ_NR, KQ_NR, bias, y, (long)(m0 + m) * y_stride, n0, f32);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define KG_GROUP 16 /* weight rows per group: a lane each */
#define KG_GROUPS 2 /* groups per GEMM tile: each input broadcast, loaded once, meets both (docs/design/kernels.md) */
#define KG_ROWS (KG_GROUP * KG_GROUPS)
#define KG_MR 6     /* input rows per pass over an unpacked super-block: 12 dpbusd chains for Zen 5's two pipes */
#define KG_AHEAD 4  /* super-blocks ahead that the GEMM's tiles prefetch */
#define KG_MIN_M 5 /* input rows from which the GEMM beats the row tiles where the lanes kernel is not built */
#define KG_MIN_M_Q5 KG_MIN_M
#define KG_MIN_M_Q6 KG_MIN_M
#define KG_Q5_K 0

/* A tile's super-block unpacked: vectors of 4 weights (lane r: weight row r) per block of 32 (Q4_K: sub-block s
 * from chunk s / 2's low or high nibbles; Q6_K: weights 32j...), the rows' int32 scales (Q4_K: per 32; Q6_K: per
 * 16), as int16 pairs (lane: v[2k] | v[2k + 1] << 16) Q4_K's minimums or Q6_K's scales, and d, -dmin. */
typedef struct {
    __m512i w[8][8];
    __m512i sc[16];
    __m512i mn[8];
    __m512 d, ndmin;
} kg_half;
typedef struct {
    kg_half g[KG_GROUPS];
} kg_block;

/* 32 bytes at `at` of each of 16 rows (row_bytes apart) as 8 vectors: vector v, lane r = the row's dword v. Two
 * 8 x 8 transposes side by side (rows 0-7 in the low halves, 8-15 in the high), in 32 shuffles. */
static inline void transpose_16x8(const uint8_t *at, long row_bytes, __m512i out[8]) {
    __m512i z[8], t[8], u[8];
    for (int i = 0; i < 8; i++)
        z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(at + i * row_bytes))),
                                  _mm256_loadu_si256((const __m256i *)(at + (i + 8) * row_bytes)), 1);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm512_unpacklo_epi32(z[i], z[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(z[i], z[i + 1]);
    }
    for (int i = 0; i < 8; i += 4)
        for (int j = 0; j < 2; j++) {
            u[i + 2 * j] = _mm512_unpacklo_epi64(t[i + j], t[i + j + 2]);
            u[i + 2 * j + 1] = _mm512_unpackhi_epi64(t[i + j], t[i + j + 2]);
        }
    /* u[e] (rows 0-3) and u[4 + e] (rows 4-7): 128-bit lanes hold dword e, then e + 4, of rows 0-3 or 4-7, then
     * the same of rows 8-11 or 12-15 */
    const __m512i lo = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0), hi = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
    for (int e = 0; e < 4; e++) {
        out[e] = _mm512_permutex2var_epi64(u[e], lo, u[4 + e]);
        out[e + 4] = _mm512_permutex2var_epi64(u[e], hi, u[4 + e]);
    }
}

static inline __m512i byte_of(__m512i v, int k) { return _mm512_and_si512(_mm512_srli_epi32(v, 8 * k), _mm512_set1_epi32(0xff)); }

/* 16 bytes at `at` of each of 16 rows (row_bytes apart) as 4 vectors: vector v, lane r = the row's dword v (four
 * rows a 128-bit lane, transposed in place: 8 shuffles). Gathers of the same dwords cost more here. */
static inline void transpose_16x4(const uint8_t *at, long row_bytes, __m512i out[4]) {
    __m512i z[4];
    for (int k = 0; k < 4; k++) {
        z[k] = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(at + k * row_bytes)));
        for (int l = 1; l < 4; l++)
            z[k] = _mm512_inserti32x4(z[k], _mm_loadu_si128((const __m128i *)(at + (4 * l + k) * row_bytes)), l);
    }
    const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    out[0] = _mm512_unpacklo_epi64(t0, t2), out[1] = _mm512_unpackhi_epi64(t0, t2);
    out[2] = _mm512_unpacklo_epi64(t1, t3), out[3] = _mm512_unpackhi_epi64(t1, t3);
}

static void kg_unpack_half(const uint8_t *first, long row_bytes, int q4, kg_half *u) {
    const __m512i nib = _mm512_set1_epi32(0x0f0f0f0f), two = _mm512_set1_epi32(0x03030303);
    __m512i v[8];
    if (q4) {
        /* the header, a lane per row: d | dmin << 16, then the 12 bytes of scales and minimums (ggml's
         * get_scale_min_k4, 16 rows at once) */
        __m512i hq[4];
        transpose_16x4(first, row_bytes, hq);
        const __m512i head = hq[0], q0 = hq[1], q1 = hq[2], q2 = hq[3];
        u->d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
        u->ndmin = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16))));
        const __m512i six = _mm512_set1_epi32(63), four = _mm512_set1_epi32(15);
        __m512i m[8];
        for (int k = 0; k < 4; k++) {
            u->sc[k] = _mm512_and_si512(byte_of(q0, k), six);
            m[k] = _mm512_and_si512(byte_of(q1, k), six);
            u->sc[k + 4] = _mm512_or_si512(_mm512_and_si512(byte_of(q2, k), four),
                                           _mm512_slli_epi32(_mm512_srli_epi32(byte_of(q0, k), 6), 4));
            m[k + 4] = _mm512_or_si512(_mm512_srli_epi32(byte_of(q2, k), 4),
                                       _mm512_slli_epi32(_mm512_srli_epi32(byte_of(q1, k), 6), 4));
        }
        for (int k = 0; k < 4; k++) u->mn[k] = _mm512_or_si512(m[2 * k], _mm512_slli_epi32(m[2 * k + 1], 16));
        for (int c = 0; c < 4; c++) {
            transpose_16x8(first + 16 + 32 * c, row_bytes, v);
            for (int j = 0; j < 8; j++) {
                u->w[2 * c][j] = _mm512_and_si512(v[j], nib);
                u->w[2 * c + 1][j] = _mm512_and_si512(_mm512_srli_epi32(v[j], 4), nib);
            }
        }
        return;
    }
    /* Q6_K: the int8 scales (four dwords), d (the high half of the dword at 206: no read past the row) */
    __m512i fours[4];
    transpose_16x4(first + 192, row_bytes, fours);
    for (int k = 0; k < 4; k++)
        for (int b = 0; b < 4; b++) u->sc[4 * k + b] = _mm512_srai_epi32(_mm512_slli_epi32(fours[k], 24 - 8 * b), 24);
    for (int k = 0; k < 8; k++)
        u->mn[k] = _mm512_or_si512(_mm512_and_si512(u->sc[2 * k], _mm512_set1_epi32(0xffff)),
                                   _mm512_slli_epi32(u->sc[2 * k + 1], 16));
    const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32((int)row_bytes));
    u->d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_i32gather_epi32(rows, first + 206, 1), 16)));
    u->ndmin = _mm512_setzero_ps();
    for (int h = 0; h < 2; h++) {  /* weights 128h + 32t + 4j..: ql's nibble t / 2 of chunk t % 2, qh's pair t */
        __m512i hi[8];
        transpose_16x8(first + 128 + 32 * h, row_bytes, hi);
        for (int half = 0; half < 2; half++) {
            transpose_16x8(first + 64 * h + 32 * half, row_bytes, v);
            for (int shift = 0; shift < 2; shift++) {
                const int t = 2 * shift + half;
                for (int j = 0; j < 8; j++)
                    u->w[4 * h + t][j] = _mm512_or_si512(
                        _mm512_and_si512(_mm512_srli_epi32(v[j], 4 * shift), nib),
                        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(hi[j], 2 * t), two), 4));
            }
        }
    }
}

/* acc + dpwssd(w, the int16 pair at x broadcast): madd_epi16 and its add in one instruction (the same int32 sums) */
static inline __m512i dpwssd_bcast(__m512i acc, __m512i w, const void *x) {
    __asm__("vpdpwssd %[x]%{1to16%}, %[w], %[acc]" : [acc] "+v"(acc) : [w] "v"(w), [x] "m"(*(const int32_t *)x));
    return acc;
}

/* Input rows a[0..mr-1] (consecutive in the GEMM's block-major layout: one base register, constant offsets, where
 * a pointer a row had cost ~25 instructions a pass to set up) against an unpacked super-block: each row's S and Ms,
 * 32 rows' at once, and the two fmas of every output (out: 32 floats per input row). Each 4 inputs are broadcast
 * into a register once for both groups (a dpbusd with its broadcast from memory cost a load each: loads, not
 * multiplies, bound the 16-row tile). One dpbusd chain a row and group: 12 at 6 rows. Q6_K's -32 comes out of S
 * once per super-block (32 * the scales times the inputs' sums of 16, in int16 pairs), not once per 16 weights. */
static inline __attribute__((always_inline)) void kg_rows(const kg_block *u, int q4, const q8_block *a,
                                                          const int mr, float *out) {
    __m512i S[KG_MR][KG_GROUPS];
    for (int j = 0; j < mr; j++)
        for (int h = 0; h < KG_GROUPS; h++) S[j][h] = _mm512_setzero_si512();
    for (int g = 0; g < (q4 ? 8 : 16); g++) {
        const int blk = q4 ? g : g / 2, v0 = q4 ? 0 : 4 * (g & 1), v1 = q4 ? 8 : v0 + 4;
        const int at = q4 ? 32 * Q4_K_ORDER[blk] : 32 * blk;
        __m512i dot[KG_MR][KG_GROUPS];
        for (int j = 0; j < mr; j++)
            for (int h = 0; h < KG_GROUPS; h++) dot[j][h] = _mm512_setzero_si512();
        for (int v = v0; v < v1; v++)
            for (int j = 0; j < mr; j++) {
                int32_t four;
                memcpy(&four, a[j].q + at + 4 * v, 4);
                const __m512i x = _mm512_set1_epi32(four);
                for (int h = 0; h < KG_GROUPS; h++) dot[j][h] = _mm512_dpbusd_epi32(dot[j][h], u->g[h].w[blk][v], x);
            }
        for (int j = 0; j < mr; j++)
            for (int h = 0; h < KG_GROUPS; h++)
                S[j][h] = _mm512_add_epi32(S[j][h], _mm512_mullo_epi32(dot[j][h], u->g[h].sc[g]));
    }
    for (int j = 0; j < mr; j++) {
        const __m512 dx = _mm512_set1_ps(a[j].d);
        for (int h = 0; h < KG_GROUPS; h++) {
            const kg_half *e = &u->g[h];
            __m512 o = _mm512_loadu_ps(out + KG_ROWS * j + KG_GROUP * h);
            __m512i ms = _mm512_setzero_si512(), sj = S[j][h];
            for (int k = 0; k < (q4 ? 4 : 8); k++)
                ms = dpwssd_bcast(ms, e->mn[k], q4 ? a[j].halves + 2 * k : a[j].sums + 2 * k);
            if (!q4) sj = _mm512_sub_epi32(sj, _mm512_slli_epi32(ms, 5));
            o = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sj), _mm512_mul_ps(e->d, dx), o);
            if (q4) o = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ms), _mm512_mul_ps(e->ndmin, dx), o);
            _mm512_storeu_ps(out + KG_ROWS * j + KG_GROUP * h, o);
        }
    }
}

#endif

#if defined(KQ_VECTOR) && !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
/* The GEMM of 256-bit builds (AVX2, no VNNI), as the 512-bit one above but with a lane per weight row of 8, two
 * such groups a tile: each super-block of 16 rows unpacked once (transposes) into vectors of 4 weights a row,
 * each 4 inputs broadcast once for both groups' maddubs. A sub-block's 8 products stay in int16 (Q4_K: 8 x 2 x
 * 15 x 127 fits; Q6_K's two x 2 x 63 x 127), then one madd by the rows' scales: 9 multiplies per 32 x 8
 * products, where the row tiles pay 16. The same exact S and Ms, the same fmas in the same order: the same
 * outputs as the row tiles. */
#define KG_GROUP 8  /* weight rows per group: a lane each */
#define KG_GROUPS 2 /* groups per tile: each input broadcast meets both */
#define KG_ROWS (KG_GROUP * KG_GROUPS)
#define KG_MR 2    /* input rows per pass over an unpacked super-block */
#define KG_AHEAD 4 /* super-blocks ahead that the GEMM's tiles prefetch */
#define KG_MIN_M 5     /* input rows from which the GEMM beats the row tiles: Q4_K's */
#define KG_MIN_M_Q5 16 /* Q5_K's (five transposes: at 8 rows the row tiles measured faster, at 16 not) */
#define KG_MIN_M_Q6 24 /* Q6_K's (its unpacking costs more): weights out of cache, 16 rows measured 10 % slower
                        * than the row tiles, 32 rows 16 % faster */
#if defined(KQ_Q5_K)
#define KG_Q5_K 1 /* Q5_K is read in place: this GEMM takes it too */
#else
#define KG_Q5_K 0
#endif

/* A tile's super-block unpacked: vectors of 4 weights (lane r: weight row r) per block of 32 (as the 512-bit
 * GEMM's), the rows' scales as int16 pairs (sc | sc << 16: Q4_K per 32, Q6_K per 16), int16 pairs v[2k] |
 * v[2k + 1] << 16 of Q4_K's minimums or Q6_K's scales, and d, -dmin. */
typedef struct {
    __m256i w[8][8];
    __m256i sc[16];
    __m256i mn[8];
    __m256 d, ndmin;
} kg_half;

typedef struct {
    kg_half g[KG_GROUPS];
} kg_block;

/* 32 bytes at `at` of each of 8 rows, row_bytes apart, transposed (linear.h). */
static inline void transpose_rows(const uint8_t *at, long row_bytes, __m256i out[8]) {
    transpose_8x8(at, at + 4 * row_bytes, row_bytes, out);
}

/* The 4 dwords at `at` of each of 8 rows: out[k], lane r = row r's dword k (loads and unpacks: Zen 3's gathers
 * cost more than the rest of the unpacking at 8 input rows). */
static inline void columns_8x4(const uint8_t *at, long row_bytes, __m256i out[4]) {
    __m256i z[4], t[4];
    for (int i = 0; i < 4; i++)
        z[i] = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(at + i * row_bytes))),
                                       _mm_loadu_si128((const __m128i *)(at + (i + 4) * row_bytes)), 1);
    for (int i = 0; i < 4; i += 2) {
        t[i] = _mm256_unpacklo_epi32(z[i], z[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(z[i], z[i + 1]);
    }
    out[0] = _mm256_unpacklo_epi64(t[0], t[2]);
    out[1] = _mm256_unpackhi_epi64(t[0], t[2]);
    out[2] = _mm256_unpacklo_epi64(t[1], t[3]);
    out[3] = _mm256_unpackhi_epi64(t[1], t[3]);
}

static inline __m256i byte_of(__m256i v, int k) { return _mm256_and_si256(_mm256_srli_epi32(v, 8 * k), _mm256_set1_epi32(0xff)); }
static inline __m256i pair16(__m256i lo, __m256i hi) {
    return _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(hi, 16));
}
/* Eight fp16 values, the low (or high) halves of v's dwords, as fp32. */
static inline __m256 halves_of(__m256i v, int high) {
    const __m256i h = high ? _mm256_srli_epi32(v, 16) : _mm256_and_si256(v, _mm256_set1_epi32(0xffff));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08);
    return _mm256_cvtph_ps(_mm256_castsi256_si128(packed));
}

static void kg_unpack_half(const uint8_t *first, long row_bytes, int q4, kg_half *u) {
    const __m256i nib = _mm256_set1_epi32(0x0f0f0f0f), two = _mm256_set1_epi32(0x03030303);
    __m256i v[8];
    if (q4) {
        __m256i header[4];
        columns_8x4(first, row_bytes, header);
        const __m256i head = header[0], q0 = header[1], q1 = header[2], q2 = header[3];
        u->d = halves_of(head, 0);
        u->ndmin = _mm256_sub_ps(_mm256_setzero_ps(), halves_of(head, 1));
        const __m256i six = _mm256_set1_epi32(63), four = _mm256_set1_epi32(15);
        __m256i m[8];
        for (int k = 0; k < 4; k++) {
            const __m256i sc = _mm256_and_si256(byte_of(q0, k), six);
            const __m256i sc4 = _mm256_or_si256(_mm256_and_si256(byte_of(q2, k), four),
                                                _mm256_slli_epi32(_mm256_srli_epi32(byte_of(q0, k), 6), 4));
            u->sc[k] = pair16(sc, sc);
            u->sc[k + 4] = pair16(sc4, sc4);
            m[k] = _mm256_and_si256(byte_of(q1, k), six);
            m[k + 4] = _mm256_or_si256(_mm256_srli_epi32(byte_of(q2, k), 4),
                                       _mm256_slli_epi32(_mm256_srli_epi32(byte_of(q1, k), 6), 4));
        }
        for (int k = 0; k < 4; k++) u->mn[k] = pair16(m[2 * k], m[2 * k + 1]);
#if KG_Q5_K
        __m256i qh[8]; /* Q5_K's fifth bits, transposed as the nibbles are */
        if (q4 == 2) transpose_rows(first + 16, row_bytes, qh);
#endif
        for (int c = 0; c < 4; c++) {
            transpose_rows(first + (q4 == 2 ? 48 : 16) + 32 * c, row_bytes, v);
            for (int j = 0; j < 8; j++) {
                u->w[2 * c][j] = _mm256_and_si256(v[j], nib);
                u->w[2 * c + 1][j] = _mm256_and_si256(_mm256_srli_epi32(v[j], 4), nib);
#if KG_Q5_K
                if (q4 == 2) {
                    u->w[2 * c][j] = _mm256_or_si256(u->w[2 * c][j], fifth_bits(qh[j], 2 * c));
                    u->w[2 * c + 1][j] = _mm256_or_si256(u->w[2 * c + 1][j], fifth_bits(qh[j], 2 * c + 1));
                }
#endif
            }
        }
        return;
    }
    /* Q6_K: the int8 scales (four dwords), d (the high half of the dword at 206: no read past the row) */
    __m256i sc[16], fours[4];
    columns_8x4(first + 192, row_bytes, fours);
    for (int k = 0; k < 4; k++)
        for (int b = 0; b < 4; b++) sc[4 * k + b] = _mm256_srai_epi32(_mm256_slli_epi32(fours[k], 24 - 8 * b), 24);
    for (int g = 0; g < 16; g++) u->sc[g] = pair16(sc[g], sc[g]);
    for (int k = 0; k < 8; k++) u->mn[k] = pair16(sc[2 * k], sc[2 * k + 1]);
    const __m256i rows = _mm256_mullo_epi32(_mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0), _mm256_set1_epi32((int)row_bytes));
    u->d = halves_of(_mm256_i32gather_epi32((const int *)(first + 206), rows, 1), 1); /* the one gather left */
    u->ndmin = _mm256_setzero_ps();
    for (int h = 0; h < 2; h++) { /* weights 128h + 32t + 4j..: ql's nibble t / 2 of chunk t % 2, qh's pair t */
        __m256i hi[8];
        transpose_rows(first + 128 + 32 * h, row_bytes, hi);
        for (int half = 0; half < 2; half++) {
            transpose_rows(first + 64 * h + 32 * half, row_bytes, v);
            for (int shift = 0; shift < 2; shift++) {
                const int t = 2 * shift + half;
                for (int j = 0; j < 8; j++)
                    u->w[4 * h + t][j] = _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi32(v[j], 4 * shift), nib),
                        _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hi[j], 2 * t), two), 4));
            }
        }
    }
}

/* Input rows against an unpacked super-block: each row's S and Ms, 16 weight rows' at once, and the two fmas of
 * every output (out: 16 floats per input row). Each broadcast of 4 inputs meets both groups of 8 rows: the
 * broadcasts take a vector pipe's slot on Zen 3, one per maddubs measured ~20 % slower. */
static inline __attribute__((always_inline)) void kg_rows(const kg_block *u, int q4, const q8_block *a,
                                                          const int mr, float *out) {
    __m256i S[KG_MR][KG_GROUPS], p[KG_MR][KG_GROUPS];
    for (int j = 0; j < mr; j++)
        for (int h = 0; h < KG_GROUPS; h++) S[j][h] = _mm256_setzero_si256();
    /* g: Q4_K's sub-block; half of Q5_K's (four products of q up to 31 fit int16, eight do not); Q6_K: 8 of a
     * group of 16's weights */
    const int per = q4 == 1 ? 1 : q4 == 2 ? 2 : 4; /* g's a block of 32, an inner loop that GCC unrolls: */
    for (int blk = 0; blk < 8; blk++) {               /* Q6_K's offsets constants, not ~25 integer ops a g */
        const int at = q4 ? 32 * Q4_K_ORDER[blk] : 32 * blk;
        for (int gg = 0; gg < per; gg++) {
            const int g = blk * per + gg, v0 = 8 / per * gg, v1 = v0 + 8 / per;
            for (int v = v0; v < v1; v++)
                for (int j = 0; j < mr; j++) {
                    const __m256i x = broadcast_four(a[j].q + at + 4 * v);
                    for (int h = 0; h < KG_GROUPS; h++) {
                        const __m256i d = _mm256_maddubs_epi16(u->g[h].w[blk][v], x);
                        p[j][h] = v == v0 ? d : _mm256_add_epi16(p[j][h], d);
                        __asm__("" : "+x"(p[j][h])); /* one chain each: GCC's tree of these adds spills them */
                    }
                }
            for (int j = 0; j < mr; j++)
                for (int h = 0; h < KG_GROUPS; h++)
                    S[j][h] = _mm256_add_epi32(S[j][h], _mm256_madd_epi16(p[j][h], u->g[h].sc[q4 == 1 ? g : g / 2]));
        }
    }
    for (int j = 0; j < mr; j++) {
        const __m256 dx = _mm256_set1_ps(a[j].d);
        for (int h = 0; h < KG_GROUPS; h++) {
            const kg_half *e = &u->g[h];
            __m256 o = _mm256_loadu_ps(out + KG_ROWS * j + 8 * h);
            __m256i ms = _mm256_setzero_si256(), sj = S[j][h];
            for (int k = 0; k < (q4 ? 4 : 8); k++)
                ms = _mm256_add_epi32(ms, _mm256_madd_epi16(e->mn[k], broadcast_four((const int8_t *)(
                                                  q4 ? a[j].halves + 2 * k : a[j].sums + 2 * k))));
            if (!q4) sj = _mm256_sub_epi32(sj, _mm256_slli_epi32(ms, 5));
            o = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sj), _mm256_mul_ps(e->d, dx), o);
            if (q4) o = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ms), _mm256_mul_ps(e->ndmin, dx), o);
            _mm256_storeu_ps(out + KG_ROWS * j + 8 * h, o);
        }
    }
}
#endif

#if defined(KG_ROWS)
/* A tile's super-block unpacked, group by group; a tile of one group (a weight's last, where its rows are an odd
 * number of groups) unpacks that group twice and stores half the outputs. */
static void kg_unpack(const uint8_t *first, long row_bytes, int q4, int groups, kg_block *u) {
    for (int h = 0; h < KG_GROUPS; h++)
        kg_unpack_half(first + (long)KG_GROUP * (h < groups ? h : groups - 1) * row_bytes, row_bytes, q4, &u->g[h]);
}

/* Tiles of KG_ROWS over n weight rows (a multiple of KG_GROUP): the last may be one group. */
static inline int kg_tiles(int n) { return (n + KG_ROWS - 1) / KG_ROWS; }

/* The input rows from which `format` takes the GEMM. */
static inline int kg_least(int format) { return format == FMT_Q4_K ? KG_MIN_M : format == FMT_Q5_K ? KG_MIN_M_Q5 : KG_MIN_M_Q6; }

static void kg_tile(const uint8_t *w, long row_bytes, int blocks, int format, const q8_block *xq, int M, int n0,
                    int N, kg_block *u, float *out, const uint16_t *bias, void *y, long y_stride, int f32) {
    memset(out, 0, sizeof(float) * KG_ROWS * (size_t)M);
    const int q4 = format == FMT_Q4_K ? 1 : format == FMT_Q5_K ? 2 : 0; /* kg_unpack's and kg_rows' kind */
    const int rows = N - n0 < KG_ROWS ? N - n0 : KG_ROWS;
    const long bytes = kq_block_bytes(format);
    /* The next tile's first KG_AHEAD super-blocks of each row, which the prefetch below does not reach, spread
     * over this tile's super-blocks into L2: at a few input rows each tile's streams started from DRAM */
    const char *next = n0 + KG_ROWS < N ? (const char *)w + (long)(n0 + KG_ROWS) * row_bytes : NULL;
    for (int b = 0; b < blocks; b++) {
        for (int r = b * KG_ROWS / blocks; next && r < (b + 1) * KG_ROWS / blocks; r++)
            for (long line = 0; line < KG_AHEAD * bytes + 64 && line < row_bytes; line += 64)
                _mm_prefetch(next + r * row_bytes + line, _MM_HINT_T1);
        const uint8_t *first = w + n0 * row_bytes + (long)b * bytes;
        /* a stream a row (16 or 32): the hardware prefetcher follows few of them; ask for each row's bytes of the
         * super-block KG_AHEAD blocks on (all its lines: 144 to 210 bytes from any offset span at most 4) */
        if (b + KG_AHEAD < blocks)
            for (int r = 0; r < rows; r++)
                for (int line = 0; line < bytes + 64; line += 64)
                    _mm_prefetch((const char *)first + r * row_bytes + KG_AHEAD * bytes + line, _MM_HINT_T0);
        kg_unpack(first, row_bytes, q4, rows / KG_GROUP, u);
        /* the last super-block stores each pass's rows as they are done: one burst of M stores to M lines (y_stride
         * apart, most missing the caches) at the tile's end stalled its next tile's start */
        const int last = b == blocks - 1;
        /* every pass of KG_MR rows, then the rest: row counts known at compile time in each copy of kg_rows */
#define KG_PASS(kind, mr, m0)                                                       \
        do {                                                                        \
            kg_rows(u, kind, xq + (long)b * M + (m0), mr, out + (long)KG_ROWS * (m0)); \
            if (last)                                                               \
                for (int j = 0; j < mr; j++)                                        \
                    store_outputs(out + (long)KG_ROWS * ((m0) + j), rows, bias, y,    \
                                  (long)((m0) + j) * y_stride, n0, f32);            \
        } while (0)
#define KG_PASSES(kind)                                                             \
        do {                                                                        \
            const int full = M / KG_MR * KG_MR;                                     \
            for (int m0 = 0; m0 < full; m0 += KG_MR) KG_PASS(kind, KG_MR, m0);      \
            switch (M - full) {                                                     \
                case 1: KG_PASS(kind, 1, full); break;                              \
                case 2: if (KG_MR > 2) KG_PASS(kind, 2, full); break;               \
                case 3: if (KG_MR > 3) KG_PASS(kind, 3, full); break;               \
                case 4: if (KG_MR > 4) KG_PASS(kind, 4, full); break;               \
                case 5: if (KG_MR > 5) KG_PASS(kind, 5, full); break;               \
                case 6: if (KG_MR > 6) KG_PASS(kind, 6, full); break;               \
                case 7: if (KG_MR > 7) KG_PASS(kind, 7, full); break;               \
                default: break;                                                     \
            }                                                                       \
        } while (0)
        if (q4 == 1) KG_PASSES(1);
        else if (KG_Q5_K && q4 == 2) KG_PASSES(2);
        else KG_PASSES(0);
#undef KG_PASSES
#undef KG_PASS
    }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
/* A few input rows (KX_MIN_M to KX_MAX_M: several tabs' decodes, a short prompt, speculation's verify rows)
 * the other way round from the GEMM: a lane per input row. Each weight row's super-block is unpacked once into its
 * 256 quants in natural order (ands and shifts, no transposes), two weight rows' interleaved dword by dword, so that
 * one 8-byte broadcast puts row A's 4 quants at a position in the even lanes and row B's in the odd; the 8 input
 * rows' 4 inputs there, each laid out twice (lanes 2i and 2i + 1), meet both rows in one 512-bit dpbusd (two tiles
 * of 8 input rows share each broadcast: kx_pass). The inputs are laid out once per call. The sub-blocks' scales
 * multiply the 16 sums at once. Same exact int32 S and Ms, same fmas in the same order: the same outputs. */
#define KX_LANES 8  /* input rows per pass: two int32 lanes each (one per weight row of a pair) */
#define KX_NR 8     /* weight rows unpacked together (four pairs: their broadcasts share each load of the inputs) */
#define KX_MIN_M 5  /* from here it beats the row tiles, and up to KX_MAX_M the GEMM (scripts/gguf_linears.py) */
#define KX_MAX_M 48 /* Zen 5, a whole model's prefill (weights from DRAM): the GEMM as fast at ~45 rows, faster above */
#define KX_AHEAD 49152 /* bytes: a tile takes longer a super-block than a row tile, ahead of DRAM by more */

/* KX_LANES input rows at one super-block, each twice (lanes 2i, 2i + 1): dword p (inputs 4p..4p+3, natural order)
 * of each, their scales, Q4_K's sub-block sums as int16 pairs (s[2k] | s[2k + 1] << 16), Q6_K's -32 times the sum
 * of each 16. */
typedef struct {
    int32_t q[64][2 * KX_LANES];
    float d[2 * KX_LANES];
    int32_t halves[4][2 * KX_LANES];
    int32_t sums32[16][2 * KX_LANES];
} kx_block;

static void kx_inputs(const q8_block *xq, int M, int blocks, int q4, int mt, int b, kx_block *o) {
    memset(o, 0, sizeof *o);
    for (int i = 0; i < KX_LANES && mt * KX_LANES + i < M; i++) {
        const q8_block *a = xq + (long)(mt * KX_LANES + i) * blocks + b;
        const int32_t halves[4] = {
            (int32_t)((uint32_t)(uint16_t)a->halves[0] | (uint32_t)(uint16_t)a->halves[1] << 16),
            (int32_t)((uint32_t)(uint16_t)a->halves[2] | (uint32_t)(uint16_t)a->halves[3] << 16),
            (int32_t)((uint32_t)(uint16_t)a->halves[4] | (uint32_t)(uint16_t)a->halves[5] << 16),
            (int32_t)((uint32_t)(uint16_t)a->halves[6] | (uint32_t)(uint16_t)a->halves[7] << 16)};
        for (int twice = 2 * i; twice < 2 * i + 2; twice++) {
            for (int p = 0; p < 64; p++)
                memcpy(&o->q[p][twice], a->q + (q4 ? 32 * Q4_K_ORDER[p / 8] + 4 * (p % 8) : 4 * p), 4);
            o->d[twice] = a->d;
            for (int k = 0; k < 4; k++) o->halves[k][twice] = halves[k];
            for (int g = 0; g < 16; g++) o->sums32[g][twice] = -32 * a->sums[g];
        }
    }
}

/* Two weight rows' super-blocks (a pair): their quants interleaved dword by dword into wb (dword p of row A at
 * 2p, of row B at 2p + 1; p in natural order, 0..63), the two rows' bytes side by side in one 512-bit vector
 * through the ands and shifts and one permute putting them in place; Q6_K's scales as int32 pairs [A, B] and each
 * row's d. Q4_K's headers come from kx_q4_k_heads. */
static inline __attribute__((always_inline)) void kx_unpack_pair(const uint8_t *a, const uint8_t *b, int q4, int32_t *wb,
                                                                 int32_t sc[16][2], float d[2]) {
    const __m512i nib = _mm512_set1_epi8(0x0f), two = _mm512_set1_epi8(0x03);
    const __m512i side_by_side = _mm512_set_epi32(15, 7, 14, 6, 13, 5, 12, 4, 11, 3, 10, 2, 9, 1, 8, 0);
#define KX_BOTH(offset) _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(a + (offset)))), \
                                           _mm256_loadu_si256((const __m256i *)(b + (offset))), 1)
    if (q4) {
        for (int c = 0; c < 4; c++) {
            const __m512i v = KX_BOTH(16 + 32 * c);
            _mm512_store_si512(wb + 32 * c, _mm512_permutexvar_epi32(side_by_side, _mm512_and_si512(v, nib)));
            _mm512_store_si512(wb + 32 * c + 16,
                               _mm512_permutexvar_epi32(side_by_side, _mm512_and_si512(_mm512_srli_epi16(v, 4), nib)));
        }
    } else {
        uint16_t ha, hb;
        memcpy(&ha, a + 208, 2);
        memcpy(&hb, b + 208, 2);
        d[0] = half_to_float(ha), d[1] = half_to_float(hb);
        const __m512i sa = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(a + 192)));
        const __m512i sb = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192)));
        /* the two rows' scales side by side: [a0, b0, a1, b1, ...] */
        const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        _mm512_store_si512(sc[0], _mm512_permutex2var_epi32(sa, first, sb));
        _mm512_store_si512(sc[8], _mm512_permutex2var_epi32(sa, _mm512_add_epi32(first, _mm512_set1_epi32(8)), sb));
        for (int h = 0; h < 2; h++) { /* weights 128h + 32t + i: ql's nibble t / 2 of chunk t % 2, qh's pair t */
            const __m512i qh = KX_BOTH(128 + 32 * h);
            for (int t = 0; t < 4; t++) {
                const __m512i ql = KX_BOTH(64 * h + 32 * (t % 2));
                const __m512i lo = _mm512_and_si512(_mm512_srli_epi16(ql, 4 * (t / 2)), nib);
                const __m512i hi = _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 2 * t), two), 4);
                _mm512_store_si512(wb + 16 * (4 * h + t), _mm512_permutexvar_epi32(side_by_side, _mm512_or_si512(lo, hi)));
            }
        }
    }
#undef KX_BOTH
}

/* Q4_K's headers of KX_NR weight rows' super-blocks (from `first`, rows row_bytes apart), pair by pair (rows 2p,
 * 2p + 1): the scales as int32 pairs [A, B], the minimums as int16 pairs (dword k: m[2k] | m[2k + 1] << 16) of A
 * then of B, each row's d and -dmin. The 8 rows are decoded in two vectors of four (even rows, odd: one unpack then
 * pairs them): a pair at a time, 8-row tiles measured ~9 % slower (docs/design/kernels.md). */
static inline __attribute__((always_inline)) void kx_q4_k_heads(const uint8_t *first, long row_bytes, int32_t sc[][16][2],
                                                                int32_t mn[][4][2], float d[][2], float nd[][2]) {
    __m512i head[2], both[2]; /* even rows, odd rows: lane i row 2i (+ 1); both: bytes 0-7 scales, 8-15 minimums */
    for (int odd = 0; odd < 2; odd++) {
        const uint8_t *r = first + odd * row_bytes;
        __m512i x = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)r));
        for (int i = 1; i < 4; i++) x = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i *)(r + 2 * i * row_bytes)), i);
        head[odd] = x;
        both[odd] = q4_k_decode4(_mm512_bsrli_epi128(x, 4));
    }
    /* d | dmin << 16 of rows 0..7, as 16 fp16 values, then [d0..d7 | dmin0..dmin7] */
    const __m512i heads = _mm512_permutexvar_epi64(_mm512_set_epi64(0, 0, 0, 0, 6, 4, 2, 0),
                                                   _mm512_unpacklo_epi32(head[0], head[1]));
    const __m512 all = _mm512_permutexvar_ps(_mm512_set_epi32(15, 13, 11, 9, 7, 5, 3, 1, 14, 12, 10, 8, 6, 4, 2, 0),
                                             _mm512_cvtph_ps(_mm512_castsi512_si256(heads)));
    _mm256_storeu_ps(d[0], _mm512_castps512_ps256(all));
    _mm256_storeu_ps(nd[0], _mm256_sub_ps(_mm256_setzero_ps(), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(all), 1))));
    const __m512i scales = _mm512_unpacklo_epi8(both[0], both[1]), mins = _mm512_unpackhi_epi16(both[0], both[1]);
    for (int p = 0; p < KX_NR / 2; p++) {
        _mm512_store_si512(sc[p], _mm512_cvtepu8_epi32(lane_of(scales, p)));
        _mm256_store_si256((__m256i *)mn[p], _mm256_cvtepu8_epi16(lane_of(mins, p)));
    }
}

static inline int64_t kx_eight(const void *p) {
    int64_t eight;
    memcpy(&eight, p, 8);
    return eight;
}

/* One super-block of KX_NR weight rows (unpacked: wb, sc, mn, d, nd) against tt (1 or 2) tiles of input rows (x,
 * the second `stride` blocks on), into their sums at acc. Two tiles share each broadcast of a pair's weights (rows
 * from 16 up: a prompt's, speculation's verify rows); their 8 chains, one a pair and tile, hide dpbusd's latency.
 * One tile runs two chains a pair (even and odd dwords): 4 chains alone wait on it. Q6_K's -32: the first chain
 * starts from -32 times the inputs' sum (the same integer as a sub). */
static inline __attribute__((always_inline)) void kx_pass(const kx_block *x, long stride, const int tt, const int q4,
                                                          const int32_t wb[][128], const int32_t sc[][16][2],
                                                          const int32_t mn[][4][2], const float d[][2],
                                                          const float nd[][2], float *acc) {
    enum { PAIRS = KX_NR / 2 };
    const kx_block *xt[2] = {x, tt == 2 ? x + stride : x};
    __m512i S[2][PAIRS];
    for (int k = 0; k < tt; k++)
        for (int pr = 0; pr < PAIRS; pr++) S[k][pr] = _mm512_setzero_si512();
    const int per = q4 ? 8 : 4; /* dwords of a scale's group: groups run 8 dwords (an eight) at a time */
    for (int e = 0; e < 8; e++)
        for (int h = 0; h < 8 / per; h++) {
            const int g = e * 8 / per + h;
            __m512i dot[2][PAIRS], odd[PAIRS];
            for (int k = 0; k < tt; k++) {
                const __m512i start = q4 ? _mm512_setzero_si512() : _mm512_load_si512(xt[k]->sums32[g]);
                for (int pr = 0; pr < PAIRS; pr++) dot[k][pr] = start;
            }
            for (int pr = 0; pr < PAIRS; pr++) odd[pr] = _mm512_setzero_si512();
            for (int v = 0; v < per; v++) {
                __m512i xv[2];
                for (int k = 0; k < tt; k++) {
                    xv[k] = _mm512_load_si512(xt[k]->q[8 * e + per * h + v]);
                    /* in a register: one load for the pairs' dpbusd, not one each (the broadcasts load enough) */
                    __asm__("" : "+v"(xv[k]));
                }
                for (int pr = 0; pr < PAIRS; pr++) {
                    const __m512i four = _mm512_set1_epi64(kx_eight(wb[pr] + 16 * e + 2 * (per * h + v)));
                    if (tt == 1 && v & 1) odd[pr] = _mm512_dpbusd_epi32(odd[pr], four, xv[0]);
                    else
                        for (int k = 0; k < tt; k++) dot[k][pr] = _mm512_dpbusd_epi32(dot[k][pr], four, xv[k]);
                }
            }
            for (int pr = 0; pr < PAIRS; pr++) {
                const __m512i scale = _mm512_set1_epi64(kx_eight(sc[pr][g]));
                if (tt == 1) dot[0][pr] = _mm512_add_epi32(dot[0][pr], odd[pr]);
                for (int k = 0; k < tt; k++) S[k][pr] = _mm512_add_epi32(S[k][pr], _mm512_mullo_epi32(dot[k][pr], scale));
            }
        }
    for (int k = 0; k < tt; k++) {
        const __m512 dx = _mm512_load_ps(xt[k]->d);
        for (int pr = 0; pr < PAIRS; pr++) {
            float *at = acc + ((long)k * PAIRS + pr) * 2 * KX_LANES;
            const __m512 dd = _mm512_castsi512_ps(_mm512_set1_epi64(kx_eight(d[pr]))); /* [dA, dB] repeated */
            __m512 o = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S[k][pr]), _mm512_mul_ps(dd, dx), _mm512_loadu_ps(at));
            if (q4) {
                __m512i ms = _mm512_setzero_si512();
                for (int j = 0; j < 4; j++)  /* dpwssd: madd and its add in one (the same int32 sums) */
                    ms = _mm512_dpwssd_epi32(ms, _mm512_set1_epi64(kx_eight(mn[pr][j])), _mm512_load_si512(xt[k]->halves[j]));
                const __m512 ndd = _mm512_castsi512_ps(_mm512_set1_epi64(kx_eight(nd[pr])));
                o = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ms), _mm512_mul_ps(ndd, dx), o);
            }
            _mm512_storeu_ps(at, o);
        }
    }
}

/* Weight rows n0..n0+KX_NR-1 against all M input rows: acc holds [M tiles][KX_NR / 2 pairs][2 * KX_LANES] sums
 * (lane 2i + j: input row i, the pair's row j). */
static inline __attribute__((always_inline)) void kx_tile(const uint8_t *w, long row_bytes, int blocks, const int q4,
                                                          const kx_block *kx, int M, int n0, float *acc,
                                                          const uint16_t *bias, void *y, long y_stride, int f32) {
    enum { PAIRS = KX_NR / 2 };
    const int tiles = (M + KX_LANES - 1) / KX_LANES, bytes = q4 ? Q4_K_BYTES : Q6_K_BYTES;
    _Alignas(64) int32_t wb[PAIRS][128]; /* a pair's quants, dword p of each row side by side */
    _Alignas(64) int32_t sc[PAIRS][16][2], mn[PAIRS][4][2];
    float d[PAIRS][2], nd[PAIRS][2]; /* nd: Q4_K's only */
    memset(acc, 0, sizeof(float) * KX_NR * KX_LANES * (size_t)tiles);
    for (int b = 0; b < blocks; b++) {
        /* The tile's KX_NR rows lie one after another, and a thread's tiles too: a pointer that crosses the tile's
         * bytes as b crosses its blocks, KX_AHEAD on, asks for them as one stream, as the row tiles do. Asking for
         * each row's next super-block into L1 instead left a third of the time waiting on DRAM. */
        const char *ahead = (const char *)w + (long)n0 * row_bytes + (long)b * KX_NR * bytes + KX_AHEAD;
        for (int line = 0; line < KX_NR * bytes; line += 64) _mm_prefetch(ahead + line, KQ_HINT);
        if (q4) kx_q4_k_heads(w + (long)n0 * row_bytes + (long)b * bytes, row_bytes, sc, mn, d, nd);
        for (int pr = 0; pr < PAIRS; pr++)
            kx_unpack_pair(w + (long)(n0 + 2 * pr) * row_bytes + (long)b * bytes,
                           w + (long)(n0 + 2 * pr + 1) * row_bytes + (long)b * bytes, q4, wb[pr], sc[pr], d[pr]);
        int t = 0;
        for (; t + 2 <= tiles; t += 2) kx_pass(kx + (long)t * blocks + b, blocks, 2, q4, wb, sc, mn, d, nd, acc + (long)t * KX_NR * KX_LANES);
        if (t < tiles) kx_pass(kx + (long)t * blocks + b, blocks, 1, q4, wb, sc, mn, d, nd, acc + (long)t * KX_NR * KX_LANES);
    }
    for (int m = 0; m < M; m++) {
        float out[KX_NR];
        for (int r = 0; r < KX_NR; r++)
            out[r] = acc[((long)(m / KX_LANES) * PAIRS + r / 2) * 2 * KX_LANES + 2 * (m % KX_LANES) + r % 2];
        store_outputs(out, KX_NR, bias, y, (long)m * y_stride, n0, f32);
    }
}
#endif

int kquant_linear(scratch *s, const void *x, const uint8_t *w, int format, const uint16_t *bias, void *y, int M,
                  int N, int K, long x_stride, long y_stride, int threads, int f32) {
    if (M < 1 || M > 512 || K % QK || K / QK > KQ_MAX_BLOCKS || N % KQ_NR || !kquant_format(format)) return -1;
    const int blocks = K / QK, q4 = format != FMT_Q6_K; /* Q4_K's (and Q5_K's) order of the inputs, minimums */
    const long row_bytes = (long)blocks * kq_block_bytes(format);
    const size_t x_bytes = (sizeof(q8_block) * (size_t)M * blocks + 63) / 64 * 64;
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
    const int lanes = M >= KX_MIN_M && M <= KX_MAX_M && N % KX_NR == 0, tiles = (M + KX_LANES - 1) / KX_LANES;
    const size_t kx_bytes = lanes ? sizeof(kx_block) * (size_t)tiles * blocks + 64 : 0;
#else
    const int lanes = 0;
    const size_t kx_bytes = 0;
#endif
#if defined(KG_ROWS)
    const int gemm = !lanes && M >= kg_least(format) && N % KG_GROUP == 0;
    const size_t own = (sizeof(kg_block) + sizeof(float) * KG_ROWS * (size_t)M + 63) / 64 * 64; /* each thread's */
#else
    const int gemm = 0;
    const size_t own = 0;
#endif
    char *memory = scratch_reserve(s, SCRATCH_LINEAR, x_bytes + kx_bytes + (gemm ? own * threads + 64 : 0));
    if (!memory) return -2;
    q8_block *xq = (q8_block *)memory;
    const int full = M / KQ_PASS * KQ_PASS;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        /* The GEMM reads every input row's block b in turn: block-major for it, row-major for the others */
        for (int m = 0; m < M; m++)
            quantize_row(x, f32, (long)m * x_stride, K, q4, gemm ? xq + m : xq + (long)m * blocks, gemm ? M : 1);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
        if (lanes) {
            kx_block *kx = (kx_block *)(((uintptr_t)(memory + x_bytes) + 63) / 64 * 64);
            #pragma omp for schedule(static)
            for (int i = 0; i < tiles * blocks; i++) kx_inputs(xq, M, blocks, q4, i / blocks, i % blocks, kx + i);
            float acc[KX_NR * KX_LANES * (KX_MAX_M / KX_LANES)];
            /* shares halving as threads come free, as the GEMM's and the row tiles': on these VMs' unequal cores a
             * static share left one thread waiting (libgomp's wait 4.5-9.7 % of a 39-row prefill's samples) */
            #pragma omp for schedule(guided, 4) nowait
            for (int t = 0; t < N / KX_NR; t++) {
                if (q4) kx_tile(w, row_bytes, blocks, 1, kx, M, t * KX_NR, acc, bias, y, y_stride, f32);
                else kx_tile(w, row_bytes, blocks, 0, kx, M, t * KX_NR, acc, bias, y, y_stride, f32);
            }
        } else
#endif
#if defined(KG_ROWS)
        if (gemm) {
            char *mine = (char *)(((uintptr_t)(memory + x_bytes) + 63) / 64 * 64) + own * omp_get_thread_num();
            /* tiles handed out as threads come free: these VMs' two cores often run at unequal speeds, and a
             * static share waits for the slower; a tile of a few rows is small, so those go a few at a time */
            #pragma omp for schedule(dynamic, M >= 64 ? 1 : 64 / M) nowait
            for (int t = 0; t < kg_tiles(N); t++)
                kg_tile(w, row_bytes, blocks, format, xq, M, t * KG_ROWS, N, (kg_block *)mine, (float *)(mine + sizeof(kg_block)),
                        bias, y, y_stride, f32);
        } else
#endif
        #pragma omp for schedule(guided, KQ_MIN_CHUNK) nowait
        for (int t = 0; t < N / KQ_NR; t++) {
            const int n0 = t * KQ_NR;
#define KQ_TILE(mr, m0) kquant_tile(w, format, row_bytes, blocks, xq, bias, y, y_stride, n0, m0, mr, f32)
            for (int m0 = 0; m0 < full; m0 += KQ_PASS) KQ_TILE(KQ_PASS, m0);
            switch (M - full) {
                case 1: KQ_TILE(1, full); break;
                case 2: KQ_TILE(2, full); break;
                case 3: KQ_TILE(3, full); break;
#if KQ_PASS > 4
                case 4: KQ_TILE(4, full); break;
                case 5: KQ_TILE(5, full); break;
                case 6: KQ_TILE(6, full); break;
                case 7: KQ_TILE(7, full); break;
#endif
                default: break;
            }
#undef KQ_TILE
        }
    }
    return 0;
}

enum { MAX_PARTS = 4 };

#if defined(KG_ROWS)
/* kquant_linear_parts beyond a decode, where every part takes the GEMM (its rows a multiple of KG_GROUP, M at
 * least its format's threshold, and no lanes kernel for M): the inputs quantized once per order, block-major as
 * the GEMM reads them, and every part's tiles handed out from one loop. -1 where a part does not. */
static int kquant_parts_gemm(scratch *s, const void *x, const void *const *weights, const int32_t *formats,
                             const int *sizes, int parts, const uint16_t *bias, void *y, int M, int K, long x_stride,
                             long y_stride, int threads, int f32) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
    if (M >= KX_MIN_M && M <= KX_MAX_M) return -1;
#endif
    const int blocks = K / QK;
    int first[MAX_PARTS + 1] = {0}, at[MAX_PARTS] = {0}, orders = 0; /* first[i]: part i's first tile; at: column */
    for (int i = 0; i < parts; i++) {
        if (!kquant_format(formats[i]) || M < kg_least(formats[i]) || sizes[i] % KG_GROUP) return -1;

        first[i + 1] = first[i] + kg_tiles(sizes[i]);
        if (i) at[i] = at[i - 1] + sizes[i - 1];
        orders |= formats[i] != FMT_Q6_K ? 1 : 2;
    }
    const size_t one = (sizeof(q8_block) * (size_t)M * blocks + 63) / 64 * 64;
    const size_t own = (sizeof(kg_block) + sizeof(float) * KG_ROWS * (size_t)M + 63) / 64 * 64; /* each thread's */
    char *memory = scratch_reserve(s, SCRATCH_LINEAR, 2 * one + own * threads + 64);
    if (!memory) return -2;
    q8_block *xq[2] = {(q8_block *)memory, (q8_block *)(memory + one)}; /* in Q4_K's order, in the natural one */
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int i = 0; i < 2 * M; i++)
            if (orders & (1 << (i / M))) quantize_row(x, f32, (long)(i % M) * x_stride, K, i < M, xq[i / M] + i % M, M);
        char *mine = (char *)(((uintptr_t)(memory + 2 * one) + 63) / 64 * 64) + own * omp_get_thread_num();
        #pragma omp for schedule(dynamic, M >= 64 ? 1 : 64 / M) nowait /* as kquant_linear's GEMM */
        for (int t = 0; t < first[parts]; t++) {
            int i = 0;
            while (t >= first[i + 1]) i++;
            kg_tile(weights[i], (long)blocks * kq_block_bytes(formats[i]), blocks, formats[i], xq[formats[i] == FMT_Q6_K],
                    M, (t - first[i]) * KG_ROWS, sizes[i], (kg_block *)mine, (float *)(mine + sizeof(kg_block)),
                    bias ? bias + at[i] : NULL, (char *)y + (long)at[i] * (f32 ? 4 : 2), y_stride, f32);
        }
    }
    return 0;
}
#endif

/* Several K-quant weights of the same input width side by side (a file's separate q, k and v, or gate and up:
 * y's row holds their outputs one after another), in one parallel region: the inputs quantized once per order
 * the parts need, all the parts' tiles shared out as one loop. Part by part, each small linear paid a region of
 * its own and its threads' uneven finish, and a prefill quantized its inputs once per part. Up to KQ_MR rows (a
 * decode) through the row tiles, more through the GEMM (kquant_parts_gemm). Each output's arithmetic is
 * kquant_linear's. -1 for what it does not take (the caller goes part by part). */
int kquant_linear_parts(scratch *s, const void *x, const void *const *weights, const int32_t *formats,
                        const int *sizes, int parts, const uint16_t *bias, void *y, int M, int K, long x_stride,
                        long y_stride, int threads, int f32) {
    if (M < 1 || M > 512 || parts < 1 || parts > MAX_PARTS || K % QK || K / QK > KQ_MAX_BLOCKS) return -1;
    if (M > KQ_MR) {
#if defined(KG_ROWS)
        return kquant_parts_gemm(s, x, weights, formats, sizes, parts, bias, y, M, K, x_stride, y_stride, threads, f32);
#else
        return -1;
#endif
    }
    const int blocks = K / QK;
    int first[MAX_PARTS + 1] = {0}, orders = 0; /* first[i]: part i's first tile in the shared loop */
    for (int i = 0; i < parts; i++) {
        if (!kquant_format(formats[i]) || sizes[i] % KQ_NR) return -1;
        first[i + 1] = first[i] + sizes[i] / KQ_NR;
        orders |= formats[i] != FMT_Q6_K ? 1 : 2;
    }
    const size_t one = (sizeof(q8_block) * (size_t)M * blocks + 63) / 64 * 64;
    char *memory = scratch_reserve(s, SCRATCH_LINEAR, 2 * one);
    if (!memory) return -2;
    q8_block *xq[2] = {(q8_block *)memory, (q8_block *)(memory + one)}; /* in Q4_K's order, in the natural one */
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int i = 0; i < 2 * M; i++)
            if (orders & (1 << (i / M))) quantize_row(x, f32, (long)(i % M) * x_stride, K, i < M, xq[i / M] + (long)(i % M) * blocks, 1);
        #pragma omp for schedule(guided, KQ_MIN_CHUNK) nowait
        for (int t = 0; t < first[parts]; t++) {
            int i = 0, at = 0;
            while (t >= first[i + 1]) at += sizes[i++];
            const int q4 = formats[i] != FMT_Q6_K;
            const long row_bytes = (long)blocks * kq_block_bytes(formats[i]);
            const uint16_t *b = bias ? bias + at : NULL;
            char *into = (char *)y + (long)at * (f32 ? 4 : 2);
            const int n0 = (t - first[i]) * KQ_NR;
            switch (M) { /* the row count a constant in each copy */
                case 1: kquant_tile(weights[i], formats[i], row_bytes, blocks, xq[!q4], b, into, y_stride, n0, 0, 1, f32); break;
                case 2: kquant_tile(weights[i], formats[i], row_bytes, blocks, xq[!q4], b, into, y_stride, n0, 0, 2, f32); break;
                case 3: kquant_tile(weights[i], formats[i], row_bytes, blocks, xq[!q4], b, into, y_stride, n0, 0, 3, f32); break;
                default: kquant_tile(weights[i], formats[i], row_bytes, blocks, xq[!q4], b, into, y_stride, n0, 0, 4, f32); break;
            }
        }
    }
    return 0;
}
