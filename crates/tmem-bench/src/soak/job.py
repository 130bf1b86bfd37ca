# A checksum job of `tmem bench soak`: holds MIB MiB in 1 MiB chunks (1 KiB
# random and 3 KiB zeros per page, so they compress), checks every chunk
# against its SHA-256 on each pass, rewrites a tenth of them between passes,
# and stops after SECS seconds (at least one pass). Prints READY, then
# "OK passes worst_ms" (worst_ms: the longest one chunk took to read back,
# a swap stall), or "MISMATCH chunk pass" and exits 2.
import hashlib, random, sys, time

mib, secs, seed = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
rng = random.Random(seed)


def chunk(i, gen):
    r = random.Random(seed * 1000003 + i * 7919 + gen * 104729)
    return bytearray(b"".join(r.randbytes(1024) + bytes(3072) for _ in range(256)))


gens = [0] * mib
chunks = [chunk(i, 0) for i in range(mib)]
digests = [hashlib.sha256(c).digest() for c in chunks]
print("READY", flush=True)
end = time.monotonic() + secs
worst, passes = 0.0, 0
while passes < 1 or time.monotonic() < end:
    for i in range(mib):
        t = time.monotonic()
        d = hashlib.sha256(chunks[i]).digest()
        worst = max(worst, time.monotonic() - t)
        if d != digests[i]:
            print("MISMATCH", i, passes, flush=True)
            sys.exit(2)
    for _ in range(max(1, mib // 10)):
        i = rng.randrange(mib)
        gens[i] += 1
        chunks[i] = chunk(i, gens[i])
        digests[i] = hashlib.sha256(chunks[i]).digest()
    passes += 1
print("OK", passes, "%.1f" % (worst * 1000), flush=True)
