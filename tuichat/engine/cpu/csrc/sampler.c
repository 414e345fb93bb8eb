/* One sampled row's token, the draw sampler.py's numpy path makes, in a few passes over the row.
 *
 * Why C: each numpy step over a 49k-entry row is a separate pass, and right after a decode step has streamed
 * the weights through the caches those passes are cold, and the numpy draw took a sizeable share of a step
 * (docs/design/kernels.md). Here the row is copied, penalized, scanned for its maximum and turned into
 * weights with their sum in three passes (the penalties applied from the reply's ids as they come: no sort of
 * them); the nucleus is sorted from the tokens above a floor, as in numpy (by radix when it is large). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

/* exp(x) for x <= 0: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts), e^r by Cephes' expf polynomial,
 * times 2^n built in the exponent bits; 0 below float's normal range. Plain C, so that the loop over a row
 * vectorizes for whatever -march the library is built for. */
static inline float exp_nonpositive(float x) {
    const float t = x * 1.44269504088896341f;
    const float n = (t + 12582912.0f) - 12582912.0f; /* t rounded to the nearest integer (1.5 * 2^23) */
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale = { .i = ((int32_t)n + 127) * (1 << 23) };
    return x < -87.0f ? 0.0f : p * scale.f;
}

typedef struct { float weight; int id; } candidate;

