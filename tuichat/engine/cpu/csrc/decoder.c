/* The decoder layers of a llama-family model (llama, mistral, qwen2) in one call, for steps of 1 to 512 rows,
 * in bf16 (or, with weights in a GGUF's blocks, fp32 over an f16 cache: see rms_norm_f32); built with the
 * linears (linear.c) and driven by native.py.
 *
 * fp32 steps also run Qwen3's and Gemma 3's layers: per-head q/k norms, norms after the attention and the MLP,
 * a GELU gate, sliding-window layers with their own RoPE (layer_weights in kernels.h).
 *
 * Why: with the matmuls in our own kernels, a decode step through transformers' modules still spent much of
 * its time in small torch ops and their Python: norms, rotary, casts, gathers, adds (docs/design/kernels.md
 * has the figures). Here a layer is eight passes over a few rows. The arithmetic mirrors transformers' bf16 code: every place where torch
 * rounds an intermediate to bf16, this code rounds too, so the two differ only in the order of fp32 sums.
 *
 * Rows are the step's new tokens, of any sequences, in any order. Row t sits at position pos[t] of its
 * sequence, whose block table starts at tables[table_off[t]]; its K/V go to that position's slot, and it
 * attends to positions 0..pos[t] of its sequence through the cache (so a prefill chunk's rows see each
 * other causally, and cached prefixes come for free).
 */
#define _GNU_SOURCE /* sched_getcpu, sched_setaffinity */
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stddef.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

/* Whether a cheap pass over n elements (a norm, a residual add, the rotary) is shared by the threads: a prefill
 * chunk's is (one thread running them alone left the other waiting), a decode's few rows stay on the calling
 * thread, where entering a parallel region costs more than their work. */
#define WORTH_THREADS(n) ((long)(n) >= 65536)

/* transformers' RMSNorm: x * rsqrt(mean(x^2) + eps) in fp32, rounded to bf16, times the weight, rounded. */
static void rms_norm(const uint16_t *x, const uint16_t *weight, uint16_t *out, int rows, int width, float eps, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (WORTH_THREADS((long)rows * width))
    for (int t = 0; t < rows; t++) {
        const uint16_t *row = x + (long)t * width;
        vf squares = {};
        for (int i = 0; i < width; i += LANES) { vf v = load_bf16(row + i); squares += v * v; }
        vf scale = splat(1.0f / sqrtf(hsum(squares) / width + eps));
        for (int i = 0; i < width; i += LANES)
            store_bf16(out + (long)t * width + i, round_bf16(load_bf16(row + i) * scale) * load_bf16(weight + i));
    }
}

/* x (+)= y, rounded: the residual adds. */
static void add_into(uint16_t *x, const uint16_t *y, long n, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (WORTH_THREADS(n))
    for (long i = 0; i < n; i += LANES) store_bf16(x + i, load_bf16(x + i) + load_bf16(y + i));
}

/* The fp32 path, for weights served as a GGUF stores them: there is no bf16 model to mirror, only the float32
 * one the file dequantizes to, so every activation stays fp32 (as llama.cpp keeps them) and the KV cache is
 * f16 (as llama.cpp's): a bf16 rounding of each linear's input before its int8 quantization, and a bf16 cache,
 * each measurably moved the replies further from float32's (scripts/fidelity.py). */
static void norm_row_f32(const float *row, const float *weight, float *out, int width, float eps) {
    vf squares = {};
    for (int i = 0; i < width; i += LANES) { vf v = load_f32(row + i); squares += v * v; }
    vf scale = splat(1.0f / sqrtf(hsum(squares) / width + eps));
    for (int i = 0; i < width; i += LANES) store_f32(out + i, load_f32(row + i) * scale * load_f32(weight + i));
}

static void rms_norm_f32(const float *x, const float *weight, float *out, int rows, int width, float eps, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (WORTH_THREADS((long)rows * width))
    for (int t = 0; t < rows; t++) norm_row_f32(x + (long)t * width, weight, out + (long)t * width, width, eps);
}

static void add_into_f32(float *x, const float *y, long n, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (WORTH_THREADS(n))
    for (long i = 0; i < n; i += LANES) store_f32(x + i, load_f32(x + i) + load_f32(y + i));
}

static void rotate_f32(float *head, const float *cos, const float *sin, int dim) {
    int half = dim / 2;
    for (int i = 0; i < half; i += LANES) {
        vf x1 = load_f32(head + i), x2 = load_f32(head + half + i);
        store_f32(head + i, x1 * load_f32(cos + i) - x2 * load_f32(sin + i));
        store_f32(head + half + i, x2 * load_f32(cos + half + i) + x1 * load_f32(sin + half + i));
    }
}

/* act(gate) * up: act 0 SiLU, 1 GELU's tanh approximation (Gemma's gelu_pytorch_tanh), tanh(u) as
 * 1 - 2 / (e^2u + 1). */
static void act_mul_f32(const float *gate_up, float *out, int rows, int width, int threads, int act) {
    #pragma omp parallel for num_threads(threads) schedule(static) if ((long)rows * width >= 16384)
    for (int t = 0; t < rows; t++) {
        const float *gate = gate_up + (long)t * 2 * width, *up = gate + width;
        for (int i = 0; i < width; i += LANES) {
            vf g = load_f32(gate + i), a;
            if (act) {
                vf u = 0.7978845608f * (g + 0.044715f * g * g * g);
                a = 0.5f * g * (2.0f - 2.0f / (vexp(2.0f * u) + 1.0f));
            } else {
                a = g / (1.0f + vexp(-g));
            }
            store_f32(out + (long)t * width + i, a * load_f32(up + i));
        }
    }
}

/* q * cos + rotate_half(q) * sin over one head, each product and the sum rounded as torch does. */
static void rotate(uint16_t *head, const uint16_t *cos, const uint16_t *sin, int dim) {
    int half = dim / 2;
    for (int i = 0; i < half; i += LANES) {
        vf x1 = load_bf16(head + i), x2 = load_bf16(head + half + i);
        vf lo = round_bf16(x1 * load_bf16(cos + i)) + round_bf16(-x2 * load_bf16(sin + i));
        vf hi = round_bf16(x2 * load_bf16(cos + half + i)) + round_bf16(x1 * load_bf16(sin + half + i));
        store_bf16(head + i, lo);
        store_bf16(head + half + i, hi);
    }
}

/* s[0..n) <- exp(s - max s), in place, for n rounded up to LANES (the caller pads); returns the sum of the
 * first n (the caller scales once, at the end) and their max in *top_out. The max by two chains and a halving
 * tree, vexp without its upper clamp (s - max <= 0): the same values, where one chain and a lane-by-lane max had
 * made it latency-bound. */
static float softmax_numerators(float *s, int n, float *top_out) {
    int padded = (n + LANES - 1) / LANES * LANES, j = 0;
    for (int k = n; k < padded; k++) s[k] = -INFINITY;
    vf top = splat(-INFINITY), other = top;
    for (; j + 2 * LANES <= padded; j += 2 * LANES) {
        vf v = load_f32(s + j), w = load_f32(s + j + LANES);
        top = pick(v > top, v, top);
        other = pick(w > other, w, other);
    }
    if (j < padded) { vf v = load_f32(s + j); top = pick(v > top, v, top); }
    *top_out = hmax(pick(other > top, other, top));
    vf shift = splat(*top_out), total = {};
    for (j = 0; j < padded; j += LANES) {
        vf x = load_f32(s + j), p = vexp_clamped_below(x - shift);
        p = pick(x == -INFINITY, splat(0.0f), p);
        store_f32(s + j, p);
        total += p;
    }
    return hsum(total);
}

