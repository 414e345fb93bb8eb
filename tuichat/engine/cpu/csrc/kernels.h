/* What every file of the library shares: bf16 conversions and vector math written with GCC vector extensions,
 * so the same source compiles to AVX-512, AVX2 or NEON for the CPU it is built on (build.py builds on first
 * use, on the machine that runs it), and the declarations below. Within one build every row takes the
 * same instructions in the same order, which is what keeps a reply independent of its batch. */
#pragma once
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
typedef float vf __attribute__((vector_size(LANES * 4)));
typedef uint32_t vu __attribute__((vector_size(LANES * 4)));
typedef int32_t vi __attribute__((vector_size(LANES * 4)));
typedef uint16_t vh __attribute__((vector_size(LANES * 2)));

/* x in every lane, by one broadcast: x - 0 is x for every x, so the compiler drops it ((vf){} + x cost an add
 * first, as 0 + -0 is +0; a loop over the lanes became inserts in places). */
static inline vf splat(float x) { return x - (vf){}; }

/* mask ? a : b, lane by lane (C has no vector ?:). */
static inline vf pick(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* LANES bf16 values widened to fp32 (exact). */
static inline vf load_bf16(const uint16_t *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
}

static inline vf load_f32(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store_f32(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* fp32 to bf16, rounding to nearest even as torch does; NaN stays NaN. */
static inline vh to_bf16(vf f) {
    vu u = (vu)f;
    vu rounded = (u + 0x7fff + ((u >> 16) & 1)) >> 16;
    vu nan = (vu)((u & 0x7fffffff) > 0x7f800000);
    return __builtin_convertvector((rounded & ~nan) | (((u >> 16) | 0x40) & nan), vh);
}

static inline void store_bf16(uint16_t *p, vf f) {
    vh h = to_bf16(f);
    memcpy(p, &h, sizeof h);
}

/* LANES IEEE halves to fp32 (exact) and back (nearest even): the KV cache of the quantized path, which keeps
 * llama.cpp's f16 cache (3 more mantissa bits than bf16: measurably closer to float32's replies). */
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
static inline vf load_f16(const uint16_t *p) {
#if defined(__AVX512F__)
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__)
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    typedef _Float16 vhf __attribute__((vector_size(LANES * 2)));
    vhf h;
    memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, vf);
#endif
}

static inline void store_f16(uint16_t *p, vf f) {
#if defined(__AVX512F__)
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph((__m512)f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__F16C__)
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph((__m256)f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
    typedef _Float16 vhf __attribute__((vector_size(LANES * 2)));
    vhf h = __builtin_convertvector(f, vhf);
    memcpy(p, &h, sizeof h);
#endif
}

/* What torch does after each bf16 op: round the fp32 result to bf16. */
static inline vf round_bf16(vf f) { return (vf)(__builtin_convertvector(to_bf16(f), vu) << 16); }

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* The sum of one vector's lanes, by halving: a fixed order, in ~log2(LANES) steps instead of LANES. */
typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));
static inline float hsum(vf v) {
#if LANES == 16
    vf8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    vf8 h = v;
#endif
    return h[0] + h[4] + (h[1] + h[5]) + (h[2] + h[6] + (h[3] + h[7]));
}

/* The lane sums of LANES vectors at once (lane j: the sum of v[j]) by a transposing tree: ~3 operations per sum
 * where a lone hsum costs ~10. Every v[j] is summed in the same order, whatever its index. */