/* Likeliest first; ties by id, as sampler.py's stable sort of ascending ids. */
static int likelier(const void *a, const void *b) {
    const candidate *x = a, *y = b;
    if (x->weight != y->weight) return x->weight > y->weight ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

/* kept[0, size), gathered in ascending id order, sorted likeliest first with ties by id, in kept or in spare (the
 * one returned). A large nucleus (a flat row: high temperature, or a random-weight model) is sorted by a stable LSD
 * radix sort on the weights' bits, which order as the weights do for floats >= 0: qsort of such a nucleus cost
 * more than a small model's decode step (docs/design/sampling.md). */
#define RADIX_MIN 2048
static candidate *by_weight(candidate *kept, candidate *spare, int size) {
    if (size < RADIX_MIN) {
        qsort(kept, (size_t)size, sizeof(candidate), likelier);
        return kept;
    }
    for (int shift = 0; shift < 32; shift += 8) {
        int start[256] = {0};
        uint32_t bits;
        for (int i = 0; i < size; i++) {
            memcpy(&bits, &kept[i].weight, 4);
            start[(~bits >> shift) & 255]++; /* ~: the largest weight first */
        }
        memcpy(&bits, &kept[0].weight, 4);
        if (start[(~bits >> shift) & 255] == size) continue; /* one digit for all: this pass keeps the order */
        for (int d = 0, at = 0; d < 256; d++) {
            const int count = start[d];
            start[d] = at;
            at += count;
        }
        for (int i = 0; i < size; i++) {
            memcpy(&bits, &kept[i].weight, 4);
            spare[start[(~bits >> shift) & 255]++] = kept[i];
        }
        candidate *t = kept;
        kept = spare;
        spare = t;
    }
    return kept;
}

#define BLOCK 1024 /* sampler.py's _BLOCK: weights summed in float per block, the blocks in double */

/* A row's working arrays, in one SCRATCH_SAMPLER region: weights, candidates (and as many spare, for the radix
 * sort), block sums, marks. */
typedef struct {
    float *weights;
    candidate *candidates, *spare;
    double *blocks;
    unsigned char *seen; /* all clear between calls: each call clears the marks it set */
} row_scratch;

static int reserve(scratch *s, int n, row_scratch *r) {
    const size_t weights = sizeof(float) * (size_t)n, candidates = sizeof(candidate) * (size_t)n;
    const size_t blocks = sizeof(double) * (size_t)(n / BLOCK + 1);
    char *memory = scratch_reserve(s, SCRATCH_SAMPLER, blocks + 2 * candidates + weights + (size_t)n);
    if (!memory) return -1;
    r->blocks = (double *)memory; /* the widest alignment first */
    r->candidates = (candidate *)(memory + blocks);
    r->spare = (candidate *)(memory + blocks + candidates);
    r->weights = (float *)(memory + blocks + 2 * candidates);
    r->seen = (unsigned char *)(memory + blocks + 2 * candidates + weights);
    return 0;
}

/* The first index of w[0, n) whose running sum passes target (the last if none does). */
static int passing(const float *w, int n, double target) {
    double running = 0.0;
    for (int i = 0; i < n; i++)
        if ((running += w[i]) > target) return i;
    return n - 1;
}

/* The token of a row drawn with uniform u in [0, 1), as sampler.py's numpy path draws it: the logits less
 * frequency times each token's count in `reply` and presence once for each token it holds (OpenAI's
 * penalties; ids past the row are not the model's and are skipped), then temperature, top_k (0: off) and top_p
 * (1: off). -1 when out of memory. */
static int draw(row_scratch scratch, const float *logits, int n, const int64_t *reply, int replied, float frequency,
                float presence, float temperature, float top_p, int top_k, double u) {
    float *w = scratch.weights;
    memcpy(w, logits, sizeof(float) * (size_t)n);
    if (frequency != 0.0f || presence != 0.0f) {
        for (int j = 0; j < replied; j++) {
            const int64_t t = reply[j];
            if (t < 0 || t >= n) continue;
            w[t] -= frequency + (scratch.seen[t] ? 0.0f : presence);
            scratch.seen[t] = 1;
        }
        for (int j = 0; j < replied; j++)
            if (reply[j] >= 0 && reply[j] < n) scratch.seen[reply[j]] = 0;
    }
    float top = w[0];
    #pragma omp simd reduction(max : top)
    for (int i = 0; i < n; i++) top = w[i] > top ? w[i] : top;
    const float inverse = 1.0f / temperature;
    const int blocks = (n + BLOCK - 1) / BLOCK;
    double total = 0.0;
    for (int b = 0; b < blocks; b++) {
        const int end = (b + 1) * BLOCK < n ? (b + 1) * BLOCK : n;
        float sum = 0.0f;
        #pragma omp simd reduction(+ : sum)
        for (int i = b * BLOCK; i < end; i++) {
            const float v = exp_nonpositive((w[i] - top) * inverse);
            w[i] = v;
            sum += v;
        }
        total += (scratch.blocks[b] = sum);
    }
    if (top_k <= 0 || top_k >= n) top_k = 0;
    if (!top_k && top_p >= 1.0f) { /* every token: the one whose share of the running mass holds u */
        double target = u * total;
        int b = 0;
        while (b < blocks - 1 && target >= scratch.blocks[b]) target -= scratch.blocks[b++];
        const int start = b * BLOCK, end = start + BLOCK < n ? start + BLOCK : n;
        return start + passing(w + start, end - start, target);
    }
    /* Candidates: the tokens at or above a floor (relative to the likeliest, 1), which come first in any
     * descending order; once they are top_k many, or hold top_p of the mass, the answer is among them. */
    static const float floors[] = {1e-3f, 1e-6f, 1e-9f, 0.0f}; /* sampler.py's _FLOORS, then every token */
    candidate *kept = scratch.candidates;
    int size = 0;
    for (int f = 0; f < 4; f++) {
        const float floor = floors[f];
        int count = 0;
        #pragma omp simd reduction(+ : count)
        for (int i = 0; i < n; i++) count += w[i] >= floor;
        if (count < top_k && f < 3) continue;
        size = 0;
        double mass = 0.0;
        for (int i = 0; i < n; i++)
            if (w[i] >= floor) {
                kept[size++] = (candidate){w[i], i};
                mass += w[i];
            }
        if (top_k || mass >= top_p * total || f == 3) break;
    }
    kept = by_weight(kept, scratch.spare, size);
    if (top_k) {
        size = size < top_k ? size : top_k;
        total = 0.0; /* top_p then applies to what top_k kept, renormalized */
        for (int i = 0; i < size; i++) total += kept[i].weight;
    }
    if (top_p < 1.0f) { /* each token stays while the mass before it is under top_p: the one crossing it too */
        double before = 0.0;
        int keep = 0;
        while (keep < size && before < top_p * total) before += kept[keep++].weight;
        size = keep > 0 ? keep : 1;
    }
    double mass = 0.0;
    for (int i = 0; i < size; i++) mass += kept[i].weight;
    const double target = u * mass;
    double running = 0.0;
    for (int i = 0; i < size; i++)
        if ((running += kept[i].weight) > target) return kept[i].id;
    return kept[size - 1].id;
}

int sample_row(const float *logits, int n, const int64_t *reply, int replied, float frequency, float presence,
               float temperature, float top_p, int top_k, double u) {
    scratch *s = scratch_take();
    row_scratch r;
    int token = s && reserve(s, n, &r) == 0 ? draw(r, logits, n, reply, replied, frequency, presence, temperature,
                                                   top_p, top_k, u) : -1;
    scratch_give(s);
    return token;
}
