"""``python -m zeroshard.ops``: print which kernels are active and why the others are not."""
from __future__ import annotations

import sys

from ._status import kernel_status


def main() -> int:
    status = kernel_status()
    for name in ("cpu_adam", "cuda_adam"):
        info = status[name]
        state = "ACTIVE" if info["active"] else "inactive"
        print(f"{name:10s} {state:8s} source={info['source']}: {info['reason']}")
        if "isa" in info:
            print(f"{'':10s} isa={info['isa']} (supported: {', '.join(info['supported_isas'])}), "
                  f"threads={info['threads']}")
    print(f"jit cache  {status['cache_dir']}")
    print(f"fallback   {status['fallback']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
