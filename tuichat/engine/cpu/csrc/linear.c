/* The linear for any weight format, the one the decoder and Python call, and which instructions it uses. */
#include <stdlib.h>

#include "linear.h"

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
