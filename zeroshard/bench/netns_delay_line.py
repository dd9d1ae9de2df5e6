"""A delay line between two TAP devices, for kernels without the netem qdisc (``SlowLink`` in
netns_link.py, Note [delay line]). Standard library only and run by path, as root:

    python netns_delay_line.py TAP_A TAP_B DELAY_MS

creates the two TAP devices (not persistent: they vanish when this process ends), prints
``ready``, then forwards every Ethernet frame read from one to the other ``DELAY_MS`` later.
Each line on stdin is a new delay in ms; end of stdin (the harness gone) ends it.

Note [delay line]: without netem no qdisc can hold a packet for a time, so the harness moves
the frames through this process: node 0's link is one TAP, node 1's the other, and a frame
leaves the first (after its ``tbf`` rate shaping, which works on a TAP as on a veth) to be
written into the second once its delay has passed. The TAPs carry 65000-byte frames (their
MTU is raised), so a Gbit/s is a few thousand frames a second; on a loaded 2-core machine the
scheduling of this process adds its own latency and caps the rate (measured by the probe, not
assumed). Two nodes only (there is no switching)."""
from __future__ import annotations

import fcntl
import heapq
import os
import select
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000


def open_tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def main(a_name: str, b_name: str, delay_ms: float) -> int:
    # Normal priority whatever the caller's niceness: a delay line scheduled late adds its own
    # delay (measured at nice 5 on the loaded 2-core machine: 0.5 ms asked gave 2.5 ms round trips)
    os.setpriority(os.PRIO_PROCESS, 0, 0)
    a, b = open_tap(a_name), open_tap(b_name)
    peer = {a: b, b: a}
    delay = delay_ms / 1000
    stdin = sys.stdin.fileno()
    os.set_blocking(stdin, False)
    print("ready", flush=True)
    poll = select.poll()
    for fd in (a, b, stdin):
        poll.register(fd, select.POLLIN)
    queue: list[tuple[float, int, int, bytes]] = []
    seq, pending = 0, b""
    while True:
        # poll() sleeps whole milliseconds (rounded up): a frame due sooner is waited for in
        # steps of 0.2 ms between polls that do not wait, so a 0.1 ms delay stays 0.1 ms
        remaining = queue[0][0] - time.monotonic() if queue else 1.0
        timeout_ms = 0.0
        if remaining >= 0.002:
            timeout_ms = (remaining - 0.001) * 1000
        elif remaining > 0:
            time.sleep(min(remaining, 0.0002))
        for fd, _ in poll.poll(timeout_ms):
            if fd == stdin:
                chunk = os.read(stdin, 4096)
                if not chunk:
                    return 0  # (the harness is gone: the TAPs go with this process)
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip():
                        delay = float(line) / 1000
                continue
            while True:
                try:
                    frame = os.read(fd, 70000)
                except BlockingIOError:
                    break
                seq += 1
                heapq.heappush(queue, (time.monotonic() + delay, seq, peer[fd], frame))
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, _, fd, frame = heapq.heappop(queue)
            try:
                os.write(fd, frame)
            except OSError:  # (a device not up yet, or a full queue: a dropped frame, as on a wire)
                pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
