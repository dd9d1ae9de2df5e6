"""``python -m zeroshard.io``: print which I/O backend is active and why."""
from __future__ import annotations

import sys

from .status import engine_status


def main() -> int:
    s = engine_status()
    n = s["native"]
    print(f"backend    {s['backend']}")
    print(f"native     {'ACTIVE' if n['available'] else 'inactive'} source={n['source']} "
          f"engine={n['engine']}: {n['reason']}")
    print(f"fallback   {s['fallback']}")
    d = s["direct_io"]
    print(f"O_DIRECT   {'available' if d['supported_by_platform'] else 'not on this platform'}")
    for dev, why in d["refused_by"].items():
        print(f"           device {dev}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
