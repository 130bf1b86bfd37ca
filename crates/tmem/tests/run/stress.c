/* The `tmem run` stress job: THREADS threads write, rewrite, munmap, mremap
 * and MADV_DONTNEED their own regions in a seeded pattern, check every byte
 * against a model, and fork children that check their copies.
 *
 * usage: stress SEED TOTAL_MIB OPS_PER_THREAD [MIX]
 * MIX is `default`, or `remap`: a quarter of the operations move or resize
 * regions, a third of those as the program's own MREMAP_FIXED moves.
 * Prints "ok CHECKS" and exits 0, or names the first wrong page, with the
 * thread's last operations at its address, and exits 1.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>
#include <signal.h>

static void on_segv(int sig, siginfo_t *si, void *ctx)
{
	(void)ctx;
	char msg[128];
	int n = snprintf(msg, sizeof msg, "signal %d at %p in pid %d\n", sig, si->si_addr, getpid());
	if (write(2, msg, n)) {}
	_exit(3);
}

#define PAGE 4096UL
#define THREADS 8
#define REGIONS 6
#define WORDS (PAGE / 8)

struct region {
	uint64_t *mem;
	size_t pages;
	uint64_t *model; /* per page: 0 = zeros, else the value it was filled with */
};

/* The thread's last operations, printed on a mismatch: those that touched
 * the page's address. */
#define LOG 8192
struct logent {
	char op;
	uint64_t a, alen, b, blen, v;
};

struct worker {
	int id;
	unsigned long nlog;
	struct logent log[LOG];
	uint64_t rng;
	size_t max_pages;
	long ops;
	long checks;
	struct region r[REGIONS];
};

static struct worker workers[THREADS];

/* Where each operation's share of 1000 ends; the last one forks. */
struct mix {
	const char *name;
	int write, read, dontneed, unmap, tail, remap;
	int fixed; /* 1 in `fixed` of the mremaps is a MREMAP_FIXED move (0: none) */
};
static const struct mix mixes[] = {
	{ "default", 550, 900, 940, 960, 975, 999, 0 },
	{ "remap", 400, 650, 690, 710, 725, 999, 3 },
};
static const struct mix *mix = &mixes[0];

static uint64_t next(uint64_t *s)
{
	uint64_t x = *s;
	x ^= x << 13;
	x ^= x >> 7;
	x ^= x << 17;
	return *s = x;
}

/* Odd values fill every word alike (a same-filled page), even ones a
 * compressible pattern. */
static uint64_t word(uint64_t v, size_t i)
{
	return (v & 1) ? v : v + (i & 7);
}

static void fill(uint64_t *page, uint64_t v)
{
	for (size_t i = 0; i < WORDS; i++)
		page[i] = word(v, i);
}

static void note(struct worker *w, char op, const void *a, size_t alen, const void *b, size_t blen, uint64_t v)
{
	struct logent *e = &w->log[w->nlog++ % LOG];
	e->op = op;
	e->a = (uint64_t)a;
	e->alen = alen;
	e->b = (uint64_t)b;
	e->blen = blen;
	e->v = v;
}

static void fail(struct worker *w, int r, size_t p, uint64_t want, uint64_t got, size_t i, const char *where)
{
	fprintf(stderr, "MISMATCH (%s) thread %d region %d page %zu (at %p) word %zu: want %#lx got %#lx\n", where,
		w->id, r, p, (void *)(w->r[r].mem + p * WORDS), i, (unsigned long)want, (unsigned long)got);
	uint64_t at = (uint64_t)(w->r[r].mem + p * WORDS);
	unsigned long from = w->nlog > LOG ? w->nlog - LOG : 0;
	for (unsigned long k = from; k < w->nlog; k++) {
		struct logent *e = &w->log[k % LOG];
		if ((at >= e->a && at < e->a + e->alen) || (at >= e->b && at < e->b + e->blen))
			fprintf(stderr, "  op %lu/%lu %c %#lx+%#lx %#lx+%#lx v %#lx\n", k, w->nlog, e->op,
				(unsigned long)e->a, (unsigned long)e->alen, (unsigned long)e->b, (unsigned long)e->blen,
				(unsigned long)e->v);
	}
	fflush(stderr);
	_exit(1);
}