static inline vf sum_each(const vf *v) {
#if LANES == 16
    vf a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29) +
               __builtin_shufflevector(v[2 * i], v[2 * i + 1], 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31);
    for (int i = 0; i < 4; i++)
        b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    for (int i = 0; i < 2; i++)
        c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    return __builtin_shufflevector(c[0], c[1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(c[0], c[1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
#else
    vf a[4], b[2];
    for (int i = 0; i < 4; i++)
        a[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 8, 1, 9, 4, 12, 5, 13) +
               __builtin_shufflevector(v[2 * i], v[2 * i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    for (int i = 0; i < 2; i++)
        b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(b[0], b[1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(b[0], b[1], 4, 5, 6, 7, 12, 13, 14, 15);
#endif
}

/* The largest lane, by a halving tree (a max is exact: any order gives the same). */
static inline float hmax(vf v) {
#if LANES == 16
    vf8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7), l = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    h = (vf8)(((vi8)h & (h > l)) | ((vi8)l & ~(h > l)));
#else
    vf8 h = v;
#endif
    float m[4];
    for (int i = 0; i < 4; i++) m[i] = h[i] > h[i + 4] ? h[i] : h[i + 4];
    float a = m[0] > m[1] ? m[0] : m[1], b = m[2] > m[3] ? m[2] : m[3];
    return a > b ? a : b;
}

/* e^x within ~2 ulp for x in [-87.3, 0] (clamped below): 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2. */
static inline vf vexp_clamped_below(vf x) {
    x = pick(x < -87.3f, splat(-87.3f), x);
    vf n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;  /* round to nearest: 1.5 * 2^23 drops the fraction */
    vf r = x - n * 0.693145752f;
    r = r - n * 1.42860677e-6f;
    vf p = splat(1.0f / 5040);
    p = p * r + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return p * (vf)((__builtin_convertvector(n, vi) + 127) << 23);
}

/* e^x within ~2 ulp for x in [-87.3, 88.7] (clamped there). */
static inline vf vexp(vf x) { return vexp_clamped_below(pick(x > 88.7f, splat(88.7f), x)); }

#ifdef __AMX_TILE__
#include <immintrin.h>

/* 0, s, 2s, ... 15s: the offsets of one column of a row-major block with s columns. */
static inline __m512i column_offsets(int s) {
    return _mm512_mullo_epi32(_mm512_set1_epi32(s), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;
#endif

/* Every function one file of the library defines for another or exports to Python, declared once here and
 * included by every file, so that a signature changed on one side fails the build instead of a call. */

/* scratch.c: the intermediates' memory, a pool the library owns (see there). A call takes one, reserves what
 * each use needs (kept between calls, grown when short), and gives it back. */
typedef struct scratch scratch;
enum { SCRATCH_DECODER, SCRATCH_LINEAR, SCRATCH_SAMPLER, SCRATCH_USES };
scratch *scratch_take(void);                                 /* NULL: out of memory */
void scratch_give(scratch *s);
void *scratch_reserve(scratch *s, int use, size_t need);     /* zeroed when new; NULL: out of memory */
long kernels_trim(void);                                     /* frees what no call holds; bytes freed */
long kernels_scratch_bytes(void);                            /* bytes the pool holds now */

/* The linears (linear*.c, pack.c, arch/; what they share among themselves is in linear.h). 0 on success; -1 a
 * shape or format they do not take, -2 out of memory. */
int amx_enable(void);
int amx_linear(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int M, int N, int K,
               long x_stride, long y_stride, int threads);
int cpu_linear(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int M, int N, int K,
               long x_stride, long y_stride, int threads);
int any_linear(const void *x, const void *w, int format, const uint16_t *bias, void *y, int M, int N, int K,
               long x_stride, long y_stride, int threads, int f32);
int scratch_linear(scratch *s, const void *x, const void *w, int format, const uint16_t *bias, void *y, int M, int N,
                   int K, long x_stride, long y_stride, int threads, int f32);
/* Several K-quant weights of one input width side by side in one region (linear_kquant.c); -1: part by part. */
int kquant_linear_parts(scratch *s, const void *x, const void *const *weights, const int32_t *formats,
                        const int *sizes, int parts, const uint16_t *bias, void *y, int M, int K, long x_stride,
                        long y_stride, int threads, int f32);
/* The same for the AVX2 pairs' formats (arch/x86/linear_int8.c), up to 4 rows; -1: part by part. */
int int8_linear_parts(scratch *s, const void *x, const void *const *weights, const int32_t *formats, const int *sizes,
                      int parts, const uint16_t *bias, void *y, int M, int K, long x_stride, long y_stride, int threads,
                      int f32);
const char *quant_math(int format, int K);
const char *pack_layout(int format, int K);
int pack_blocks(const uint8_t *src, int format, int N, int K, uint8_t *dst);
int recut_5bit(const uint8_t *src, int qtype, long blocks, uint8_t *dst);
const char *kernel_isa(void);

/* sampler.c */
int sample_row(const float *logits, int n, const int64_t *reply, int replied, float frequency, float presence,
               float temperature, float top_p, int top_k, double u);

/* decoder.c: a layer's weights and cache, and a step's arguments, as structs native.py mirrors with ctypes.
 * kernel_abi() spells out both layouts (field names and offsets), which native.py compares with its own before
 * the first call, and decoder_step refuses a step_args whose size or version is not this build's. */
#define STEP_ARGS_VERSION 3

/* A layer: q/k/v and gate/up are one linear each (qkv_w, gate_up_w), or, where their parts' weights differ in
 * format (a K-quant mix gives v more bits than q and k), parts: qkv_w then q alone, with k_w and v_w; gate_up_w
 * gate alone, with up_w. The fused biases serve either way; a missing bias or part is NULL. The rest are for
 * fp32 steps only. q_norm and k_norm (Qwen3, Gemma 3): each query and key head RMS-normed over its dim with these
 * weights before RoPE; attn_post_norm and mlp_post_norm (Gemma 3): the attention's and the MLP's outputs
 * RMS-normed before their residual adds. window > 0: a row at position p sees positions (p - window, p] only
 * (a sliding-window layer); local_rope: its RoPE from step_args' cos_local/sin_local. */
typedef struct {
    const void *attn_norm, *qkv_w, *k_w, *v_w;
    const float *q_norm, *k_norm, *attn_post_norm, *mlp_post_norm;
    const uint16_t *qkv_b;
    const void *o_w;
    const uint16_t *o_b;
    const void *mlp_norm, *gate_up_w, *up_w;
    const uint16_t *gate_up_b;
    const void *down_w;
    const uint16_t *down_b;
    uint16_t *k_cache, *v_cache;
    int32_t qkv_fmt, k_fmt, v_fmt, o_fmt, gate_up_fmt, up_fmt, down_fmt, window, local_rope;
} layer_weights;

typedef struct {
    uint32_t size, version;       /* sizeof(step_args), STEP_ARGS_VERSION */
    void *hidden;                 /* [rows, width], the step's dtype: bf16, or fp32 with f32 */
    const int32_t *ints;          /* the rows' ids, then their positions, then where each row's table starts */
    const int32_t *tables;        /* the block tables, tables_len ints, each < num_blocks */
    const void *embedding;        /* [vocab, width], fp32 where emb_f32, else bf16 */
    const void *cos, *sin;        /* [positions, dim] tables by position, or (positions 0) a row each */
    const void *cos_local, *sin_local;  /* the same for layers with local_rope, or NULL */
    const int32_t *sample_rows;   /* the rows whose logits are wanted, samples of them */
    const float *final_weight;    /* f32 only: the final norm's weight, or NULL */
    float *normed;                /* [samples, width]: the final norm's output */
    const void *head;             /* the lm_head (any_linear's formats, vocab_out rows), or NULL */
    const uint16_t *head_bias;
    float *logits;                /* [samples, vocab_out] */
    const layer_weights *layers;  /* num_layers of them */
    int32_t f32, rows, tables_len, num_blocks, emb_f32, vocab, positions, samples, head_format, vocab_out;
    int32_t num_layers, width, heads, kv_heads, dim, inter, block_size, threads;
    int32_t act;                  /* the MLP's gate: 0 SiLU, 1 GELU (tanh approximation; fp32 steps only) */
    float final_eps, eps, scale;
} step_args;

int decoder_step(const step_args *a);
const char *kernel_abi(void);
