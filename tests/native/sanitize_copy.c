/*
 * sanitize_copy.c: the C copy library under AddressSanitizer and UBSan, without Python.
 *
 * Built and run by tests/native/test_native_sanitize.py with -fsanitize=address,undefined:
 * every region is its own malloc of exactly its extent, so a single byte read or written
 * outside what was validated is reported by ASan and aborts the run. It drives
 *   1. random valid tables (checked byte for byte against memmove),
 *   2. the same tables with one field pushed to an edge (must fail and change nothing),
 *   3. a thread that flips a descriptor's size and row between valid and out of range while
 *      the main thread copies (a library that read a field twice would copy out of bounds),
 *   4. long tables over fake regions far apart (the overlap sort's wide-key path).
 * Exit status 0 and the line "sanitize ok" mean every check held.
 */
#include "kvcore_copy.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ROWS 512
#define ROW 192
#define MAX_N 2048

static uint64_t rng_state = 88172645463325252ull;

static uint64_t rnd(uint64_t bound)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return bound ? rng_state % bound : 0;
}

static void fail(const char *what, int status)
{
    fprintf(stderr, "sanitize FAILED: %s (status %d: %s)\n", what, status,
            kvc_status_text(status));
    exit(1);
}

/* A valid table: n descriptors from region 0 into distinct rows of region 1. */
static void valid_table(kvc_desc *d, uint64_t n)
{
    uint64_t perm[ROWS];
    for (uint64_t i = 0; i < ROWS; i++) {
        perm[i] = i;
    }
    for (uint64_t i = ROWS - 1; i > 0; i--) {
        uint64_t j = rnd(i + 1), t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    for (uint64_t i = 0; i < n; i++) {
        int64_t size = (int64_t)(1 + rnd(ROW));
        d[i] = (kvc_desc){0, (int64_t)rnd(ROWS), (int64_t)rnd(ROW - (uint64_t)size + 1), 1,
                          (int64_t)perm[i], (int64_t)rnd(ROW - (uint64_t)size + 1), size};
    }
}

/* What a table must leave in the destination region, computed with memmove. */
static void expected(const kvc_desc *d, uint64_t n, const unsigned char *src,
                     const unsigned char *dst, unsigned char *out)
{
    memcpy(out, dst, ROWS * ROW);
    for (uint64_t i = 0; i < n; i++) {
        memmove(out + d[i].dst_row * ROW + d[i].dst_offset_bytes,
                src + d[i].src_row * ROW + d[i].src_offset_bytes, (size_t)d[i].size_bytes);
    }
}

static void round_trips(const kvc_region *r, unsigned char *src, unsigned char *dst)
{
    static kvc_desc d[ROWS];
    static unsigned char expect[ROWS * ROW], before[ROWS * ROW];
    kvc_error err;
    for (int round = 0; round < 300; round++) {
        uint64_t n = 1 + rnd(ROWS);
        valid_table(d, n);
        expected(d, n, src, dst, expect);
        int status = kvc_copy(r, 2, d, n, rnd(3) == 0 ? KVC_COPY_PLAIN : 0, &err);
        if (status != KVC_OK || memcmp(expect, dst, sizeof(expect)) != 0) {
            fail("valid table", status);
        }
        /* One field pushed to an edge: refused with nothing changed, or (if it stayed in
         * range) copied exactly. */
        static const int64_t edges[] = {-1, ROWS, ROW + 1, INT64_MAX, INT64_MIN, 1 << 20};
        uint64_t at = rnd(n), field = rnd(7);
        ((int64_t *)&d[at])[field] = edges[rnd(6)];
        memcpy(before, dst, sizeof(before));
        status = kvc_copy(r, 2, d, n, 0, &err);
        if (status == KVC_OK) {
            expected(d, n, src, before, expect);
        }
        if (memcmp(status == KVC_OK ? expect : before, dst, sizeof(before)) != 0) {
            fail("hostile table: wrong bytes", status);
        }
    }
}

typedef struct flipper {
    kvc_desc *d;
    volatile int stop;
} flipper;

static void *flip(void *arg)
{
    flipper *f = (flipper *)arg;
    volatile int64_t *size = &f->d[ROWS - 1].size_bytes, *row = &f->d[ROWS - 1].src_row;
    while (!f->stop) {
        *size = 1 << 20;
        *row = 1 << 30;
        *size = ROW;
        *row = 0;
    }
    return NULL;
}

static void concurrent_rewrites(const kvc_region *r, unsigned char *dst)
{
    static kvc_desc d[ROWS];
    for (uint64_t i = 0; i < ROWS; i++) {
        d[i] = (kvc_desc){0, (int64_t)i, 0, 1, (int64_t)(ROWS - 1 - i), 0, ROW};
    }
    flipper f = {d, 0};
    pthread_t t;
    if (pthread_create(&t, NULL, flip, &f) != 0) {
        fail("pthread_create", 0);
    }
    kvc_error err;
    int refused = 0;
    for (int i = 0; i < 3000; i++) {
        memset(dst, 0, ROWS * ROW);
        int status = kvc_copy(r, 2, d, ROWS, 0, &err);
        if (status != KVC_OK) {
            refused++;
            for (size_t k = 0; k < ROWS * ROW; k++) {
                if (dst[k] != 0) {
                    fail("a refused call copied bytes", status);
                }
            }
        }
    }
    f.stop = 1;
    pthread_join(t, NULL);
    printf("concurrent rewrites: %d of 3000 calls refused\n", refused);
}

static void wide_keys(void)
{
    static kvc_desc d[MAX_N];
    kvc_region r[3] = {{1u << 12, ROWS * 64, 64, 64, ROWS, 0},
                       {1u << 20, 1024ull << 44, 1ull << 44, 64, 1024, 0},
                       {1ull << 62, 1024 * 64, 64, 64, 1024, 0}};
    for (uint64_t i = 0; i < MAX_N; i++) {
        uint64_t slot = (i * 1237) % MAX_N; /* a permutation of 0..2047 */
        d[i] = (kvc_desc){0, (int64_t)rnd(ROWS), 0, 1 + (int64_t)(slot / 1024),
                          (int64_t)(slot % 1024), 0, 64};
    }
    kvc_error err;
    int status = kvc_validate(r, 3, d, MAX_N, &err);
    if (status != KVC_OK) {
        fail("wide keys: valid table refused", status);
    }
    d[MAX_N - 1].dst_region = d[5].dst_region;
    d[MAX_N - 1].dst_row = d[5].dst_row;
    status = kvc_validate(r, 3, d, MAX_N, &err);
    if (status != KVC_E_DST_OVERLAP || err.index != MAX_N - 1 || err.value != 5) {
        fail("wide keys: duplicate destination not found", status);
    }
}

int main(void)
{
    unsigned char *src = malloc(ROWS * ROW), *dst = malloc(ROWS * ROW);
    if (src == NULL || dst == NULL) {
        fail("malloc", 0);
    }
    for (size_t i = 0; i < ROWS * ROW; i++) {
        src[i] = (unsigned char)rnd(256);
        dst[i] = (unsigned char)rnd(256);
    }
    kvc_region r[2] = {{(uint64_t)(uintptr_t)src, ROWS * ROW, ROW, ROW, ROWS, 0},
                       {(uint64_t)(uintptr_t)dst, ROWS * ROW, ROW, ROW, ROWS, 0}};
    round_trips(r, src, dst);
    concurrent_rewrites(r, dst);
    wide_keys();
    free(src);
    free(dst);
    printf("sanitize ok\n");
    return 0;
}
