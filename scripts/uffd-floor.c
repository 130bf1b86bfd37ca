// The floor of a userfaultfd fault on this machine: what any handler pays
// before it does its own work. One thread touches 65,536 registered pages in
// order, timing each touch; a second thread answers every fault with
// UFFDIO_COPY of one fixed page (no lookup, no decompression). docs/PRESSURE.md
// sets `tmem bench fault`'s tmem-run row beside it.
//
//   cc -O2 -pthread scripts/uffd-floor.c -o target/uffd-floor
//   target/uffd-floor sleep    # the handler sleeps in poll(2) between faults
//   target/uffd-floor spin     # it spins on a non-blocking userfaultfd
//
// Needs userfaultfd for user faults only (UFFD_USER_MODE_ONLY), which any
// user has. Prints the median and the 99th percentile of a touch, in µs.
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define PAGES 65536UL
#define PAGE 4096UL

static int uffd;
static int spin;
static char *source;

static void *handler(void *arg) {
    (void)arg;
    struct uffd_msg msg;
    for (;;) {
        if (!spin) {
            struct pollfd p = {.fd = uffd, .events = POLLIN};
            if (poll(&p, 1, -1) < 0 && errno != EINTR) {
                perror("poll");
                exit(1);
            }
        }
        if (read(uffd, &msg, sizeof msg) != sizeof msg || msg.event != UFFD_EVENT_PAGEFAULT)
            continue;
        struct uffdio_copy copy = {
            .dst = msg.arg.pagefault.address & ~(PAGE - 1), .src = (unsigned long)source, .len = PAGE};
        if (ioctl(uffd, UFFDIO_COPY, &copy) < 0 && errno != EEXIST) {
            perror("UFFDIO_COPY");
            exit(1);
        }
    }
    return NULL;
}

static int by_value(const void *a, const void *b) {
    long x = *(const long *)a, y = *(const long *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc != 2 || (strcmp(argv[1], "sleep") && strcmp(argv[1], "spin"))) {
        fprintf(stderr, "usage: %s sleep|spin\n", argv[0]);
        return 2;
    }
    spin = !strcmp(argv[1], "spin");
    uffd = syscall(SYS_userfaultfd, O_CLOEXEC | UFFD_USER_MODE_ONLY | (spin ? O_NONBLOCK : 0));
    struct uffdio_api api = {.api = UFFD_API};
    if (uffd < 0 || ioctl(uffd, UFFDIO_API, &api) < 0) {
        perror("userfaultfd");
        return 1;
    }
    source = aligned_alloc(PAGE, PAGE);
    memset(source, 7, PAGE);
    char *region = mmap(NULL, PAGES * PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    struct uffdio_register reg = {
        .range = {.start = (unsigned long)region, .len = PAGES * PAGE}, .mode = UFFDIO_REGISTER_MODE_MISSING};
    if (region == MAP_FAILED || ioctl(uffd, UFFDIO_REGISTER, &reg) < 0) {
        perror("register");
        return 1;
    }
    pthread_t thread;
    pthread_create(&thread, NULL, handler, NULL);
    long *ns = malloc(PAGES * sizeof *ns);
    volatile char sum = 0;
    for (unsigned long i = 0; i < PAGES; i++) {
        struct timespec a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        sum += region[i * PAGE];
        clock_gettime(CLOCK_MONOTONIC, &b);
        ns[i] = (b.tv_sec - a.tv_sec) * 1000000000L + b.tv_nsec - a.tv_nsec;
    }
    if (sum != (char)(7 * PAGES)) {
        fprintf(stderr, "a page read back wrong\n");
        return 1;
    }
    qsort(ns, PAGES, sizeof *ns, by_value);
    printf("%s: p50 %.1f us, p99 %.1f us over %lu faults\n", argv[1], ns[PAGES / 2] / 1e3, ns[PAGES * 99 / 100] / 1e3,
           PAGES);
    return 0;
}