/* The cache slot of position j of a sequence. */
static inline long slot_at(const int32_t *table, int block_size, int j) {
    return (long)table[j / block_size] * block_size + j % block_size;
}

/* Ask for one block's 16 rows of one head ahead of use: a decode's K/V come from DRAM (a step's weights
 * have evicted them) and at 16 positions per ~50 ns of compute, only a deep prefetch keeps the loads busy. */
#define PREFETCH_BLOCK(cache, first, stride, dim, level)                                                    \
    for (int j_ = 0; j_ < 16; j_++)                                                                       \
        for (int b_ = 0; b_ < (dim) * 2; b_ += 64) __builtin_prefetch((const char *)((cache) + ((first) + j_) * (stride)) + b_, 0, level);
#define AHEAD 64  /* positions */

/* Called as scoring reaches position j0 (a multiple of 32): the K and V of the 32 positions AHEAD further
 * on (and, at the first position lo, of the first AHEAD as well), values to L2 for the weighted sum that
 * follows. */
static inline void prefetch_ahead(const uint16_t *k_head, const uint16_t *v_head, const int32_t *table,
                                  int block_size, int lo, int n, long stride, int dim, int j0) {
    for (int ahead = j0 == lo ? lo : j0 + AHEAD; ahead < n && ahead < j0 + AHEAD + 32; ahead += 16) {
        long first = slot_at(table, block_size, ahead);
        PREFETCH_BLOCK(k_head, first, stride, dim, 3)
        PREFETCH_BLOCK(v_head, first, stride, dim, 2)
    }
}

/* Attention of a long row is split at fixed positions, every SPLIT, into tasks the threads share (a decode's
 * few KV heads alone would leave a thread idle), whose partial softmaxes are then merged in order. A fixed
 * split, not one by thread or batch: a row's result depends on its positions alone. A multiple of 32. */
#define SPLIT 256

/* Consecutive rows of one sequence (a prefill chunk, speculation's verify rows) attend together, up to
 * ROWS_AT_ONCE(group) of them, so that each key and value is widened from the cache once for all their query
 * heads (the widening cost half as much as the multiply-adds it fed). Rows and the group's heads together stay
 * at most 12, so that the weighted sums' accumulators fit in registers. */
#define ROWS_AT_ONCE(group) ((group) <= 3 ? 4 : (group) <= 6 ? 2 : 1)
#define MOST_ROWS 4   /* ROWS_AT_ONCE's largest */
#define MOST_HEADS 12 /* query heads of a task: rows x group, or a lone row's group of up to 8 */

/* One row's share of an attention task: its query heads and result, and its positions lo..n (lo a multiple of
 * 16) of which those before `first` are masked (a sliding window's start; at most lo elsewhere). */
typedef struct {
    const void *q;
    void *out;
    float *partial;
    int lo, first, n;
} row_job;

/* A score tile's query heads and keys, its accumulators and keys in registers (32 with AVX-512, 16 with AVX2):
 * with AVX-512 all of a task's heads (up to 12) at once where they are more than 4, 2 keys a tile, so that each
 * key is widened once for all of them (two tiles of 4 heads widened it twice); else 4 heads x 4 keys (AVX2: x 2). */
#define TILE_HEADS(heads) (LANES == 16 && (heads) > 4 ? (heads) : (heads) < 4 ? (heads) : 4)
#define TILE_KEYS(heads) (LANES == 16 ? ((heads) > 4 ? 2 : 4) : 2)

/* The key a block's positions past a task's last read: 0 in f16 and bf16 alike. */
static const uint16_t zero_key[256];

#if LANES == 16
static const float zero_query[256];  /* the query of a pass's heads past a task's */

/* The keys of positions lo..n (lo a multiple of 16) of one KV head, widened to fp32 and laid 16 positions to a
 * vector: kt[(j - lo) / 16][d][16]. Past n, 0. */
