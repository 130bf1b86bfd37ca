#!/usr/bin/env python3
"""tmem bench pressure: a memory-hungry job with a realistic heap.

Usage: heap.py --mib N [--seed S] [--passes P] [--cold-share C]

Builds a heap of about N MiB (resident, at peak) made of what real programs
keep in memory: dicts of records with small and large ints, floats, short
strings, lists of shared tag strings, nested dicts, text-like byte buffers
(log lines, JSON, prose, with some binary noise) and preallocated buffers
that are only partly filled. Page by page it compresses like a real heap
(zram lz4 about 2.5x). Then makes P passes over every record,
reading every field and modifying some of them (so that, under a memory
limit, pages are swapped out AND read back in), touching a small hot set
much more often than the rest. Finally it hashes every byte of every
record and prints one line:

    checksum <blake2b-hex> records <n> payload_mib <m>

With --cold-share C (0..90, default 0: the uniform job above), the first
C % of the heap (by the same size estimate that ends the build) is built
first, as records of its own, and then left alone: the passes touch only
the records built after it (the hot set is the first 2 % of those), so its
pages sit untouched until the final checksum reads them. The records are
the same for every C (the same PRNG stream builds them in the same order);
only which of them the passes modify changes, so the checksum depends on C
too. The line then ends with " cold_records <k>".

For a given (N, S, P, C) the checksum is deterministic (it depends only on
a seeded PRNG and the arithmetic; no addresses, no hash-order dependence),
so the caller can compare each run against a reference run.

The cyclic garbage collector is disabled: nothing here is cyclic, and a
full collection walking the whole heap would dominate the run time.
"""

import gc
import hashlib
import random
import struct
import sys
from array import array

MIB = 1 << 20
# Interpreter, modules and the text corpus: resident before the first record.
BASE_BYTES = 12 * MIB
# The build stops when the estimated object sizes (sys.getsizeof based, with
# approximations for shared objects) reach this fraction of the target; the
# factor is calibrated so that the peak RSS lands near the target (CPython 3.11).
# The bench measures the real peak anyway.
ACCOUNTED_FRACTION = 1.1

SYLLABLES = [
    "ka", "to", "ri", "men", "sa", "lo", "ne", "vi", "dar", "qu", "el", "ion", "tra", "po", "fu", "ber",
    "sch", "an", "ul", "mi", "zen", "ho", "gra", "st", "ie", "or", "pe", "lin", "co", "da", "ex", "um",
]


def make_words(rng, n):
    words = []
    for _ in range(n):
        k = rng.randint(1, 4)
        words.append("".join(rng.choice(SYLLABLES) for _ in range(k)))
    return words


def zipf_pick(r, seq):
    """Picks from seq with a skewed (roughly Zipf-like) popularity, as words in text are."""
    return seq[int(len(seq) * r() ** 3)]


LOG_TEMPLATES = (
    "GET /api/v1/{w}/{n} HTTP/1.1 200 {n}ms",
    "POST /api/v1/{w}/{w} HTTP/1.1 201 {n}ms",
    "user {w} logged in from 10.{n}.{n}.{n}",
    "cache miss for key {w}:{w}:{n}, fetching from backend",
    "request {n} finished: status=ok rows={n} bytes={n}",
    "connection {n} to db-{n}.internal closed (idle {n}s)",
    "scheduled job {w} ({w}) in {n}s",
    "retrying {w} after error: timeout after {n}ms (attempt {n} of 5)",
)


