/* A job for the VM test: allocates MIB MiB, writes a pattern that differs
 * per page, then reads it back twice and checks it. Prints "OK <checksum>"
 * or "BAD page N". Static, so it runs in a bare initramfs. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? strtoul(argv[1], NULL, 10) : 150;
    size_t words = mib << 17; /* 8-byte words */
    uint64_t *p = mmap(NULL, words * 8, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) { perror("mmap"); return 2; }
    for (size_t i = 0; i < words; i++)
        p[i] = (i / 512) * 0x9E3779B97F4A7C15ull + (i % 512 < 64 ? i : 0);
    uint64_t sum = 0;
    for (int pass = 0; pass < 2; pass++)
        for (size_t i = 0; i < words; i++) {
            uint64_t want = (i / 512) * 0x9E3779B97F4A7C15ull + (i % 512 < 64 ? i : 0);
            if (p[i] != want) { printf("BAD page %zu\n", i / 512); return 1; }
            sum += p[i];
        }
    printf("OK %llu\n", (unsigned long long)sum);
    return 0;
}
