#!/usr/bin/env python3
"""Writes seed inputs for the nbd_session fuzz target into seeds/nbd_session/.

Each seed is: mode byte (preamble chosen by the target) + client bytes.
Run: python3 seeds/make_seeds.py; then
  cargo +nightly fuzz run nbd_session corpus/nbd_session seeds/nbd_session
"""
import os
import struct

IHAVEOPT = 0x49484156454F5054
REQ = 0x25609513
here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nbd_session")
os.makedirs(here, exist_ok=True)


def opt(o, data=b""):
    return struct.pack(">QII", IHAVEOPT, o, len(data)) + data


def s32(b):
    return struct.pack(">I", len(b)) + b


def req(cmd, off, ln, flags=0, cookie=1, payload=b""):
    return struct.pack(">IHHQQI", REQ, flags, cmd, cookie, off, ln) + payload


ops = (
    req(1, 4095, 300, 1, 1, bytes(range(256)) + b"x" * 44)  # unaligned FUA write
    + req(0, 4000, 500, 0, 2)  # read
    + req(4, 8192, 4096, 0, 3)  # trim
    + req(6, 12288, 5000, 2, 4)  # write zeroes NO_HOLE
    + req(6, 20000, 5000, 0, 5)  # write zeroes
    + req(7, 0, 65536, 0, 6)  # block status
    + req(7, 100, 65536, 8, 7)  # block status REQ_ONE
    + req(3, 0, 0, 0, 8)  # flush
    + req(0, 262144 - 10, 20, 0, 9)  # read past the end
    + req(5, 0, 4096, 0, 10)  # cache
    + req(2, 0, 0, 0, 11)  # disc
)
seeds = {
    "raw_go": b"\x00" + struct.pack(">I", 3) + opt(8) + opt(10, s32(b"") + struct.pack(">I", 1) + s32(b"base:allocation"))
    + opt(7, s32(b"disk") + struct.pack(">HHH", 2, 1, 3)) + ops,
    "raw_list_info_abort": b"\x00" + struct.pack(">I", 1) + opt(3) + opt(6, s32(b"zero") + struct.pack(">HH", 1, 2))
    + opt(9, s32(b"") + struct.pack(">I", 1) + s32(b"base:")) + opt(0x99, b"abc") + opt(2),
    "raw_export_name": b"\x00" + struct.pack(">I", 0) + opt(1, b"zero") + req(0, 0, 512) + req(2, 0, 0),
    "go_simple": b"\x01" + ops,
    "go_structured": b"\x02" + ops,
    "export_name": b"\x03" + ops,
    "go_structured_strict": b"\x06" + req(1, 0, 4096, 0, 1, bytes((i * 7919) % 251 for i in range(4096))) + ops,
}
for name, data in seeds.items():
    with open(os.path.join(here, name), "wb") as f:
        f.write(data)
print(f"wrote {len(seeds)} seeds to {here}")
