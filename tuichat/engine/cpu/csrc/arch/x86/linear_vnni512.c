/* int8 dot products on 512-bit VNNI, tiles of 16 weight rows: every format quantized_linear (linear_quant.c)
 * takes. The same arithmetic as linear_int8.c's (inputs quantized per block of 32, exact int32 block sums, the
 * minimums' term), with the weights laid out so that one vector holds 4 consecutive quants of 16 rows: a dpbusd
 * against 4 input quants broadcast from memory is 64 products, and one cvt, a mul and an fmadd per block (a second
 * fmadd for a minimum that is not a fixed offset: offset_of) scale 16 outputs. The pair layout spends that per 8
 * outputs, a third of the products per instruction, which left prefills and batches compute-bound. Per tile of
 * 16 rows and per block: the quants (Q4: 4 vectors, whose low nibbles are weights 4h..4h+3 and high ones 16+4h..;
 * Q8_0: 8 vectors, + 128), (Q5_0, Q5_1) a vector of the rows' fifth bits, the 16 fp16 scales, then (Q4_1, Q5_1)
 * the 16 fp16 minimums: the same bytes as GGUF's, tile by tile in the order they are read. From TILED_PAIR_MIN_M input rows (a prefill) the nibble formats run two
 * adjacent tiles a pass, so that each broadcast of 4 inputs meets 32 rows. */
#include <omp.h>
#include <stdlib.h>

#include "../../linear.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TILED_ROWS 16
#define TILED_MR 6  /* input rows per pass over a tile: 6 accumulators, 8 weight vectors, of 32 registers */
#define TILED_PAIR_MR 4 /* input rows per pass over two tiles: 8 accumulators, 16 weight vectors */
#define TILED_PAIR_MIN_M 64 /* input rows from which tiles go two at a time (a prefill; at 40 no faster) */
/* A decode's tiles stream from DRAM, each thread through one contiguous range of them (static schedule):
 * asking for the bytes this far ahead keeps enough loads in flight, where the hardware prefetcher, restarted
 * at every short range a dynamic schedule handed out, did not. */
#define PREFETCH_BYTES 4096
#define OWN_COPY_ROWS 8  /* up to this many input rows, each thread quantizes them all (see tiled_linear) */
int tiled_path(int K) { return K % 32 == 0; }

static inline int tiled_block_bytes(int format) {
    switch (format) {
        case FMT_Q8_0: return 512 + 32;
        case FMT_Q4_1: return 256 + 64;
        case FMT_Q4_K_32: return 256 + 128;
        case FMT_Q5_K_32: return 512 + 128;
        case FMT_Q6_K_32: return 512 + 32 + 32;
        case FMT_Q5_0: return 256 + 64 + 32;
        case FMT_Q5_1: return 256 + 64 + 64;
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

/* Formats whose minimum is a fixed offset of the quants (Q4_0's 8, Q5_0's 16, Q8_0's 128 as its quants are
 * stored): offset times the inputs' sum joins the int32 sum exactly, as in llama.cpp's dot products, where the
 * others' minimums take an fma a block. */
static inline int offset_of(int format) {
    return format == FMT_Q4_0 ? -8 : format == FMT_Q5_0 ? -16 : format == FMT_Q8_0 ? -128 : 0;
}

/* Input rows [first, last) (bf16, or fp32 with f32): int8 quants in their own order (q, M x K), and per block dx
 * and either sx = dx * sum(q) or, for an offset format, qs = offset * sum(q) in its place (sx and qs alias). */
static void quantize_rows(const void *x, int f32, int first, int last, int K, long x_stride, int offset, int8_t *q,
                          float *dx, float *sx, int32_t *qs) {
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
            const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
            if (offset) qs[(long)m * blocks + b] = offset * sum;
            else sx[(long)m * blocks + b] = d * (float)sum;
        }
}

/* A tile's block b unpacked: its 8 vectors of 4 quants a row, its scales and minimums (the fp32 term per input
 * sum). */
static inline __attribute__((always_inline)) void tiled_weights(const uint8_t *block, const int format, __m512i w[8],
                                                                __m512 *d, __m512 *minimum) {
    const int quants = byte_quants(format) ? 512 : 256;
    const int scales = quants + (five_bit(format) ? 64 : 0); /* after Q5's fifth bits */
    const __m512i low = _mm512_set1_epi8(15), fifth = _mm512_set1_epi8(16);
    if (byte_quants(format)) {
        for (int g = 0; g < 8; g++) w[g] = _mm512_loadu_si512(block + 64 * g);
    } else {
        for (int h = 0; h < 4; h++) {
            __m512i v = _mm512_loadu_si512(block + 64 * h);
            w[h] = _mm512_and_si512(v, low);
            w[h + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        if (five_bit(format)) { /* bit 8k + g of a row's dword: the fifth bit of weight 4g + k, into bit 4 */
            const __m512i bits = _mm512_loadu_si512(block + 256);
            for (int g = 0; g < 8; g++) {
                const __m512i at = g < 4 ? _mm512_slli_epi32(bits, 4 - g) : _mm512_srli_epi32(bits, g - 4);
                w[g] = _mm512_ternarylogic_epi32(w[g], at, fifth, 0xf8); /* w | (at & fifth) */
            }
        }
    }
    if (from_k_quant(format)) {
        *d = _mm512_loadu_ps(block + quants);
        *minimum = _mm512_loadu_ps(block + quants + 64);
    } else {
        *d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(block + scales)));
        *minimum = format == FMT_Q4_1 || format == FMT_Q5_1    /* the others': offset_of */
                      ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(block + scales + 32)))
                      : _mm512_setzero_ps();
    }
}

