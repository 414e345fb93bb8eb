/* The weights' layout, done once at load: GGUF blocks into the order the quantized paths read them (the same
 * bytes), and which layout a format and shape get on this build. The tiles' layout is arch/x86/linear_vnni512.c's;
 * the pairs' (arch/x86/linear_int8.c) and the rows' (linear_quant.c) are laid out here. */
#include <math.h>

#include "linear.h"

/* How pack_blocks lays out `format` with K inputs: "tiles" (512-bit VNNI), "pairs" (the int8 path; "signed pairs"
 * its Q8_0 without VNNI), "rows", or "in place": the K-quants read as the file holds them (linear_kquant.c), where
 * its vector path is built (its portable path is slower than the bf16 linear). */
const char *pack_layout(int format, int K) {
    if (kquant_format(format)) {
#if defined(KQ_VECTOR)
        if (K % 256 == 0 && K / 256 <= KQ_MAX_BLOCKS) return "in place";
#endif
        return "none";
    }
    format = same_layout(format);
    if (tiled_path(K)) return "tiles";
    if (tiled_only(format)) return "none";
    if (!int8_path(K)) return five_bit(format) ? "none" : "rows";
#if I8_MADDUBS
    if (format == FMT_Q8_0) return "signed pairs";
#endif
    return "pairs";
}

/* GGUF blocks (N rows of K / 32 blocks) into the layout quantized_linear reads, the same number of bytes. The
 * rows' layout: per row the quants in GGUF's order, then the fp16 scales, then (Q4_1) the fp16 minimums. The
 * pairs' (the int8 path, arch/x86/linear_int8.c): rows in quads, and per quad each pair of blocks (A, B) as one
 * run: the 4 rows' quants (Q4: A's 16 bytes then B's; Q5: the same, then A's 4 bytes of fifth bits and B's; Q8_0:
 * A's first 16, B's first 16, A's last 16, B's last 16, + 128 for VNNI), then the 8 scales (A's of rows 0-3, then
 * B's), then (Q4_1, Q5_1) the 8 minimums likewise.
 * 0, or -1 for a format or shape it does not take. */
int pack_blocks(const uint8_t *src, int format, int N, int K, uint8_t *dst) {
    format = same_layout(format);
    const int bytes = block_bytes(format), blocks = K / 32, head = format == FMT_Q4_1 || format == FMT_Q5_1 ? 4 : 2;
    const int q_bytes = bytes - head; /* Q5: its 4 bytes of fifth bits, then the nibbles */
    if ((!bytes && !tiled_only(format)) || K % 32 || blocks > MAX_BLOCKS) return -1;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (tiled_path(K)) return pack_tiles(src, format, N, K, dst);
#endif
    if (tiled_only(format)) return -1;  /* the tiled path's only */
    const long row_bytes = (long)blocks * bytes;
    if (!int8_path(K)) {
        if (five_bit(format)) return -1;
        #pragma omp parallel for schedule(static)
        for (long n = 0; n < N; n++) {
            const uint8_t *row = src + n * row_bytes;
            uint8_t *out = dst + n * row_bytes, *scales = out + (long)blocks * q_bytes;
            for (int b = 0; b < blocks; b++) {
                const uint8_t *block = row + (long)b * bytes;
                memcpy(out + (long)b * q_bytes, block + head, q_bytes);
                memcpy(scales + 2 * b, block, 2);
                if (format == FMT_Q4_1) memcpy(scales + 2 * blocks + 2 * b, block + 2, 2);
            }
        }
        return 0;
    }
    if (N % 4) return -1;
#if I8_MADDUBS
    const uint8_t flip = 0;
#else
    const uint8_t flip = format == FMT_Q8_0 ? 0x80 : 0; /* Q8_0's int8 + 128, dpbusd's unsigned side */
#endif
    #pragma omp parallel for schedule(static)
    for (long quad = 0; quad < N / 4; quad++)
        for (int p = 0; p < blocks / 2; p++) {
            uint8_t *out = dst + quad * 4 * row_bytes + (long)p * 8 * bytes, *scales = out + 4 * 2 * q_bytes;
            for (int r = 0; r < 4; r++)
                for (int side = 0; side < 2; side++) {
                    const uint8_t *block = src + (quad * 4 + r) * row_bytes + (long)(2 * p + side) * bytes;
                    uint8_t *row = out + 2 * q_bytes * r;
                    memcpy(scales + 2 * (4 * side + r), block, 2);
                    if (head == 4) memcpy(scales + 16 + 2 * (4 * side + r), block + 2, 2);
                    if (five_bit(format)) { /* the two blocks' nibbles (32 bytes), then their fifth bits (8) */
                        memcpy(row + 16 * side, block + head + 4, 16);
                        memcpy(row + 32 + 4 * side, block + head, 4);
                        continue;
                    }
                    for (int t = 0; t < q_bytes; t++) /* Q8_0's halves of 16 alternate between the blocks */
                        row[format == FMT_Q8_0 ? 32 * (t / 16) + 16 * side + t % 16 : 16 * side + t] = block[head + t] ^ flip;
                }
        }
    return 0;
}

/* An IEEE half's value (exact in fp32). */
static float half_value(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 31, mantissa = h & 1023, bits;
    if (exponent == 0) return (sign ? -1.0f : 1.0f) * ldexpf((float)mantissa, -24);
    bits = sign | (exponent == 31 ? 0x7f800000 | mantissa << 13 : (exponent + 112) << 23 | mantissa << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* quant.recut's Q5_0 (qtype 6) and Q5_1 (7) in one pass, byte for byte its output: per block of 32, d and the
 * minimum (-16 d, or Q5_1's m) in fp32, then each weight's 5-bit quant a byte (the nibbles' low half first, the
 * fifth bits from the block's qh). numpy took seconds for a 1B model's hundred such tensors. 0, or -1. */
int recut_5bit(const uint8_t *src, int qtype, long blocks, uint8_t *dst) {
    if (qtype != 6 && qtype != 7) return -1;
    const int in = qtype == 6 ? 22 : 24, head = qtype == 6 ? 2 : 4;
    #pragma omp parallel for schedule(static)
    for (long b = 0; b < blocks; b++) {
        const uint8_t *block = src + b * in, *qs = block + head + 4;
        uint8_t *out = dst + b * 40;
        float d = half_value(block), minimum = qtype == 6 ? -16.0f * d : half_value(block + 2);
        uint32_t qh;
        memcpy(&qh, block + head, 4);
        memcpy(out, &d, 4);
        memcpy(out + 4, &minimum, 4);
        for (int j = 0; j < 16; j++) {
            out[8 + j] = (uint8_t)((qs[j] & 15) | ((qh >> j) & 1) << 4);
            out[24 + j] = (uint8_t)((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4);
        }
    }
    return 0;
}