def make_corpus(rng, words, size):
    """Text-like bytes: log lines, JSON records and some prose, as programs
    keep in caches and buffers. Page by page, lz4 gets about 2-2.5x on it."""
    r = rng.random
    out = []
    total = 0
    t = 1_700_000_000
    ident = 100_000

    def fill(template):
        parts = template.split("{")
        res = [parts[0]]
        for p in parts[1:]:
            res.append(zipf_pick(r, words) if p[0] == "w" else str(int(1000 * r() ** 2)))
            res.append(p[2:])
        return "".join(res)

    while total < size:
        x = r()
        if x < 0.08:
            n = rng.randint(4, 16)
            s = " ".join(zipf_pick(r, words) for _ in range(n)).capitalize() + ".\n"
        elif x < 0.6:
            t += int(r() * 3000)
            level = ("INFO", "INFO", "DEBUG", "WARN", "ERROR")[int(5 * r() ** 2)]
            s = "%d.%03d %s [%s] %s\n" % (t, int(r() * 1000), level, zipf_pick(r, words), fill(zipf_pick(r, LOG_TEMPLATES)))
        else:
            ident += 1 + int(r() * 3)
            s = '{"id": %d, "user": "%s", "status": "%s", "score": %.1f, "tags": ["%s", "%s"]}\n' % (
                ident, zipf_pick(r, words), ("active", "idle", "banned")[int(3 * r() ** 2)],
                r() * 100, zipf_pick(r, words), zipf_pick(r, words))
        out.append(s)
        total += len(s)
    return "".join(out).encode()[:size]