static void check_page(struct worker *w, int r, size_t p, const char *where)
{
	uint64_t v = w->r[r].model[p];
	uint64_t *page = w->r[r].mem + p * WORDS;
	for (size_t i = 0; i < WORDS; i++) {
		uint64_t want = v ? word(v, i) : 0;
		if (page[i] != want)
			fail(w, r, p, want, page[i], i, where);
	}
	w->checks++;
}

static void check_all(struct worker *w, const char *where)
{
	for (int r = 0; r < REGIONS; r++)
		for (size_t p = 0; p < w->r[r].pages; p++)
			check_page(w, r, p, where);
}

static void map_region(struct worker *w, int r)
{
	size_t pages = 8 + next(&w->rng) % (w->max_pages - 8);
	void *m = mmap(NULL, pages * PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (m == MAP_FAILED) {
		perror("mmap");
		_exit(2);
	}
	w->r[r].mem = m;
	w->r[r].pages = pages;
	w->r[r].model = calloc(pages, sizeof(uint64_t));
	note(w, 'm', m, pages * PAGE, 0, 0, r);
}

static void op(struct worker *w)
{
	int r = next(&w->rng) % REGIONS;
	struct region *g = &w->r[r];
	uint64_t dice = next(&w->rng) % 1000;
	size_t p = next(&w->rng) % g->pages;
	if (dice < mix->write) {
		/* write: a whole page, a new value */
		uint64_t v = next(&w->rng) | 2;
		fill(g->mem + p * WORDS, v);
		g->model[p] = v;
		note(w, 'w', g->mem + p * WORDS, PAGE, 0, 0, v);
	} else if (dice < mix->read) {
		check_page(w, r, p, "read");
	} else if (dice < mix->dontneed) {
		/* MADV_DONTNEED over a few pages: they read as zeros */
		size_t n = 1 + next(&w->rng) % 16;
		if (p + n > g->pages)
			n = g->pages - p;
		if (madvise(g->mem + p * WORDS, n * PAGE, MADV_DONTNEED)) {
			perror("madvise");
			_exit(2);
		}
		memset(g->model + p, 0, n * sizeof(uint64_t));
		note(w, 'd', g->mem + p * WORDS, n * PAGE, 0, 0, 0);
	} else if (dice < mix->unmap) {
		/* munmap the region, map a fresh one */
		munmap(g->mem, g->pages * PAGE);
		note(w, 'u', g->mem, g->pages * PAGE, 0, 0, 0);
		free(g->model);
		map_region(w, r);
	} else if (dice < mix->tail) {
		/* munmap the tail */
		size_t keep = 1 + p;
		if (keep < g->pages) {
			munmap(g->mem + keep * WORDS, (g->pages - keep) * PAGE);
			note(w, 't', g->mem + keep * WORDS, (g->pages - keep) * PAGE, 0, 0, 0);
			g->pages = keep;
		}
	} else if (dice < mix->remap) {
		/* mremap: grow (maybe moving) or shrink, or move to a place of
		 * the program's own choosing */
		size_t pages = 8 + next(&w->rng) % (w->max_pages - 8);
		void *m;
		if (mix->fixed && next(&w->rng) % mix->fixed == 0) {
			pages = g->pages;
			void *to = mmap(NULL, pages * PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
			if (to == MAP_FAILED) {
				perror("mmap");
				_exit(2);
			}
			m = mremap(g->mem, pages * PAGE, pages * PAGE, MREMAP_MAYMOVE | MREMAP_FIXED, to);
		} else {
			m = mremap(g->mem, g->pages * PAGE, pages * PAGE, MREMAP_MAYMOVE);
		}
		if (m == MAP_FAILED) {
			perror("mremap");
			fprintf(stderr, "region %p-%p\n", (void *)g->mem, (void *)(g->mem + g->pages * WORDS));
			FILE *f = fopen("/proc/self/smaps", "r");
			char line[256];
			int show = 0;
			unsigned long a = (unsigned long)g->mem, b = a + g->pages * PAGE;
			while (f && fgets(line, sizeof line, f)) {
				unsigned long s, e;
				if (sscanf(line, "%lx-%lx ", &s, &e) == 2 && strchr(line, ' ') == line + strcspn(line, " ") && line[strcspn(line, "-")] == '-' && strstr(line, "p ")) {
					show = s < b + 0x100000 && e + 0x100000 > a;
					if (show)
						fprintf(stderr, "%s", line);
				} else if (show && (!strncmp(line, "VmFlags", 7) || !strncmp(line, "Rss", 3) || !strncmp(line, "Anonymous", 9)))
					fprintf(stderr, "   %s", line);
			}
			_exit(2);
		}
		note(w, 'r', g->mem, g->pages * PAGE, m, pages * PAGE, 0);
		uint64_t *model = calloc(pages, sizeof(uint64_t));
		memcpy(model, g->model, (pages < g->pages ? pages : g->pages) * sizeof(uint64_t));
		free(g->model);
		g->mem = m;
		g->model = model;
		g->pages = pages;
	} else {
		/* fork: the child checks its copy of this thread's memory */
		pid_t child = fork();
		if (child < 0) {
			perror("fork");
			_exit(2);
		}
		note(w, 'f', 0, 0, 0, 0, 0);
		if (child == 0) {
			check_all(w, "fork child");
			_exit(0);
		}
		int status;
		if (waitpid(child, &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
			fprintf(stderr, "fork child of thread %d failed (status %#x)\n", w->id, status);
			_exit(1);
		}
	}
}

static void *run(void *arg)
{
	struct worker *w = arg;
	for (int r = 0; r < REGIONS; r++)
		map_region(w, r);
	for (long i = 0; i < w->ops; i++)
		op(w);
	check_all(w, "end");
	return NULL;
}

int main(int argc, char **argv)
{
	if (argc != 4 && argc != 5) {
		fprintf(stderr, "usage: %s SEED TOTAL_MIB OPS_PER_THREAD [default|remap]\n", argv[0]);
		return 2;
	}
	if (argc == 5) {
		mix = NULL;
		for (size_t i = 0; i < sizeof mixes / sizeof mixes[0]; i++)
			if (!strcmp(argv[4], mixes[i].name))
				mix = &mixes[i];
		if (!mix) {
			fprintf(stderr, "%s: no mix %s: it is default or remap\n", argv[0], argv[4]);
			return 2;
		}
	}
	uint64_t seed = strtoull(argv[1], NULL, 0);
	size_t total_pages = strtoull(argv[2], NULL, 0) * 256;
	long ops = strtol(argv[3], NULL, 0);
	pthread_t t[THREADS];
	struct sigaction sa = { .sa_sigaction = on_segv, .sa_flags = SA_SIGINFO };
	sigaction(SIGSEGV, &sa, NULL);
	sigaction(SIGBUS, &sa, NULL);
	for (int i = 0; i < THREADS; i++) {
		workers[i].id = i;
		workers[i].rng = seed * 0x9E3779B97F4A7C15ULL + i + 1;
		/* regions average half their maximum */
		workers[i].max_pages = 2 * total_pages / THREADS / REGIONS;
		workers[i].ops = ops;
		pthread_create(&t[i], NULL, run, &workers[i]);
	}
	long checks = 0;
	for (int i = 0; i < THREADS; i++) {
		pthread_join(t[i], NULL);
		checks += workers[i].checks;
	}
	printf("ok %ld\n", checks);
	return 0;
}
