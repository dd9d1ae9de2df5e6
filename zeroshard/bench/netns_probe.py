"""What a shaped link really does, measured across it: the round trip of one byte and the time
of a bulk transfer (``SlowLink`` in netns_link.py). Standard library only and run by path
(``python netns_probe.py serve|send ...`` inside a namespace), so no torch import slows it.

``serve HOST PORT``: accept one connection, echo single bytes, then read a bulk transfer and
acknowledge it. ``send HOST PORT PINGS NBYTES``: print JSON ``{"rtt_s": [...], "bulk_s": t}``,
``t`` from the first bulk byte sent to the acknowledgement (one round trip included)."""
from __future__ import annotations

import json
import os
import socket
import struct
import sys
import time
from typing import Sequence


def _exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(1 << 20, n - len(buf)))
        if not chunk:
            raise ConnectionError(f"peer closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def serve(host: str, port: int) -> None:
    with socket.create_server((host, port)) as srv:
        srv.settimeout(60)
        conn, _ = srv.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pings, nbytes = struct.unpack("!IQ", _exact(conn, 12))
            for _ in range(pings):
                conn.sendall(_exact(conn, 1))
            left = nbytes
            while left:
                chunk = conn.recv(min(1 << 20, left))
                if not chunk:
                    raise ConnectionError(f"peer closed with {left} bytes to come")
                left -= len(chunk)
            conn.sendall(b"k")


def _connect(host: str, port: int, within_s: float = 20.0) -> socket.socket:
    deadline = time.monotonic() + within_s
    while True:
        try:
            return socket.create_connection((host, port), timeout=60)
        except OSError:  # (the server may not listen yet)
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def send(host: str, port: int, pings: int, nbytes: int) -> dict:
    with _connect(host, port) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(struct.pack("!IQ", pings, nbytes))
        rtts = []
        for _ in range(pings):
            t0 = time.perf_counter()
            sock.sendall(b"p")
            _exact(sock, 1)
            rtts.append(time.perf_counter() - t0)
        block = os.urandom(1 << 20)
        t0 = time.perf_counter()
        left = nbytes
        while left:
            n = min(len(block), left)
            sock.sendall(block[:n])
            left -= n
        _exact(sock, 1)
        return {"rtt_s": rtts, "bulk_s": time.perf_counter() - t0, "bytes": nbytes}


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] not in ("serve", "send"):
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] == "serve":
        serve(argv[1], int(argv[2]))
    else:
        print(json.dumps(send(argv[1], int(argv[2]), int(argv[3]), int(argv[4]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