/* Outputs n0..n0+15 of input rows m0..m0+mr-1, plus the bias: fp32, or to bf16, nearest even, as to_bf16. */
static inline __attribute__((always_inline)) void tiled_store(const __m512 *acc, const int mr, const uint16_t *bias,
                                                              void *y, long y_stride, int n0, int m0, int f32) {
    __m512 add = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(bias + n0))), 16))
                      : _mm512_setzero_ps();
    for (int j = 0; j < mr; j++) {
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

/* nt (1 or 2) adjacent tiles against input rows m0..m0+mr-1. With two (32 weight rows), each 4 inputs, broadcast
 * into a register once, meet both tiles' weights: one tile a pass spends a load per dpbusd on the broadcasts.
 * Each output's arithmetic is the same either way: the same bits. */
static inline __attribute__((always_inline)) void tiled_tiles(const uint8_t *tile, long tile_bytes, const int nt,
                                                              const int format, int blocks, const int8_t *q,
                                                              const float *dx, const float *sx, const int32_t *qs,
                                                              int K, const uint16_t *bias, void *y, long y_stride,
                                                              int n0, int m0, const int mr, int f32) {
    const int bytes = tiled_block_bytes(format);
    __m512 acc[2][TILED_MR];
    for (int t = 0; t < nt; t++)
        for (int j = 0; j < mr; j++) acc[t][j] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        __m512i w[2][8];
        __m512 d[2], minimum[2];
        for (int t = 0; t < nt; t++) {
            const uint8_t *block = tile + t * tile_bytes + (long)b * bytes;
            for (int l = 0; l < bytes; l += 64) __builtin_prefetch(block + PREFETCH_BYTES + l, 0, 0);
            if (format != FMT_Q6_K_32) tiled_weights(block, format, w[t], &d[t], &minimum[t]);
        }
        if (format == FMT_Q6_K_32) { /* one tile a pass (tiled_linear) */
            q6_block(tile + (long)b * bytes, q, dx, K, blocks, b, m0, mr, acc[0]);
            continue;
        }
        for (int j = 0; j < mr; j++) {
            const int8_t *xq = q + (long)(m0 + j) * K + b * 32;
            /* two chains of dpbusd a tile, not one of 8: on Zen 5, which runs two a cycle, a 512-row pass 5 %
             * faster with one tile */
            __m512i even[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()}, odd[2] = {even[0], even[0]};
            for (int g = 0; g < 8; g += 2) {
                int32_t four, next;
                memcpy(&four, xq + 4 * g, 4);
                memcpy(&next, xq + 4 * g + 4, 4);
                const __m512i x = _mm512_set1_epi32(four), xn = _mm512_set1_epi32(next);
                for (int t = 0; t < nt; t++) {
                    even[t] = _mm512_dpbusd_epi32(even[t], w[t][g], x);
                    odd[t] = _mm512_dpbusd_epi32(odd[t], w[t][g + 1], xn);
                }
            }
            const long at = (long)(m0 + j) * blocks + b;
            const __m512 scale = _mm512_set1_ps(dx[at]);
            for (int t = 0; t < nt; t++) {
                __m512i sums = _mm512_add_epi32(even[t], odd[t]);
                if (offset_of(format)) sums = _mm512_add_epi32(sums, _mm512_set1_epi32(qs[at]));
                acc[t][j] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), scale), d[t], acc[t][j]);
                if (!offset_of(format)) acc[t][j] = _mm512_fmadd_ps(minimum[t], _mm512_set1_ps(sx[at]), acc[t][j]);
            }
        }
    }
    for (int t = 0; t < nt; t++) tiled_store(acc[t], mr, bias, y, y_stride, n0 + TILED_ROWS * t, m0, f32);
}

