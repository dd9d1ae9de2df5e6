"""``python -m zeroshard.ops``: print which kernels are active and why the others are not."""
from __future__ import annotations

import sys

from ._status import kernel_status

_ISAS = ("avx512", "avx2", "scalar")


def main() -> int:
    status = kernel_status()
    for name in ("cpu_adam", "cuda_adam"):
        info = status[name]
        state = "ACTIVE" if info["active"] else "inactive"
        print(f"{name:10s} {state:8s} source={info['source']}: {info['reason']}")
        if "isa" in info:
            print(f"{'':10s} isa={info['isa']} dispatched, threads={info['threads']}")
            for isa in _ISAS:
                if isa == info["isa"]:
                    continue
                why = ("supported, not chosen (preference avx512 > avx2 > scalar, capped by ZEROSHARD_CPU_ISA)"
                       if isa in info["supported_isas"] else "not supported by this CPU")
                print(f"{'':10s} {isa}: {why}")
    print(f"jit cache  {status['cache_dir']}")
    print(f"fallback   {status['fallback']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