class Heap:
    def __init__(self, seed):
        self.rng = random.Random(seed)
        rng = self.rng
        self.words = make_words(rng, 4000)
        self.tags = [sys.intern("tag-" + w) for w in self.words[:300]]
        self.kinds = [sys.intern(w.upper()) for w in self.words[300:340]]
        self.corpus = make_corpus(rng, self.words, 1 << 20)
        self.records = []
        # Records [0, ncold) are the cold part: built first, never touched by the passes.
        self.ncold = 0
        self.accounted = BASE_BYTES

    def make_record(self, i):
        rng = self.rng
        r = rng.random
        sizeof = sys.getsizeof
        words, nw = self.words, len(self.words)
        ncounts = 8 + int(r() * 57)
        # Counters of mixed magnitudes: bytes (cached small ints), 16 and 32 bits.
        width = "BBBHI"[int(r() * 5)]
        counts = list(array(width, rng.randbytes(ncounts * array(width).itemsize)))
        nweights = 4 + int(r() * 29)
        raw = array("H", rng.randbytes(2 * nweights))
        if r() < 0.35:
            scale = (0.5, 0.25, 0.01)[int(r() * 3)]
            weights = [x * scale for x in raw]
            wsize = sizeof(weights) + 24 * nweights
        else:
            weights = array("d", raw)
            wsize = sizeof(weights)
        alltags, nt = self.tags, len(self.tags)
        tags = [alltags[int(r() * nt)] for _ in range(1 + int(r() * 6))]
        blen = int(rng.paretovariate(1.5) * 150) % 8192 + 32
        off = int(r() * (len(self.corpus) - blen))
        text = bytearray(self.corpus[off:off + blen])
        # Binary noise (pointers, hashes, packed ints): about 1% of the bytes.
        for _ in range(blen // 768 + 1):
            p = int(r() * (blen - 8))
            text[p:p + 8] = rng.randbytes(8)
        name = "%s-%s-%06d" % (words[int(r() * nw)], words[int(r() * nw)], i)
        rec = {
            "id": i,
            "name": name,
            "kind": self.kinds[int(r() * len(self.kinds))],
            "tags": tags,
            "counts": counts,
            "weights": weights,
            "score": r(),
            "text": text,
            "version": 0,
        }
        size = sizeof(rec) + sizeof(name) + sizeof(tags) + sizeof(counts) + 32 * ncounts + wsize
        size += sizeof(text) + 24 + 28
        if r() < 0.25:
            meta = {"owner": words[int(r() * nw)], "created": 1_600_000_000 + rng.getrandbits(26), "flags": rng.getrandbits(16)}
            rec["meta"] = meta
            size += sizeof(meta) + sizeof(meta["owner"]) + 64
        if r() < 0.6:
            # A preallocated buffer, partly filled (its tail is still zero).
            cap = (512, 1024, 2048, 4096)[int(r() * 4)]
            used = int(cap * (0.2 + 0.3 * r()))
            off = int(r() * (len(self.corpus) - used))
            buf = bytearray(cap)
            buf[:used] = self.corpus[off:off + used]
            rec["buf"] = buf
            size += sizeof(buf)
        return rec, size

    def build(self, target, cold_share=0):
        limit = BASE_BYTES + (target - BASE_BYTES) * ACCOUNTED_FRACTION
        # The cold part ends where this share of the heap's records is built.
        cold_limit = BASE_BYTES + (limit - BASE_BYTES) * cold_share / 100
        i = 0
        while self.accounted < limit:
            rec, size = self.make_record(i)
            self.records.append(rec)
            self.accounted += size + 8
            i += 1
            if self.accounted < cold_limit:
                self.ncold = i

    def touch(self, rec, p, salt):
        """Reads every field of rec and modifies some; returns a small digest."""
        acc = rec["id"] + len(rec["name"]) + len(rec["tags"]) + rec["version"]
        counts = rec["counts"]
        acc += sum(counts)
        j = (p * 7 + salt) % len(counts)
        counts[j] = (counts[j] * 3 + salt) & 0xFFFFFFFF
        weights = rec["weights"]
        s = sum(weights)
        k = (p + salt) % len(weights)
        weights[k] = round(weights[k] * 0.5 + 1.0, 6)
        text = rec["text"]
        # Reads every byte of the buffer (C speed), flips a few.
        acc += text.count(b"e")
        n = len(text)
        for q in range(salt % 97, n, 1021):
            text[q] ^= 0x20
        rec["score"] = (rec["score"] * 1.1 + s * 1e-6) % 1.0
        rec["version"] += 1
        meta = rec.get("meta")
        if meta is not None:
            meta["flags"] = (meta["flags"] + p) & 0xFFFF
        buf = rec.get("buf")
        if buf is not None:
            acc += buf.count(b"a")
            buf[salt % (len(buf) // 5)] ^= 0x01
        return acc & 0xFFFF

    def pass_(self, p):
        recs = self.records
        # Only the records after the cold part (all of them without one).
        start = self.ncold
        n = len(recs) - start
        hot = max(1, n // 50)
        rng = random.Random(1000 + p)
        acc = 0
        for idx in range(n):
            acc += self.touch(recs[start + idx], p, idx)
            if idx % 16 == 0:
                # The hot 2% of the (hot part of the) heap is touched 8x as often as the rest.
                acc += self.touch(recs[start + rng.randrange(hot)], p, idx)
        return acc

    def checksum(self):
        h = hashlib.blake2b(digest_size=16)
        pack = struct.pack
        payload = 0
        for rec in self.records:
            h.update(pack("<qqd", rec["id"], rec["version"], rec["score"]))
            h.update(rec["name"].encode())
            h.update(rec["kind"].encode())
            h.update("|".join(rec["tags"]).encode())
            h.update(array("q", rec["counts"]).tobytes())
            w = rec["weights"]
            h.update(w.tobytes() if isinstance(w, array) else array("d", w).tobytes())
            h.update(rec["text"])
            meta = rec.get("meta")
            if meta is not None:
                h.update(pack("<qq", meta["created"], meta["flags"]) + meta["owner"].encode())
            buf = rec.get("buf")
            if buf is not None:
                h.update(buf)
            payload += len(rec["text"]) + len(buf or b"") + 8 * (len(rec["counts"]) + len(w))
        return h.hexdigest(), payload


def main(argv):
    args = {"--mib": None, "--seed": "1", "--passes": "3", "--cold-share": "0"}
    it = iter(argv)
    for a in it:
        if a not in args:
            sys.exit("heap.py: unknown argument %r" % a)
        args[a] = next(it, None)
    if args["--mib"] is None:
        sys.exit("heap.py: --mib N is required")
    mib, seed, passes = int(args["--mib"]), int(args["--seed"]), int(args["--passes"])
    cold_share = int(args["--cold-share"])
    if not 0 <= cold_share <= 90:
        sys.exit("heap.py: --cold-share must be in 0..90 (%% of the heap), not %d" % cold_share)
    gc.disable()
    heap = Heap(seed)
    heap.build(mib * MIB, cold_share)
    acc = 0
    for p in range(passes):
        acc = (acc * 31 + heap.pass_(p)) & 0xFFFFFFFF
    digest, payload = heap.checksum()
    line = "checksum %s-%08x records %d payload_mib %.1f" % (digest, acc, len(heap.records), payload / MIB)
    if cold_share:
        line += " cold_records %d" % heap.ncold
    print(line, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