/* The quantized inputs live in the call's scratch (SCRATCH_LINEAR): no allocation per step. */
int tiled_linear(scratch *s, const void *x, const uint8_t *w, int format, const uint16_t *bias, void *y, int M, int N,
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
    #pragma omp parallel num_threads(threads)
    {
    float *dx = (float *)(memory + (own_copy ? copy * omp_get_thread_num() : 0));
    float *sx = dx + (size_t)M * blocks;
    int32_t *qs = (int32_t *)sx;
    int8_t *q = (int8_t *)(sx + (size_t)M * blocks);
    if (own_copy) {
        quantize_rows(x, f32, 0, M, K, x_stride, offset_of(format), q, dx, sx, qs);
    } else {
        int share = (M + omp_get_num_threads() - 1) / omp_get_num_threads(), first = omp_get_thread_num() * share;
        quantize_rows(x, f32, first < M ? first : M, first + share < M ? first + share : M, K, x_stride,
                      offset_of(format), q, dx, sx, qs);
        #pragma omp barrier
    }
    /* units of one tile, or two where the inputs are many enough and the quants nibbles (a byte a quant: Q8_0's
     * pairs ran slower, their 16 vectors of weights each a load per dpbusd) */
    const int tiles = N / TILED_ROWS, per = M >= TILED_PAIR_MIN_M && !byte_quants(format) ? 2 : 1;
    #pragma omp for schedule(static) nowait
    for (int u = 0; u < (tiles + per - 1) / per; u++) {
        const int t = u * per, n0 = t * TILED_ROWS;
        const uint8_t *tile = w + t * tile_bytes;
#define ONE(F, mr, m0) \
    tiled_tiles(tile, tile_bytes, 1, F, blocks, q, dx, sx, qs, K, bias, y, y_stride, n0, m0, mr, f32)
#define TWO(F, mr, m0) \
    tiled_tiles(tile, tile_bytes, 2, F, blocks, q, dx, sx, qs, K, bias, y, y_stride, n0, m0, mr, f32)
#define RUN(KIND, F, MR) /* passes of MR input rows, then the rest: each row count a constant in its copy */ \
    do { \
        const int whole = M / (MR) * (MR); \
        for (int m0 = 0; m0 < whole; m0 += (MR)) KIND(F, MR, m0); \
        switch (M - whole) { \
            case 1: KIND(F, 1, whole); break; case 2: if ((MR) > 2) KIND(F, 2, whole); break; \
            case 3: if ((MR) > 3) KIND(F, 3, whole); break; case 4: if ((MR) > 4) KIND(F, 4, whole); break; \
            case 5: if ((MR) > 5) KIND(F, 5, whole); break; default: break; \
        } \
    } while (0)
        if (per == 2 && t + 1 < tiles) {
            switch (format) {
                case FMT_Q4_0: RUN(TWO, FMT_Q4_0, TILED_PAIR_MR); break;
                case FMT_Q4_1: RUN(TWO, FMT_Q4_1, TILED_PAIR_MR); break;
                case FMT_Q4_K_32: RUN(TWO, FMT_Q4_K_32, TILED_PAIR_MR); break;
                case FMT_Q5_0: RUN(TWO, FMT_Q5_0, TILED_PAIR_MR); break;
                default: RUN(TWO, FMT_Q5_1, TILED_PAIR_MR); break;
            }
            continue;
        }
        switch (format) {
            case FMT_Q4_0: RUN(ONE, FMT_Q4_0, TILED_MR); break;
            case FMT_Q4_1: RUN(ONE, FMT_Q4_1, TILED_MR); break;
            case FMT_Q4_K_32: RUN(ONE, FMT_Q4_K_32, TILED_MR); break;
            case FMT_Q5_K_32: RUN(ONE, FMT_Q5_K_32, TILED_MR); break;
            case FMT_Q6_K_32: RUN(ONE, FMT_Q6_K_32, TILED_MR); break;
            case FMT_Q5_0: RUN(ONE, FMT_Q5_0, TILED_MR); break;
            case FMT_Q5_1: RUN(ONE, FMT_Q5_1, TILED_MR); break;
            default: RUN(ONE, FMT_Q8_0, TILED_MR); break;
        }
#undef RUN
#undef TWO
#undef ONE
    }
    }
    return 0;
}

