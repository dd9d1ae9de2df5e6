"""Process memory as the OS sees it: current RSS (psutil) and the peak since the last reset.

The peak is the kernel's high-water mark (``VmHWM`` in /proc/self/status), which can be reset
by writing 5 to /proc/self/clear_refs (Linux >= 4.0). That lets one process measure several
configurations in turn, each with its own peak, instead of paying a new process (and a torch
import) per configuration.
"""
from __future__ import annotations

import re

import psutil

_HWM = re.compile(r"VmHWM:\s+(\d+)\s+kB")


def current_rss() -> int:
    return psutil.Process().memory_info().rss


def reset_peak_rss() -> bool:
    """True if the peak now starts from the current RSS; False where the OS cannot reset it
    (the peak then covers the process's whole life, and the tables say so)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss() -> int:
    """Peak RSS in bytes since the last reset (or since the process started)."""
    try:
        with open("/proc/self/status") as f:
            m = _HWM.search(f.read())
        if m:
            return int(m.group(1)) * 1024
    except OSError:
        pass
    import resource  # not Linux: ru_maxrss is the whole life's peak (KiB on most systems)

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
