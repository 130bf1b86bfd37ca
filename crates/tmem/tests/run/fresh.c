#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
/* Maps N MiB with mmap (a mapping tmem run has not scanned yet), writes
 * every page once as fast as memset goes, then checks a byte of each. */
int main(int argc, char **argv) {
    size_t mib = argc > 1 ? strtoul(argv[1], 0, 10) : 64, n = mib << 20;
    unsigned char *p = mmap(0, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return 1;
    for (size_t i = 0; i < n; i += 4096) memset(p + i, (int)(i >> 12) & 0x7f, 4096);
    unsigned long sum = 0;
    for (size_t i = 0; i < n; i += 4096) sum += p[i];
    unsigned long want = 0;
    for (size_t i = 0; i < n; i += 4096) want += (i >> 12) & 0x7f;
    printf("%s\n", sum == want ? "ok" : "MISMATCH");
    return sum != want;
}