/* Q5_0 or Q5_1 blocks into tiles of their own 22 or 24 bytes a row: the nibbles as Q4_0's, then a dword a row
 * of fifth bits in the order the tile takes them (bit 8k + g: weight 4g + k's), then the fp16 d (and Q5_1's m). */
static int pack_five(const uint8_t *src, int format, int N, int K, uint8_t *dst) {
    const int head = format == FMT_Q5_1 ? 4 : 2, bytes = head + 20, blocks = K / 32, out_bytes = tiled_block_bytes(format);
    #pragma omp parallel for schedule(static)
    for (int t = 0; t < N / TILED_ROWS; t++)
        for (int b = 0; b < blocks; b++) {
            uint8_t *out = dst + ((long)t * blocks + b) * out_bytes;
            for (int r = 0; r < TILED_ROWS; r++) {
                const uint8_t *block = src + ((long)(t * TILED_ROWS + r) * blocks + b) * bytes;
                uint32_t qh, spread = 0;
                memcpy(&qh, block + head, 4);
                for (int g = 0; g < 8; g++)
                    for (int k = 0; k < 4; k++) spread |= (qh >> (4 * g + k) & 1u) << (8 * k + g);
                memcpy(out + 256 + 4 * r, &spread, 4);
                memcpy(out + 320 + 2 * r, block, 2);
                if (format == FMT_Q5_1) memcpy(out + 352 + 2 * r, block + 2, 2);
                for (int i = 0; i < 16; i++) out[64 * (i / 4) + 4 * r + i % 4] = block[head + 4 + i];
            }
        }
    return 0;
}

/* GGUF blocks (or a K-quant's blocks of 32) into tiles (see above). */
int pack_tiles(const uint8_t *src, int format, int N, int K, uint8_t *dst) {
    if (N % TILED_ROWS) return -1;
    if (five_bit(format)) return pack_five(src, format, N, K, dst);
    const int k = from_k_quant(format), bytes = k ? k_block_bytes(format) : block_bytes(format), blocks = K / 32;
    /* the block's head: its scale (an fp32 one for Q4_K, Q5_K), then a minimum (or Q6_K's two int8 scales) */
    const int scale = format == FMT_Q4_K_32 || format == FMT_Q5_K_32 ? 4 : 2;
    const int head = k || format == FMT_Q4_1 ? 2 * scale : 2;
    const int quants = byte_quants(format) ? 512 : 256, out_bytes = tiled_block_bytes(format);
    const uint32_t flip = format == FMT_Q8_0 ? 0x80808080u : 0;  /* Q8_0's int8 + 128, dpbusd's unsigned side */
    #pragma omp parallel for schedule(static)  /* a load packs hundreds of MB: both cores */
    for (int t = 0; t < N / TILED_ROWS; t++)
        for (int b = 0; b < blocks; b++) {
            uint8_t *out = dst + ((long)t * blocks + b) * out_bytes;
            for (int r = 0; r < TILED_ROWS; r++) {
                const uint8_t *block = src + ((long)(t * TILED_ROWS + r) * blocks + b) * bytes;
                memcpy(out + quants + scale * r, block, scale);
                if (head > scale) memcpy(out + quants + 16 * scale + scale * r, block + scale, scale);
                for (int i = 0; i < bytes - head; i += 4) {  /* quant bytes i..i+3: vector i / 4, lane r */
                    uint32_t four;
                    memcpy(&four, block + head + i, 4);
                    four ^= flip;
                    memcpy(out + 16 * i + 4 * r, &four, 4);
                }
            }
        }
    return 0;
}
#else
int tiled_path(int K) { (void)K; return 0; }
#endif
