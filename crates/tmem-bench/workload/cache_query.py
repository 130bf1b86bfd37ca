#!/usr/bin/env python3
"""The read-heavy job of `tmem bench cache`: --queries random lookups in the
database that cache_build.py made, opened read-only (immutable: no locks, no
journal), half by rowid and half through the secondary index on `sku`
(--index-share), with rows drawn from a power law (--skew: 1 uniform, 2: a
quarter of the rows get half of the lookups), hot rows scattered over the
whole file. Deterministic for a given --seed: the checksum of what it read
must be the same in every row of the bench. Prints one JSON line.
"""

import argparse
import json
import math
import random
import sqlite3
import sys
import time
import zlib


def sku(rowid):
    return "K%010d" % ((rowid * 2654435761) % 4294967296)


def coprime_step(n):
    step = int(n * 0.6180339887) | 1
    while math.gcd(step, n) != 1:
        step += 2
    return step


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--db", required=True)
    p.add_argument("--rows", type=int, required=True)
    p.add_argument("--queries", type=int, required=True)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--skew", type=float, default=2.0)
    p.add_argument("--index-share", type=float, default=0.5)
    a = p.parse_args()
    rng = random.Random(a.seed)
    n = a.rows
    step = coprime_step(n)
    con = sqlite3.connect("file:%s?mode=ro&immutable=1" % a.db, uri=True)
    con.execute("PRAGMA mmap_size = 0")
    by_id = "SELECT id, customer, address, items, status, created, note FROM orders WHERE id = ?"
    by_sku = "SELECT id, customer, address, items, status, created, note FROM orders WHERE sku = ?"
    found = 0
    checksum = 0
    start = time.monotonic()
    for _ in range(a.queries):
        rank = min(int(n * rng.random() ** a.skew), n - 1)
        rowid = (rank * step) % n + 1
        if rng.random() < a.index_share:
            r = con.execute(by_sku, (sku(rowid),)).fetchone()
        else:
            r = con.execute(by_id, (rowid,)).fetchone()
        if r is not None and r[0] == rowid:
            found += 1
            checksum = (checksum + zlib.crc32("\x1f".join(map(str, r)).encode())) % 4294967296
    secs = time.monotonic() - start
    con.close()
    print(json.dumps({"queries": a.queries, "found": found, "checksum": checksum, "secs": secs}))
    return 0 if found == a.queries else 1


if __name__ == "__main__":
    sys.exit(main())
