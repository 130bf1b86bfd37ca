#!/usr/bin/env python3
"""Builds the database of `tmem bench cache`: an SQLite file of about --mib MiB.

One table `orders` (INTEGER PRIMARY KEY and a few TEXT columns of realistic,
moderately compressible text: words from a fixed vocabulary, names, numbers,
dates) and a secondary index on `sku`, a key derived from the rowid by a
bijection (so the query job can look a row up by either without storing
keys). Deterministic for a given --seed. Prints one JSON line: rows, bytes,
page size.
"""

import argparse
import json
import os
import random
import sqlite3
import sys

WORDS = (
    "able about account across action active address after again against agent also amount "
    "analysis annual answer apply april area argue around arrive article assume august author "
    "available average award balance bank basic beach become before begin behind believe benefit "
    "better between billing blue board body book border branch brand bring budget build business "
    "button buyer call camera campaign capital card care carrier case cash catalog center central "
    "chain change charge check choice city claim class clear client close cloud coast code collect "
    "color column comment common company compare complete concern confirm contact contract control "
    "copy corner cost cotton count country county course cover credit current customer cycle daily "
    "damage data date deal debit december decide deliver delivery demand depot describe design "
    "detail device direct discount dispatch district document domestic double draft driver early "
    "east economy edge effect electric email employee empty energy engine entry equal error estate "
    "event exact example exchange express extra factory fast february federal field figure final "
    "finance first fixed floor follow force foreign form forward free freight friday front fuel "
    "full future garden general gift glass global good green ground group growth guide handle "
    "harbor health heavy help high hold home hotel house import include income index industry "
    "inside insurance interest invoice issue item january july june kitchen label large late "
    "leather ledger legal letter level light limit line list local long lower machine mail main "
    "major manager march market material matter medium member method middle minor model monday "
    "month morning motor mountain national natural network north note november number october "
    "offer office online open order origin outside owner pack package paper parcel partner party "
    "payment period person phone piece place plan plastic point policy port post price print "
    "priority private product profit project provider public purchase quality quarter queue quick "
    "rail range rate reason receipt record refund region regular remote repair report request "
    "retail return review right river road route rural safety sale sample saturday schedule "
    "season second secure select seller send september service set shelf ship shipment short "
    "signal silver simple single size small soft south special spring square staff standard start "
    "state station status steel stock storage store street strong summer sunday supplier supply "
    "support surface system table tax team term thursday ticket total tower track trade transfer "
    "travel truck tuesday type union unit update urban valley value vendor village volume wait "
    "warehouse warranty water wednesday week weight west white wholesale window winter wire wood "
    "work world yard year yellow zone"
).split()

FIRST = (
    "Ada Alan Alice Amir Ana Anna Ben Carla Chen David Elena Emma Eva Felix Grace Hana Hugo Ines "
    "Ivan Jack Jana Jon Julia Karl Kim Lara Leo Lina Luca Maya Mia Nina Noah Olga Omar Paul Petra "
    "Raj Rosa Sam Sara Sofia Tom Uma Vera Yuki Zoe"
).split()

LAST = (
    "Adams Baker Becker Brown Costa Dubois Eriksen Fischer Garcia Gomez Hansen Ito Jensen Kowalski "
    "Kumar Lee Lopez Martin Meyer Moreau Muller Nagy Novak Okafor Olsen Park Perez Rossi Sato "
    "Schmidt Silva Smith Suzuki Tanaka Taylor Weber Wilson Wong Young Zhang"
).split()

STATUS = ("new", "paid", "packed", "shipped", "delivered", "returned", "cancelled")


def sku(rowid):
    """Index key of a row: a bijection of the rowid (odd multiplier mod 2**32)."""
    return "K%010d" % ((rowid * 2654435761) % 4294967296)


def row(rng, rowid):
    nwords = rng.randint(12, 40)
    note = " ".join(rng.choice(WORDS) for _ in range(nwords))
    customer = "%s %s" % (rng.choice(FIRST), rng.choice(LAST))
    address = "%d %s %s street, %s %05d" % (
        rng.randint(1, 999),
        rng.choice(WORDS).capitalize(),
        rng.choice(WORDS),
        rng.choice(WORDS).capitalize(),
        rng.randint(1000, 99999),
    )
    items = ";".join(
        "%s-%s x%d @%d.%02d" % (rng.choice(WORDS), rng.choice(WORDS), rng.randint(1, 9), rng.randint(1, 500), rng.randint(0, 99))
        for _ in range(rng.randint(1, 4))
    )
    created = "2025-%02d-%02dT%02d:%02d:%02dZ" % (
        rng.randint(1, 12),
        rng.randint(1, 28),
        rng.randint(0, 23),
        rng.randint(0, 59),
        rng.randint(0, 59),
    )
    return (rowid, sku(rowid), customer, address, items, rng.choice(STATUS), created, note)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--db", required=True)
    p.add_argument("--mib", type=int, required=True)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()
    rng = random.Random(a.seed)
    target = a.mib * 1024 * 1024
    con = sqlite3.connect(a.db)
    con.execute("PRAGMA page_size = 4096")
    con.execute("PRAGMA journal_mode = OFF")
    con.execute("PRAGMA synchronous = OFF")
    con.execute(
        "CREATE TABLE orders (id INTEGER PRIMARY KEY, sku TEXT NOT NULL, customer TEXT, address TEXT, "
        "items TEXT, status TEXT, created TEXT, note TEXT)"
    )
    page_size = con.execute("PRAGMA page_size").fetchone()[0]
    rowid = 0
    batch = 5000
    # The index on sku takes roughly 1/8 of the table: stop the table there.
    while True:
        rows = []
        for _ in range(batch):
            rowid += 1
            rows.append(row(rng, rowid))
        con.executemany("INSERT INTO orders VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
        con.commit()
        pages = con.execute("PRAGMA page_count").fetchone()[0]
        if pages * page_size * 9 // 8 >= target:
            break
    con.execute("CREATE INDEX orders_sku ON orders (sku)")
    con.commit()
    con.close()
    print(json.dumps({"rows": rowid, "bytes": os.path.getsize(a.db), "page_size": page_size}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