static void transpose_keys(const uint16_t *k_head, const int32_t *table, int block_size, long stride, int lo, int n,
                           int dim, int f32, float *kt) {
    for (int j0 = lo; j0 < n; j0 += 16) {
        const uint16_t *keys = k_head + slot_at(table, block_size, j0) * stride;
        const int count = n - j0 < 16 ? n - j0 : 16;
        for (int c = 0; c < dim / 16; c++) {
            vf a[16], b[16];
            for (int j = 0; j < 16; j++)
                a[j] = j >= count ? splat(0.0f) : f32 ? load_f16(keys + (long)j * stride + 16 * c) : load_bf16(keys + (long)j * stride + 16 * c);
            for (int i = 0; i < 16; i += 2) {
                b[i] = __builtin_shufflevector(a[i], a[i + 1], 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29);
                b[i + 1] = __builtin_shufflevector(a[i], a[i + 1], 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31);
            }
            for (int i = 0; i < 16; i += 4)
                for (int k = 0; k < 2; k++) {
                    a[i + 2 * k] = __builtin_shufflevector(b[i + k], b[i + k + 2], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
                    a[i + 2 * k + 1] = __builtin_shufflevector(b[i + k], b[i + k + 2], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
                }
            for (int i = 0; i < 16; i += 8)
                for (int k = 0; k < 4; k++) {
                    b[i + k] = __builtin_shufflevector(a[i + k], a[i + k + 4], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
                    b[i + k + 4] = __builtin_shufflevector(a[i + k], a[i + k + 4], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
                }
            for (int k = 0; k < 8; k++) {
                a[k] = __builtin_shufflevector(b[k], b[k + 8], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
                a[k + 8] = __builtin_shufflevector(b[k], b[k + 8], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
            }
            float *out = kt + (long)(j0 - lo) * dim + 16L * 16 * c;
            for (int d = 0; d < 16; d++) store_f32(out + 16 * d, a[d]);
        }
    }
}

/* The scores of query heads q[0..heads) (fp32, dim each) against positions lo..n, their keys transposed at kt (from
 * lo), times scale: head i's score of position j into dest[i][j], a block of 16 at a time where the block's first
 * position lies in from[i]..to[i]. Keys in lanes: 16 positions' scores a vector, each lane's 16 chains of fmas
 * over the dims (l, l + 16, ...) added in the order sum_each adds a key's lanes, so the same scores as the rows
 * of keys give. 4 heads x 2 blocks x 2 chains a pass: each broadcast of a query's dim serves two blocks (one
 * broadcast a fma was bound by the loads). */
static inline __attribute__((always_inline)) void scores_transposed_shape(
        const float *const *q, int heads, const float *kt, int lo, int n, const int dim, float scale,
        float *const *dest, const int *from, const int *to) {
    const int chunks = dim / 16;
    for (int j0 = lo; j0 < n; j0 += 32) {
        const float *keys[2] = {kt + (long)(j0 - lo) * dim, j0 + 16 < n ? kt + (long)(j0 + 16 - lo) * dim : kt + (long)(j0 - lo) * dim};
        for (int m0 = 0; m0 < heads; m0 += 4) {
            const float *qm[4];
            for (int m = 0; m < 4; m++) qm[m] = m0 + m < heads ? q[m0 + m] : zero_query;
            vf half[2][4], third[2][4], out[2][4], even[2][4];
            for (int g = 0; g < 4; g++)
                for (int pair = 0; pair < 2; pair++) {  /* lanes 4g + pair and 4g + pair + 2 */
                    vf acc[2][4][2];
                    for (int b = 0; b < 2; b++)
                        for (int m = 0; m < 4; m++) acc[b][m][0] = acc[b][m][1] = splat(0.0f);
                    for (int c = 0; c < chunks; c++)
                        for (int e = 0; e < 2; e++) {
                            const int d = 16 * c + 4 * g + pair + 2 * e;
                            vf k0 = load_f32(keys[0] + 16 * d), k1 = load_f32(keys[1] + 16 * d);
                            __asm__("" : "+v"(k0), "+v"(k1));  /* loaded once: GCC had folded them into every fma */
                            for (int m = 0; m < 4; m++) {
                                vf qd = splat(qm[m][d]);
                                __asm__("" : "+v"(qd));
                                acc[0][m][e] += qd * k0;
                                acc[1][m][e] += qd * k1;
                            }
                        }
                    for (int b = 0; b < 2; b++)
                        for (int m = 0; m < 4; m++) {
                            const vf x = acc[b][m][0] + acc[b][m][1];
                            if (pair == 0) { even[b][m] = x; continue; }
                            const vf a = even[b][m] + x;  /* (l0 + l2) + (l1 + l3) of the 4 lanes from 4g */
                            if (g == 0) half[b][m] = a;
                            else if (g == 1) half[b][m] += a;
                            else if (g == 2) third[b][m] = a;
                            else out[b][m] = half[b][m] + (third[b][m] + a);
                        }
                }
            for (int b = 0; b < 2 && j0 + 16 * b < n; b++)
                for (int m = 0; m < 4 && m0 + m < heads; m++)
                    if (j0 + 16 * b >= from[m0 + m] && j0 + 16 * b < to[m0 + m])
                        store_f32(dest[m0 + m] + j0 + 16 * b, out[b][m] * scale);
        }
    }
}

static void scores_transposed(const float *const *q, int heads, const float *kt, int lo, int n, int dim, float scale,
                              float *const *dest, const int *from, const int *to) {
    switch (dim) {
        case 64: scores_transposed_shape(q, heads, kt, lo, n, 64, scale, dest, from, to); return;
        case 128: scores_transposed_shape(q, heads, kt, lo, n, 128, scale, dest, from, to); return;
        default: scores_transposed_shape(q, heads, kt, lo, n, dim, scale, dest, from, to);
    }
}
#endif

/* Up to R rows and one KV head: for each row, softmax(q k^T * scale) v for the `group` query heads that share
 * the head, over the row's positions, rounded once to bf16 (with f32: q and the result fp32, the cache f16,
 * see above). Where those are all the row's positions (lo 0 and n <= SPLIT), that is the result; else
 * `partial` takes each head's max score, sum of numerators and unscaled weighted sum (dim + 2 floats a head),
 * for merge_partials. With AMX the scores come from tiles: 16 keys of one cache block are one A tile read in
 * place (they sit at a fixed stride), the group's queries, in pairs, the B tile; two blocks go at once, so one
 * block's multiply hides the other's latency (needs attention_tiles()). Given kt (a prefill's run of rows:
 * transpose_keys' keys from position kt_lo), scores_transposed's keys in lanes. Else one vector dot product per
 * key and head, each key widened once for all the rows' heads. Softmax and the weighted sum of values run in
 * fp32. Each row's arithmetic is the same, in the same order, whichever rows share its task: that is what
 * keeps a reply independent of batching and chunking. work: group * SPLIT floats a row (its scores), and with
 * AMX group * SPLIT more (the tiles' stores, a row at a time). Always inlined into attend(), which fixes group,
 * dim and R so that the accumulators live in registers; each of those shapes costs compile time, paid once per
 * machine. */
static inline __attribute__((always_inline)) void attend_shape(
        const row_job *jobs, int R, const int RMAX, const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *table,
        int block_size, int kv_heads, int kv_head, const int group, const int dim, float scale, float *work,
        const int f32, const float *kt, int kt_lo) {
    const int chunks = dim / LANES;
    int lo = jobs[0].lo, n = jobs[0].n, padded[MOST_ROWS];
    float *scores[MOST_ROWS];
    for (int r = 0; r < RMAX && r < R; r++) {
        lo = jobs[r].lo < lo ? jobs[r].lo : lo;
        n = jobs[r].n > n ? jobs[r].n : n;
        padded[r] = (jobs[r].n - jobs[r].lo + 31) / 32 * 32;
        scores[r] = work + (long)r * group * SPLIT;
    }
    long stride = (long)kv_heads * dim;  /* elements from one position to the next within a block */
    const uint16_t *k_head = k_cache + (long)kv_head * dim, *v_head = v_cache + (long)kv_head * dim;
#define LOAD_KV(p) (f32 ? load_f16(p) : load_bf16(p))
#ifdef __AMX_TILE__
    if (!f32) {  /* AMX multiplies bf16 only */
    for (int r = 0; r < RMAX && r < R; r++) {
    const uint16_t *q = jobs[r].q;
    const int row_lo = jobs[r].lo, row_n = jobs[r].n;
    uint32_t pairs[4][16][8];  /* per 32 dims: [pair][head] = (q[2i], q[2i+1]); dim <= 128, group <= 8 */
    for (int c = 0; c < dim / 32; c++)
        for (int i = 0; i < 16; i++)
            for (int h = 0; h < group; h++) memcpy(&pairs[c][i][h], q + (long)h * dim + 32 * c + 2 * i, 4);
    float *by_key = work + (long)RMAX * group * SPLIT;  /* [position][head], as the tiles store them */
    for (int j0 = row_lo; j0 < row_n; j0 += 32) {
        prefetch_ahead(k_head, v_head, table, block_size, row_lo, row_n, stride, dim, j0);
        const uint16_t *keys0 = k_head + slot_at(table, block_size, j0) * stride;
        const uint16_t *keys1 = j0 + 16 < row_n ? k_head + slot_at(table, block_size, j0 + 16) * stride : keys0;
        _tile_zero(0);
        _tile_zero(3);
        for (int c = 0; c < dim / 32; c++) {
            _tile_loadd(2, pairs[c], 32);
            _tile_loadd(1, keys0 + 32 * c, stride * 2);
            _tile_loadd(4, keys1 + 32 * c, stride * 2);
            _tile_dpbf16ps(0, 1, 2);
            _tile_dpbf16ps(3, 4, 2);
        }
        _tile_stored(0, by_key + (long)(j0 - row_lo) * group, group * 4);
        _tile_stored(3, by_key + (long)(j0 - row_lo + 16) * group, group * 4);
    }
    const __m512i by_head = column_offsets(group);
    for (int h = 0; h < group; h++)
        for (int j0 = 0; j0 < row_n - row_lo; j0 += 16)
            _mm512_storeu_ps(scores[r] + (long)h * padded[r] + j0,
                             _mm512_mul_ps(_mm512_i32gather_ps(by_head, by_key + (long)j0 * group + h, 4), _mm512_set1_ps(scale)));
    }
    } else
#endif
#if LANES == 16
    if (kt) {
    const int all_heads = R * group;
    float widened[f32 ? 1 : MOST_HEADS][f32 ? 1 : 256];
    const float *qh[MOST_HEADS];
    float *dest[MOST_HEADS];
    int from[MOST_HEADS], to[MOST_HEADS];
    for (int i = 0; i < all_heads; i++) {
        const row_job *job = jobs + i / group;
        dest[i] = scores[i / group] + (long)(i % group) * padded[i / group] - job->lo;
        from[i] = job->lo, to[i] = job->n;
        if (f32) { qh[i] = (const float *)job->q + (long)(i % group) * dim; continue; }
        for (int c = 0; c < chunks; c++) store_f32(widened[i] + LANES * c, load_bf16((const uint16_t *)job->q + (long)(i % group) * dim + LANES * c));
        qh[i] = widened[i];
    }
    scores_transposed(qh, all_heads, kt + (long)(lo - kt_lo) * dim, lo, n, dim, scale, dest, from, to);
    } else
#endif
    {
    /* Dot products in tiles of TILE_HEADS query heads x TILE_KEYS keys, the accumulators in registers: each
     * widened key serves the tile's heads, each query chunk the tile's keys. Heads past the task's (a tile's
     * remainder, rows it lacks) have a query of 0. */
    const int all_heads = RMAX * group, tile = TILE_HEADS(all_heads), keys_at_once = TILE_KEYS(all_heads);
    const int tiled = (all_heads + tile - 1) / tile * tile;
    vf qv[MOST_HEADS][256 / LANES];
    for (int i = 0; i < tiled; i++)
        for (int c = 0; c < chunks; c++)
            qv[i][c] = i >= R * group ? splat(0.0f)
                       : f32 ? load_f32((const float *)jobs[i / group].q + (long)(i % group) * dim + LANES * c)
                             : load_bf16((const uint16_t *)jobs[i / group].q + (long)(i % group) * dim + LANES * c);
    for (int j0 = lo; j0 < n; j0 += 16) {  /* no software prefetch: measured slower here than the hardware's */
        const uint16_t *keys = k_head + slot_at(table, block_size, j0) * stride, *key_at[16];
        const int count = n - j0 < 16 ? n - j0 : 16;  /* past n: a score of 0 that the softmax then masks */
        for (int j = 0; j < 16; j++) key_at[j] = j < count ? keys + (long)j * stride : zero_key;
        int active[MOST_ROWS];
        for (int r = 0; r < RMAX && r < R; r++) active[r] = j0 >= jobs[r].lo && j0 < jobs[r].n;
        /* A block's dot products have their lane sums taken LANES at once (sum_each: ~3 operations a sum where
         * a horizontal sum per position took ~10). A row's keys past its n are scored, then masked. */
        vf dots[MOST_HEADS][16];
        for (int k0 = 0; k0 < 16; k0 += keys_at_once)
            for (int m0 = 0; m0 < tiled; m0 += tile) {
                vf acc[MOST_HEADS][4];
                for (int m = 0; m < tile; m++)
                    for (int k = 0; k < keys_at_once; k++) acc[m][k] = splat(0.0f);
                for (int c = 0; c < chunks; c++) {
                    vf key[4];
                    for (int k = 0; k < keys_at_once; k++) key[k] = LOAD_KV(key_at[k0 + k] + LANES * c);
                    for (int m = 0; m < tile; m++)
                        for (int k = 0; k < keys_at_once; k++) acc[m][k] += qv[m0 + m][c] * key[k];
                }
                for (int m = 0; m < tile; m++)
                    for (int k = 0; k < keys_at_once; k++) dots[m0 + m][k0 + k] = acc[m][k];
            }
        for (int r = 0; r < RMAX && r < R; r++) {
            if (!active[r]) continue;
            for (int h = 0; h < group; h++)
                for (int first = 0; first < 16; first += LANES)
                    store_f32(scores[r] + (long)h * padded[r] + (j0 - jobs[r].lo) + first, sum_each(dots[r * group + h] + first) * scale);
        }
    }
    }
    float inverse[MOST_ROWS][8];
    for (int r = 0; r < RMAX && r < R; r++)
        for (int h = 0; h < group; h++) {
            float *row = scores[r] + (long)h * padded[r];
            for (int j = jobs[r].lo; j < jobs[r].first && j < jobs[r].n; j++) row[j - jobs[r].lo] = -INFINITY;
            float top, sum = softmax_numerators(row, jobs[r].n - jobs[r].lo, &top);
            inverse[r][h] = 1.0f / sum;
            if (jobs[r].partial) jobs[r].partial[(long)h * (dim + 2)] = top, jobs[r].partial[(long)h * (dim + 2) + 1] = sum;
        }
    /* Each head's weights where the softmax left them: weight[i][j], position j of query head i (row i / group). */
    const int heads_at_once = RMAX * group;
    const float *weight[MOST_HEADS];
    for (int r = 0; r < RMAX && r < R; r++)
        for (int h = 0; h < group; h++) weight[r * group + h] = scores[r] + (long)h * padded[r] - jobs[r].lo;
    int all_from = lo, all_to = R == RMAX ? n : lo;  /* where every row of the task takes part */
    for (int r = 0; r < RMAX && r < R; r++) {
        all_from = jobs[r].lo > all_from ? jobs[r].lo : all_from;
        all_to = jobs[r].n < all_to ? jobs[r].n : all_to;
    }
    /* The weighted sum in passes over a few chunks of the dims, so that a pass's R x group x few accumulators
     * stay in registers (all of them at once spilled: a load and a store per fma); each accumulator still adds
     * its row's positions in order. Where every row takes part, a loop without the rows' bounds: the checks
     * in the loop had cost a third of its time. */
    const int few = 16 / heads_at_once > 4 ? 4 : 16 / heads_at_once < 1 ? 1 : 16 / heads_at_once;
    for (int c0 = 0; c0 < chunks; c0 += few) {
        vf part[MOST_ROWS][8][4];
        for (int r = 0; r < RMAX && r < R; r++)
            for (int h = 0; h < group; h++)
                for (int c = 0; c < few; c++) part[r][h][c] = splat(0.0f);
        for (int j0 = lo; j0 < n; j0 += 16) {  /* a block's 16 positions at a time: no division per position */
            const uint16_t *values = v_head + slot_at(table, block_size, j0) * stride + LANES * c0;
            if (c0 == 0 && j0 + 16 < n) PREFETCH_BLOCK(v_head, slot_at(table, block_size, j0 + 16), stride, dim, 3)
            const int end = n < j0 + 16 ? n : j0 + 16;
            if (j0 >= all_from && end <= all_to)
                for (int j = j0; j < end; j++) {
                    vf vv[4];
                    for (int c = 0; c < few && c0 + c < chunks; c++) vv[c] = LOAD_KV(values + (j - j0) * stride + LANES * c);
                    for (int r = 0; r < RMAX; r++)
                        for (int h = 0; h < group; h++)
                            for (int c = 0; c < few && c0 + c < chunks; c++) part[r][h][c] += splat(weight[r * group + h][j]) * vv[c];
                }
            else
                for (int j = j0; j < end; j++) {
                    vf vv[4];
                    for (int c = 0; c < few && c0 + c < chunks; c++) vv[c] = LOAD_KV(values + (j - j0) * stride + LANES * c);
                    for (int r = 0; r < RMAX && r < R; r++) {
                        if (j < jobs[r].lo || j >= jobs[r].n) continue;
                        for (int h = 0; h < group; h++)
                            for (int c = 0; c < few && c0 + c < chunks; c++) part[r][h][c] += splat(weight[r * group + h][j]) * vv[c];
                    }
                }
        }
        for (int r = 0; r < RMAX && r < R; r++)
            for (int h = 0; h < group; h++)
                for (int c = 0; c < few && c0 + c < chunks; c++) {
                    long at = (long)h * dim + LANES * (c0 + c);
                    if (jobs[r].partial) store_f32(jobs[r].partial + (long)h * (dim + 2) + 2 + LANES * (c0 + c), part[r][h][c]);
                    else if (f32) store_f32((float *)jobs[r].out + at, part[r][h][c] * inverse[r][h]);
                    else store_bf16((uint16_t *)jobs[r].out + at, part[r][h][c] * inverse[r][h]);
                }
    }
#undef LOAD_KV
}

/* One query head's result from its row's `parts` partials (dim + 2 floats each, `step` apart), merged in
 * position order: each part's sums scaled from its own max to the overall one. */
static void merge_partials(const float *partial, long step, int parts, int dim, void *out, int f32) {
    float top = -INFINITY, total = 0.0f;
    for (int c = 0; c < parts; c++) top = partial[c * step] > top ? partial[c * step] : top;
    for (int c = 0; c < parts; c++) total += expf(partial[c * step] - top) * partial[c * step + 1];
    float inverse = 1.0f / total;
    for (int i = 0; i < dim; i += LANES) {
        vf acc = splat(0.0f);
        for (int c = 0; c < parts; c++) acc += splat(expf(partial[c * step] - top)) * load_f32(partial + c * step + 2 + i);
        if (f32) store_f32((float *)out + i, acc * inverse);
        else store_bf16((uint16_t *)out + i, acc * inverse);
    }
}

static void attend(const row_job *jobs, int rows, const uint16_t *k_cache, const uint16_t *v_cache,
                   const int32_t *table, int block_size, int kv_heads, int kv_head, int group, int dim, float scale,
                   float *work, int f32, const float *kt, int kt_lo) {
#define SHAPE(G, D, F) case F * 100000 + G * 1000 + D:                                                       \
    if (rows == 1) attend_shape(jobs, 1, 1, k_cache, v_cache, table, block_size, kv_heads, kv_head, G, D, scale, work, F, kt, kt_lo); \
    else attend_shape(jobs, rows, ROWS_AT_ONCE(G), k_cache, v_cache, table, block_size, kv_heads, kv_head, G, D, scale, work, F, kt, kt_lo); \
    return;
#define SHAPES(F) SHAPE(1, 64, F) SHAPE(2, 64, F) SHAPE(3, 64, F) SHAPE(4, 64, F) SHAPE(5, 64, F) SHAPE(6, 64, F) \
    SHAPE(7, 64, F) SHAPE(8, 64, F) SHAPE(1, 128, F) SHAPE(2, 128, F) SHAPE(3, 128, F) SHAPE(4, 128, F) SHAPE(5, 128, F) \
    SHAPE(6, 128, F) SHAPE(7, 128, F) SHAPE(8, 128, F)
    switch (!!f32 * 100000 + group * 1000 + dim) {
        SHAPES(0) SHAPES(1) SHAPE(1, 256, 1) SHAPE(2, 256, 1) SHAPE(4, 256, 1)  /* Gemma 3's heads */
        default:  /* one row at a time: R is what sizes the arrays */
            for (int r = 0; r < rows; r++) {
                if (f32) attend_shape(jobs + r, 1, 1, k_cache, v_cache, table, block_size, kv_heads, kv_head, group, dim, scale, work, 1, kt, kt_lo);
                else attend_shape(jobs + r, 1, 1, k_cache, v_cache, table, block_size, kv_heads, kv_head, group, dim, scale, work, 0, kt, kt_lo);
            }
    }
#undef SHAPES
#undef SHAPE
}

#ifdef __AMX_TILE__
/* Tiles 0, 3: scores, 16 keys x group; 1, 4: 16 keys x 32 dims; 2: 16 dim pairs x group. */
static void attention_tiles(int group) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.rows[0] = cfg.rows[3] = 16; cfg.colsb[0] = cfg.colsb[3] = group * 4;
    cfg.rows[1] = cfg.rows[4] = 16; cfg.colsb[1] = cfg.colsb[4] = 64;
    cfg.rows[2] = 16; cfg.colsb[2] = group * 4;
    _tile_loadconfig(&cfg);
}
#endif

/* silu(gate) * up, each rounded as torch rounds them; gate_up rows are [gate | up]. */
static void silu_mul(const uint16_t *gate_up, uint16_t *out, int rows, int width, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if ((long)rows * width >= 16384)
    for (int t = 0; t < rows; t++) {
        const uint16_t *gate = gate_up + (long)t * 2 * width, *up = gate + width;
        for (int i = 0; i < width; i += LANES) {
            vf g = load_bf16(gate + i);
            vf act = round_bf16(g / (1.0f + vexp(-g)));
            store_bf16(out + (long)t * width + i, act * load_bf16(up + i));
        }
    }
}

/* A linear whose output rows (of width `out`) are `parts` pieces side by side (one for a fused linear): the
 * weights at `weights[i]` in format `formats[i]`, each sizes[i] outputs wide. Stops at the first failure. */
static int linear_parts(scratch *s, const void *x, const void *const *weights, const int32_t *formats, const int *sizes,
                        int parts, const uint16_t *bias, void *y, int rows, int out, int width, int threads, int f32) {
    if (parts > 1) {  /* K-quant parts, or a decode's pairs, in one region; else part by part */
        int status = kquant_linear_parts(s, x, weights, formats, sizes, parts, bias, y, rows, width, width, out, threads, f32);
        if (status == -1)
            status = int8_linear_parts(s, x, weights, formats, sizes, parts, bias, y, rows, width, width, out, threads, f32);
        if (status != -1) return status;
    }
    for (int i = 0, at = 0; i < parts; at += sizes[i++]) {
        int status = scratch_linear(s, x, weights[i], formats[i], bias ? bias + at : NULL,
                                    (char *)y + (long)at * (f32 ? 4 : 2), rows, sizes[i], width, width, out, threads, f32);
        if (status != 0) return status;
    }
    return 0;
}

/* A prefill's rows attend to the same keys: from KT_ROWS consecutive rows of one sequence, a task takes up to
 * KT_RUN of them against one part and KV head, and transposes those keys once for all of them (attend_shape's
 * keys in lanes). AVX-512 only; with AMX, bf16 has its tiles. */
#define KT_ROWS 16
#define KT_RUN 64
static int keys_transposed(int f32) {
#if LANES != 16
    (void)f32;
    return 0;
#elif defined(__AMX_TILE__)
    return f32;
#else
    (void)f32;
    return 1;
#endif
}

typedef struct {
    int32_t row, rows, part, head; /* head -1: all the KV heads */
} attn_task;

/* Attention tasks over blocks of rows: consecutive rows of one sequence at consecutive positions, up to
 * ROWS_AT_ONCE(group) (each other row a block of its own), or a run for transposed keys (above). A block within
 * one part (up to SPLIT positions), a task per KV head; a longer one, a task per part, all its KV heads (one
 * thread then reads the part's cache blocks whole, where their heads lie side by side), each of its rows that
 * reach past one part keeping each part's partial results (dim + 2 floats a query head) for merging; a run, a
 * task per part and KV head. How the work is cut into tasks never changes what is computed for a row. The
 * tasks into plan, or only counted where plan is NULL; their number. */
static long plan_attention(const int32_t *pos, const int32_t *table_off, int rows, int kv_heads, int at_once,
                           int kt_rows, attn_task *plan) {
    long used = 0;
    for (int t = 0; t < rows;) {
        int size = 1;
        while (t + size < rows && size < KT_RUN && table_off[t + size] == table_off[t] && pos[t + size] == pos[t] + size) size++;
        const int run = size >= kt_rows;
        if (!run && size > at_once) size = at_once;
        const int parts = pos[t + size - 1] / SPLIT + 1, count = run ? parts * kv_heads : parts > 1 ? parts : kv_heads;
        for (int i = 0; plan && i < count; i++)
            plan[used + i] = run ? (attn_task){t, size, i / kv_heads, i % kv_heads}
                                 : (attn_task){t, size, parts > 1 ? i : 0, parts > 1 ? -1 : i};
        used += count;
        t += size;
    }
    return used;
}

/* hidden [rows, width] (the embeddings in, the last layer's output out) and cos/sin: bf16, rounded where
 * transformers rounds, or with `f32` fp32, every activation unrounded, the norms' weights fp32 and the cache f16
 * (see rms_norm_f32); cos/sin hold a row per position (row t reads pos[t]'s) where by_position, else one per
 * row, each dim wide; the cache holds num_blocks blocks; intermediates in s (SCRATCH_DECODER). 0 on success, -3 for a block table or position outside the cache. */
static int decoder_layers(scratch *s, void *hidden, int f32, const void *cos, const void *sin, const void *cos_local,
                          const void *sin_local, int act, int by_position,
                          const int32_t *pos, const int32_t *table_off, const int32_t *tables, int tables_len,
                          int num_blocks, int rows, const layer_weights *layers, int num_layers, int width, int heads,
                          int kv_heads, int dim, int inter, int block_size, float eps, float scale, int threads) {
    int group = heads / kv_heads, qkv_width = (heads + 2 * kv_heads) * dim;
    if (rows < 1 || rows > 512 || width % 32 || dim % 32 || dim > (f32 ? 256 : 128) || heads % kv_heads || group > 8 ||
        inter % 32 || block_size % 16 || (act && !f32))
        return -1;
    /* Every address below comes from these: a bad plan must be an error, not a write into foreign memory. */
    for (int i = 0; i < tables_len; i++)
        if (tables[i] < 0 || tables[i] >= num_blocks) return -3;
    for (int t = 0; t < rows; t++)
        if (pos[t] < 0 || table_off[t] < 0 || (long)table_off[t] + pos[t] / block_size >= tables_len) return -3;
    const int at_once = ROWS_AT_ONCE(group), kt_rows = keys_transposed(f32) ? KT_ROWS : rows + 1;
    long partial_floats = 0;
    for (int t = 0; t < rows; t++)
        if (pos[t] >= SPLIT) partial_floats += (long)(pos[t] / SPLIT + 1) * heads * (dim + 2);
    const long tasks = plan_attention(pos, table_off, rows, kv_heads, at_once, kt_rows, NULL);
    const size_t elem = f32 ? sizeof(float) : sizeof(uint16_t);
    const size_t attend_floats = (size_t)group * SPLIT * (at_once + 1);  /* attend_shape's work */
    const size_t per_thread = attend_floats + (kt_rows <= rows ? (size_t)SPLIT * dim : 0);
    const size_t counts[] = {(size_t)rows * width, (size_t)rows * width, (size_t)rows * qkv_width,
                             (size_t)rows * heads * dim, (size_t)rows * 2 * inter, (size_t)rows * inter};
    size_t need = sizeof(float) * ((size_t)threads * per_thread + partial_floats) + sizeof(attn_task) * tasks + sizeof(int32_t) * rows;
    for (int i = 0; i < 6; i++) need += (counts[i] * elem + 63) / 64 * 64;
    char *buffers[6], *next = scratch_reserve(s, SCRATCH_DECODER, need);
    if (!next) return -2;
    for (int i = 0; i < 6; i++) { buffers[i] = next; next += (counts[i] * elem + 63) / 64 * 64; }
    void *normed = buffers[0], *tmp = buffers[1], *qkv = buffers[2], *attn = buffers[3], *gate_up = buffers[4], *gated = buffers[5];
    float *work = (float *)next, *partials = work + (size_t)threads * per_thread;
    attn_task *plan = (attn_task *)(partials + partial_floats);
    int32_t *partial_at = (int32_t *)(plan + tasks);  /* a row's partials, or -1 where it lies within one part */
    plan_attention(pos, table_off, rows, kv_heads, at_once, kt_rows, plan);
    for (int t = 0, at = 0; t < rows; t++) {
        partial_at[t] = pos[t] >= SPLIT ? at : -1;
        at += pos[t] >= SPLIT ? (pos[t] / SPLIT + 1) * heads * (dim + 2) : 0;
    }
    int status;
    for (int l = 0; l < num_layers; l++) {
        const layer_weights *p = layers + l;
        if (!f32 && (p->q_norm || p->k_norm || p->attn_post_norm || p->mlp_post_norm || p->local_rope)) return -1;
        if (p->window < 0 || (p->local_rope && !cos_local)) return -1;
    }
    for (int l = 0; l < num_layers; l++) {
        const layer_weights *p = layers + l;
        uint16_t *k_cache = p->k_cache, *v_cache = p->v_cache;
        if (f32) rms_norm_f32(hidden, p->attn_norm, normed, rows, width, eps, threads);
        else rms_norm(hidden, p->attn_norm, normed, rows, width, eps, threads);
        const void *const qkv_parts[] = {p->qkv_w, p->k_w, p->v_w};
        const int32_t qkv_formats[] = {p->qkv_fmt, p->k_fmt, p->v_fmt};
        const int qkv_sizes[] = {p->k_w ? heads * dim : qkv_width, kv_heads * dim, kv_heads * dim};
        status = linear_parts(s, normed, qkv_parts, qkv_formats, qkv_sizes, p->k_w ? 3 : 1, p->qkv_b, qkv, rows,
                              qkv_width, width, threads, f32);
        if (status != 0) return status;
        #pragma omp parallel for num_threads(threads) schedule(static) if (WORTH_THREADS((long)rows * qkv_width))
        for (int t = 0; t < rows; t++) {
            const int32_t *table = tables + table_off[t];
            long slot = (long)table[pos[t] / block_size] * block_size + pos[t] % block_size, kv_width = (long)kv_heads * dim;
            const long at = (long)(by_position ? pos[t] : t) * dim;  /* its cos/sin */
            const void *cos_l = p->local_rope ? cos_local : cos, *sin_l = p->local_rope ? sin_local : sin;
            if (f32) {
                float *row = (float *)qkv + (long)t * qkv_width;
                for (int h = 0; h < heads + kv_heads; h++) {  /* q/k norms, in place, a head at a time */
                    const float *norm = h < heads ? p->q_norm : p->k_norm;
                    if (norm) norm_row_f32(row + (long)h * dim, norm, row + (long)h * dim, dim, eps);
                }
                for (int h = 0; h < heads + kv_heads; h++)
                    rotate_f32(row + (long)h * dim, (const float *)cos_l + at, (const float *)sin_l + at, dim);
                for (long i = 0; i < kv_width; i += LANES) {
                    store_f16(k_cache + slot * kv_width + i, load_f32(row + (long)heads * dim + i));
                    store_f16(v_cache + slot * kv_width + i, load_f32(row + (long)(heads + kv_heads) * dim + i));
                }
            } else {
                uint16_t *row = (uint16_t *)qkv + (long)t * qkv_width;
                for (int h = 0; h < heads + kv_heads; h++)
                    rotate(row + (long)h * dim, (const uint16_t *)cos + at, (const uint16_t *)sin + at, dim);
                memcpy(k_cache + slot * kv_width, row + (long)heads * dim, sizeof(uint16_t) * kv_width);
                memcpy(v_cache + slot * kv_width, row + (long)(heads + kv_heads) * dim, sizeof(uint16_t) * kv_width);
            }
        }
        #pragma omp parallel num_threads(threads)
        {
#ifdef __AMX_TILE__
            if (!f32) attention_tiles(group);
#endif
            float *mine = work + (size_t)omp_get_thread_num() * per_thread;
            #pragma omp for schedule(dynamic)
            for (long task = 0; task < tasks; task++) {
                const attn_task *a = plan + task;
                const int c = a->part, last = a->row + a->rows - 1;
                const int32_t *table = tables + table_off[a->row];
                for (int g = a->head < 0 ? 0 : a->head; g < (a->head < 0 ? kv_heads : a->head + 1); g++) {
                    const float *kt = NULL;
#if LANES == 16
                    if (a->rows >= kt_rows) {
                        const int end = c * SPLIT + SPLIT < pos[last] + 1 ? c * SPLIT + SPLIT : pos[last] + 1;
                        float *transposed = mine + attend_floats;
                        transpose_keys(k_cache + (long)g * dim, table, block_size, (long)kv_heads * dim, c * SPLIT, end, dim, f32, transposed);
                        kt = transposed;
                    }
#endif
                    for (int t0 = a->row; t0 <= last; t0 += at_once) {
                        row_job jobs[MOST_ROWS];
                        int count = 0;
                        for (int t = t0; t < t0 + at_once && t <= last; t++) {
                            if (pos[t] < c * SPLIT) continue;  /* this part lies past the row */
                            const int end = c * SPLIT + SPLIT < pos[t] + 1 ? c * SPLIT + SPLIT : pos[t] + 1;
                            /* A window's first position; a part wholly before it adds nothing (an empty partial). */
                            const int first = p->window && pos[t] >= p->window ? pos[t] + 1 - p->window : 0;
                            const int lo = c * SPLIT > (first & ~15) ? c * SPLIT : first & ~15;
                            float *partial = partial_at[t] < 0 ? NULL : partials + partial_at[t] + ((long)c * heads + g * group) * (dim + 2);
                            if (end <= first) {  /* only where parts > 1: the part holding pos[t] is never empty */
                                for (int h = 0; h < group; h++) {
                                    float *empty = partial + (long)h * (dim + 2);
                                    empty[0] = -INFINITY, empty[1] = 0.0f;
                                    memset(empty + 2, 0, sizeof(float) * dim);
                                }
                                continue;
                            }
                            jobs[count++] = (row_job){(const char *)qkv + ((long)t * qkv_width + (long)g * group * dim) * elem,
                                                      (char *)attn + ((long)t * heads * dim + (long)g * group * dim) * elem,
                                                      partial, lo, first, end};
                        }
                        if (count) attend(jobs, count, k_cache, v_cache, table, block_size, kv_heads, g, group, dim, scale, mine, f32, kt, c * SPLIT);
                    }
                }
            }
            #pragma omp for schedule(static)
            for (int task = 0; task < rows * heads; task++) {
                int t = task / heads, h = task % heads;
                if (partial_at[t] >= 0)
                    merge_partials(partials + partial_at[t] + (long)h * (dim + 2), (long)heads * (dim + 2), pos[t] / SPLIT + 1,
                                   dim, (char *)attn + ((long)t * heads * dim + (long)h * dim) * elem, f32);
            }
#ifdef __AMX_TILE__
            if (!f32) _tile_release();
#endif
        }
        status = scratch_linear(s, attn, p->o_w, p->o_fmt, p->o_b, tmp, rows, width, heads * dim, heads * dim, width, threads, f32);
        if (status != 0) return status;
        if (p->attn_post_norm) rms_norm_f32(tmp, p->attn_post_norm, tmp, rows, width, eps, threads);
        if (f32) add_into_f32(hidden, tmp, (long)rows * width, threads);
        else add_into(hidden, tmp, (long)rows * width, threads);
        if (f32) rms_norm_f32(hidden, p->mlp_norm, normed, rows, width, eps, threads);
        else rms_norm(hidden, p->mlp_norm, normed, rows, width, eps, threads);
        const void *const gate_up_parts[] = {p->gate_up_w, p->up_w};
        const int32_t gate_up_formats[] = {p->gate_up_fmt, p->up_fmt};
        const int gate_up_sizes[] = {p->up_w ? inter : 2 * inter, inter};
        status = linear_parts(s, normed, gate_up_parts, gate_up_formats, gate_up_sizes, p->up_w ? 2 : 1, p->gate_up_b,
                              gate_up, rows, 2 * inter, width, threads, f32);
        if (status != 0) return status;
        if (f32) act_mul_f32(gate_up, gated, rows, inter, threads, act);
        else silu_mul(gate_up, gated, rows, inter, threads);
        status = scratch_linear(s, gated, p->down_w, p->down_fmt, p->down_b, tmp, rows, width, inter, inter, width, threads, f32);
        if (status != 0) return status;
        if (p->mlp_post_norm) rms_norm_f32(tmp, p->mlp_post_norm, tmp, rows, width, eps, threads);
        if (f32) add_into_f32(hidden, tmp, (long)rows * width, threads);
        else add_into(hidden, tmp, (long)rows * width, threads);
    }
    return 0;
}

/* A calling thread's OpenMP workers, each pinned once to a core other than the one the caller runs on. The engine
 * thread ends after an idle second and the next message starts another, whose new worker the system often starts
 * on the engine thread's own core: both then shared it until the load balancer parted them, and that first step
 * ran ~10 ms longer (docs/design/kernels.md, "One OpenMP pool"). The caller is never pinned (it may be any thread,
 * and a process it starts would inherit the mask), nor anything where the team has more threads than the cores it
 * may use. */
static void place_workers(int threads) {
#if defined(__linux__)
    static __thread int placed; /* the team size this thread's workers were placed for */
    if (threads < 2 || placed == threads) return;
    placed = threads;
    const int caller = sched_getcpu();
    #pragma omp parallel num_threads(threads)
    {
        const int me = omp_get_thread_num();
        cpu_set_t allowed;
        if (me > 0 && caller >= 0 && sched_getaffinity(0, sizeof allowed, &allowed) == 0 &&
            CPU_COUNT(&allowed) >= threads && CPU_ISSET(caller, &allowed)) {
            CPU_CLR(caller, &allowed);
            for (int c = 0, seen = 0; c < CPU_SETSIZE; c++)
                if (CPU_ISSET(c, &allowed) && seen++ == me - 1) {
                    cpu_set_t one;
                    CPU_ZERO(&one);
                    CPU_SET(c, &one);
                    sched_setaffinity(0, sizeof one, &one);
                    break;
                }
        }
    }
#else
    (void)threads;
#endif
}

/* A step from its token ids, in one call (each torch op it replaces costs more in a decode step than its work,
 * as the weights just streamed through evicted the interpreter's caches); step_args (kernels.h) says what each argument
 * holds. The embedding gives hidden's rows (the step's dtype, as decoder_layers); the rows run through the layers
 * in pieces of up to 512, in order: a piece finds the K/V of those before it in the cache, as it would its own.
 * Then, with final_weight (f32 only), the final norm of the sample rows into `normed`, and with `head` their
 * logits. 0 on success; -1 for a shape the kernels do not take, -2 out of memory, -3 for a block table or
 * position outside the cache, -4 for an id or sample row out of range, -5 for arguments of another build. */
static int step(scratch *s, const step_args *a) {
    const int rows = a->rows, width = a->width, f32 = a->f32;
    const int32_t *ids = a->ints, *pos = a->ints + rows, *table_off = a->ints + 2 * (long)rows;
    if (rows < 1 || (a->emb_f32 && !f32) || width % LANES) return -1;
    for (int t = 0; t < rows; t++) {
        if (ids[t] < 0 || ids[t] >= a->vocab) return -4;
        if (a->positions > 0 && pos[t] >= a->positions) return -3;
    }
    for (int i = 0; i < a->samples; i++)
        if (a->sample_rows[i] < 0 || a->sample_rows[i] >= rows) return -4;
    for (int t = 0; t < rows; t++) {
        const long from = (long)ids[t] * width, to = (long)t * width;
        if (a->emb_f32) memcpy((float *)a->hidden + to, (const float *)a->embedding + from, sizeof(float) * width);
        else if (!f32) memcpy((uint16_t *)a->hidden + to, (const uint16_t *)a->embedding + from, sizeof(uint16_t) * width);
        else
            for (int i = 0; i < width; i += LANES)
                store_f32((float *)a->hidden + to + i, load_bf16((const uint16_t *)a->embedding + from + i));
    }
    const size_t elem = f32 ? sizeof(float) : sizeof(uint16_t);
    place_workers(a->threads);
    for (int at = 0; at < rows; at += 512) {
        const int n = rows - at < 512 ? rows - at : 512;
        const long skip = a->positions > 0 ? 0 : (long)at * a->dim;
        const char *cos_local = a->cos_local ? (const char *)a->cos_local + skip * elem : NULL;
        const char *sin_local = a->sin_local ? (const char *)a->sin_local + skip * elem : NULL;
        int status = decoder_layers(s, (char *)a->hidden + (long)at * width * elem, f32, (const char *)a->cos + skip * elem,
                                    (const char *)a->sin + skip * elem, cos_local, sin_local, a->act, a->positions > 0, pos + at, table_off + at,
                                    a->tables, a->tables_len, a->num_blocks, n, a->layers, a->num_layers, width, a->heads,
                                    a->kv_heads, a->dim, a->inter, a->block_size, a->eps, a->scale, a->threads);
        if (status != 0) return status;
    }
    if (!a->final_weight || !f32) return 0;
    for (int i = 0; i < a->samples; i++)
        norm_row_f32((const float *)a->hidden + (long)a->sample_rows[i] * width, a->final_weight,
                     a->normed + (long)i * width, width, a->final_eps);
    if (!a->head || a->samples < 1) return 0;
    for (int at = 0; at < a->samples; at += 512) { /* the lm_head: logits [samples, vocab_out], fp32 */
        const int n = a->samples - at < 512 ? a->samples - at : 512;
        int status = scratch_linear(s, a->normed + (long)at * width, a->head, a->head_format, a->head_bias,
                                    a->logits + (long)at * a->vocab_out, n, a->vocab_out, width, width, a->vocab_out,
                                    a->threads, 1);
        if (status != 0) return status;
    }
    return 0;
}

int decoder_step(const step_args *a) {
    if (a->size != sizeof(step_args) || a->version != STEP_ARGS_VERSION) return -5;
    scratch *s = scratch_take();
    if (!s) return -2;
    int status = step(s, a);
    scratch_give(s);
    return status;
}

/* Both structs' layouts as "struct size: field offset, ..." for native.py to compare with its ctypes mirror (an
 * unknown field name here fails the build; a field missing here changes the size). */
typedef struct { const char *name; size_t at; } field;
#define AT(type, f) {#f, offsetof(type, f)}
static const field layer_fields[] = {
    AT(layer_weights, attn_norm), AT(layer_weights, qkv_w), AT(layer_weights, k_w), AT(layer_weights, v_w),
    AT(layer_weights, q_norm), AT(layer_weights, k_norm), AT(layer_weights, attn_post_norm),
    AT(layer_weights, mlp_post_norm), AT(layer_weights, qkv_b), AT(layer_weights, o_w), AT(layer_weights, o_b), AT(layer_weights, mlp_norm),
    AT(layer_weights, gate_up_w), AT(layer_weights, up_w), AT(layer_weights, gate_up_b), AT(layer_weights, down_w),
    AT(layer_weights, down_b), AT(layer_weights, k_cache), AT(layer_weights, v_cache), AT(layer_weights, qkv_fmt),
    AT(layer_weights, k_fmt), AT(layer_weights, v_fmt), AT(layer_weights, o_fmt), AT(layer_weights, gate_up_fmt),
    AT(layer_weights, up_fmt), AT(layer_weights, down_fmt), AT(layer_weights, window), AT(layer_weights, local_rope)};
static const field step_fields[] = {
    AT(step_args, size), AT(step_args, version), AT(step_args, hidden), AT(step_args, ints), AT(step_args, tables),
    AT(step_args, embedding), AT(step_args, cos), AT(step_args, sin), AT(step_args, cos_local), AT(step_args, sin_local),
    AT(step_args, sample_rows),
    AT(step_args, final_weight), AT(step_args, normed), AT(step_args, head), AT(step_args, head_bias),
    AT(step_args, logits), AT(step_args, layers), AT(step_args, f32), AT(step_args, rows), AT(step_args, tables_len),
    AT(step_args, num_blocks), AT(step_args, emb_f32), AT(step_args, vocab), AT(step_args, positions),
    AT(step_args, samples), AT(step_args, head_format), AT(step_args, vocab_out), AT(step_args, num_layers),
    AT(step_args, width), AT(step_args, heads), AT(step_args, kv_heads), AT(step_args, dim), AT(step_args, inter),
    AT(step_args, block_size), AT(step_args, threads), AT(step_args, act), AT(step_args, final_eps), AT(step_args, eps), AT(step_args, scale)};

static int describe(char *out, size_t room, const char *name, size_t size, const field *fields, size_t count) {
    int used = snprintf(out, room, "%s %zu:", name, size);
    for (size_t i = 0; i < count && used > 0 && (size_t)used < room; i++)
        used += snprintf(out + used, room - used, " %s %zu", fields[i].name, fields[i].at);
    return used;
}

const char *kernel_abi(void) {
    static char text[2048];
    int used = describe(text, sizeof text, "layer_weights", sizeof(layer_weights), layer_fields,
                        sizeof layer_fields / sizeof *layer_fields);
    describe(text + used, sizeof text - used, "; step_args", sizeof(step_args), step_fields,
             sizeof step_fields / sizeof *step_fields);
    return text;
}
