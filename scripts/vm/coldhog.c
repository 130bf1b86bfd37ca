/* A job with a cold part, for the VM test's fronts: allocates MIB MiB and
 * fills every page with a pattern of its own; the first COLD % of the pages
 * are then left alone while the rest are rewritten (one word per page, the
 * same each pass, so the data stays known) for SECS seconds; finally every
 * page is checked. Prints "OK <passes>" or "BAD page N". Static, so it runs
 * in a bare initramfs. Usage: coldhog MIB COLD SECS */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>

static uint64_t want(size_t i) { return (i / 512) * 0x9E3779B97F4A7C15ull + (i % 512 < 64 ? i : 0); }

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? strtoul(argv[1], NULL, 10) : 150;
    size_t cold = argc > 2 ? strtoul(argv[2], NULL, 10) : 75;
    long secs = argc > 3 ? strtol(argv[3], NULL, 10) : 10;
    size_t words = mib << 17; /* 8-byte words */
    uint64_t *p = mmap(NULL, words * 8, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) { perror("mmap"); return 2; }
    for (size_t i = 0; i < words; i++) p[i] = want(i);
    size_t first_hot = words / 100 * cold / 512 * 512;
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    long passes = 0;
    do {
        for (size_t i = first_hot; i < words; i += 512) p[i] = want(i);
        passes++;
        clock_gettime(CLOCK_MONOTONIC, &t);
    } while (t.tv_sec - t0.tv_sec < secs);
    for (size_t i = 0; i < words; i++)
        if (p[i] != want(i)) { printf("BAD page %zu\n", i / 512); return 1; }
    printf("OK %ld\n", passes);
    return 0;
}
