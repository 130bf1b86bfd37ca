# tmem-corpus: build a realistic, mixed Python heap, then print "ready" and
# sleep until killed. Usage: python3 heap.py TARGET_ANON_BYTES
#
# The heap looks like a typical data-processing service: records parsed from
# JSON text, an inverted word index, class instances (with and without
# __slots__), log lines, numeric series, tuples, sets and some bytes. All
# pseudo-random with a fixed seed, so runs are reproducible.
import json
import random
import sys
import time


def rss_anon():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


TARGET = int(sys.argv[1])
rng = random.Random(0x7E3E)

SYLLABLES = ["ka", "lo", "mi", "ne", "to", "ra", "shi", "en", "dor", "al", "ve",
             "qu", "is", "tor", "an", "el", "ri", "os", "um", "ba", "zen", "ph"]
WORDS = sorted({"".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4)))
                for _ in range(6000)})
COUNTRIES = ["DE", "US", "FR", "JP", "BR", "IN", "GB", "NL", "SE", "CA", "KR", "ES"]
STATUSES = ["active", "suspended", "trial", "closed", "pending"]
DOMAINS = ["example.com", "mail.test", "corp.invalid", "users.example.org"]
LEVELS = ["DEBUG", "INFO", "INFO", "INFO", "WARN", "ERROR"]


def word():
    # Zipf-like: common words are much more frequent.
    return WORDS[min(int(rng.paretovariate(1.2)) - 1, len(WORDS) - 1)
                 if rng.random() < 0.7 else rng.randrange(len(WORDS))]


def sentence(n):
    return " ".join(word() for _ in range(n)).capitalize() + "."


def json_record(i):
    """Generate the JSON text of one record the way a service would receive it."""
    first, last = word().capitalize(), word().capitalize()
    tags = ", ".join('"%s"' % word() for _ in range(rng.randint(0, 5)))
    history = ", ".join(str(rng.randint(0, 5000)) for _ in range(rng.randint(0, 12)))
    return (
        '{"id": %d, "name": "%s %s", "email": "%s.%s@%s", "age": %d, '
        '"balance": %.2f, "score": %r, "active": %s, "status": "%s", '
        '"tags": [%s], "history": [%s], '
        '"address": {"street": "%d %s St", "city": "%s", "zip": "%05d", "country": "%s"}, '
        '"bio": "%s", "created": "2024-%02d-%02dT%02d:%02d:%02dZ"}'
        % (i, first, last, first.lower(), last.lower(), rng.choice(DOMAINS),
           rng.randint(18, 90), rng.uniform(-500, 25000), rng.random(),
           "true" if rng.random() < 0.8 else "false", rng.choice(STATUSES),
           tags, history, rng.randint(1, 9999), word().capitalize(),
           word().capitalize(), rng.randint(0, 99999), rng.choice(COUNTRIES),
           sentence(rng.randint(3, 25)), rng.randint(1, 12), rng.randint(1, 28),
           rng.randint(0, 23), rng.randint(0, 59), rng.randint(0, 59)))


class Order:
    def __init__(self, oid, customer, items, total, note):
        self.oid = oid
        self.customer = customer
        self.items = items
        self.total = total
        self.note = note
        self.paid = rng.random() < 0.9
        self.created = time.time() - rng.uniform(0, 3e7)


class Point:
    __slots__ = ("x", "y", "z", "label")

    def __init__(self, x, y, z, label):
        self.x, self.y, self.z, self.label = x, y, z, label


records = {}          # id -> dict parsed from JSON
by_email = {}         # email -> record
index = {}            # word -> list of record ids
orders = []           # Order instances
points = []           # Point instances
logs = []             # formatted log lines
series = {}           # metric name -> list of floats
counters = {}         # (country, status) -> int
blobs = []            # bytes objects
seen = set()          # set of strings
lru = []              # list of tuples

next_id = 0
while rss_anon() < TARGET:
    batch = [json_record(next_id + k) for k in range(500)]
    text = "[" + ",\n".join(batch) + "]"
    for rec in json.loads(text):
        rid = rec["id"]
        records[rid] = rec
        by_email[rec["email"]] = rec
        for w in rec["bio"].lower().rstrip(".").split():
            index.setdefault(w, []).append(rid)
        key = (rec["address"]["country"], rec["status"])
        counters[key] = counters.get(key, 0) + 1
        if rng.random() < 0.5:
            items = [(word(), rng.randint(1, 9), round(rng.uniform(1, 300), 2))
                     for _ in range(rng.randint(1, 6))]
            orders.append(Order(rid * 10 + len(orders) % 10, rec, items,
                                sum(q * p for _, q, p in items), sentence(rng.randint(0, 8))))
        if rng.random() < 0.6:
            points.append(Point(rng.gauss(0, 100), rng.gauss(0, 100), rng.random(),
                                "p%d" % len(points)))
        if rng.random() < 0.7:
            logs.append("%s 2024-05-%02d %02d:%02d:%02d.%03d [worker-%d] %s user=%d %s" % (
                rng.choice(LEVELS), rng.randint(1, 31), rng.randint(0, 23),
                rng.randint(0, 59), rng.randint(0, 59), rng.randint(0, 999),
                rng.randint(1, 16), rng.choice(["GET", "POST", "PUT"]), rid,
                sentence(rng.randint(2, 10))))
        if rng.random() < 0.1:
            name = "metric.%s.%s" % (word(), rng.choice(["p50", "p99", "count", "rate"]))
            series.setdefault(name, []).extend(rng.gauss(50, 15) for _ in range(rng.randint(5, 60)))
        if rng.random() < 0.05:
            if rng.random() < 0.5:
                blobs.append(rec["bio"].encode() * rng.randint(1, 4))
            else:
                blobs.append(bytes(rng.getrandbits(8) for _ in range(rng.randint(16, 512))))
        seen.add(rec["name"])
        lru.append((rid, rec["email"], rng.randint(0, 1 << 40), rec["score"]))
    next_id += 500

print("ready", next_id, rss_anon(), flush=True)
while True:
    time.sleep(3600)
