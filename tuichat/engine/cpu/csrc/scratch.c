/* Scratch memory for the kernels' intermediates, owned by the library instead of by the thread that calls.
 *
 * Why: a step's intermediates grow with its rows, and allocating them per call costs page faults every step, so
 * they are kept between calls. Kept per thread (__thread), they were lost with each engine thread that ended
 * for idleness, and every message after an idle second leaked a step's worth. Here a call takes a scratch from
 * the library's pool and gives it back: any later call, on any thread, reuses it, and kernels_trim() frees what
 * no call holds (the engine calls it when a model closes). Concurrent callers each get their own scratch. */
#include <pthread.h>
#include <stdlib.h>

#include "kernels.h"

struct scratch {
    struct scratch *next;
    void *memory[SCRATCH_USES];
    size_t size[SCRATCH_USES];
};

static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static scratch *idle; /* the scratches no call holds */

scratch *scratch_take(void) {
    pthread_mutex_lock(&pool_lock);
    scratch *s = idle;
    if (s) idle = s->next;
    pthread_mutex_unlock(&pool_lock);
    return s ? s : calloc(1, sizeof *s);
}

void scratch_give(scratch *s) {
    if (!s) return;
    pthread_mutex_lock(&pool_lock);
    s->next = idle;
    idle = s;
    pthread_mutex_unlock(&pool_lock);
}

void *scratch_reserve(scratch *s, int use, size_t need) {
    if (need <= s->size[use]) return s->memory[use];
    free(s->memory[use]);
    s->memory[use] = calloc(need, 1); /* zeroed: the sampler's marks start clear (and a fresh mapping costs no more) */
    s->size[use] = s->memory[use] ? need : 0;
    return s->memory[use];
}

long kernels_scratch_bytes(void) {
    long bytes = 0;
    pthread_mutex_lock(&pool_lock);
    for (scratch *s = idle; s; s = s->next)
        for (int i = 0; i < SCRATCH_USES; i++) bytes += (long)s->size[i];
    pthread_mutex_unlock(&pool_lock);
    return bytes;
}

long kernels_trim(void) {
    pthread_mutex_lock(&pool_lock);
    scratch *s = idle;
    idle = NULL;
    pthread_mutex_unlock(&pool_lock);
    long freed = 0;
    while (s) {
        scratch *next = s->next;
        for (int i = 0; i < SCRATCH_USES; i++) {
            freed += (long)s->size[i];
            free(s->memory[i]);
        }
        free(s);
        s = next;
    }
    return freed;
}
