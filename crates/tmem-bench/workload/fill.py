"""The job of `tmem bench capacity` (ccache's capacity test, seed 004).

Allocates anonymous memory 1 MiB at a time and fills each chunk with the
next bytes of DATA (wrapping round at its end), keeping every chunk, until
the memory cgroup's OOM killer ends it. After each chunk it prints the bytes
allocated so far and flushes, so the last line is what it held at the kill.
"""
import mmap
import os
import sys

CHUNK = 1 << 20


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: fill.py DATA MAX_BYTES")
    fd = os.open(sys.argv[1], os.O_RDONLY)
    limit = int(sys.argv[2])
    size = os.fstat(fd).st_size
    if size == 0:
        sys.exit("fill.py: the data file is empty")
    held = []
    offset = 0
    total = 0
    while total < limit:
        chunk = mmap.mmap(-1, CHUNK)
        view = memoryview(chunk)
        filled = 0
        while filled < CHUNK:
            n = os.preadv(fd, [view[filled:]], offset)
            filled += n
            offset += n
            if n == 0 or offset >= size:
                offset = 0
        view.release()
        held.append(chunk)
        total += CHUNK
        sys.stdout.write("%d\n" % total)
        sys.stdout.flush()
    # Not killed before MAX_BYTES: the bench reports that, not a capacity.
    print("limit", flush=True)


main()
