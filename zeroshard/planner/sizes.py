"""Reading and printing byte and parameter counts ("80GB", "1.5TiB", "124M")."""
from __future__ import annotations

import re

_BYTE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_COUNT_UNITS = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*$")


def _parse(text: str | int | float, units: dict[str, int], what: str, examples: str) -> int:
    if isinstance(text, (int, float)):
        return int(text)
    m = _NUMBER.match(text)
    unit = m.group(2).upper() if m else None
    if m is None or unit not in units:
        raise ValueError(f"cannot read {text!r} as {what}; write e.g. {examples}")
    return int(float(m.group(1)) * units[unit])


def parse_bytes(text: str | int | float) -> int:
    """``"80GB"`` -> 80e9, ``"24GiB"`` -> 24·2³⁰, a bare number is bytes."""
    return _parse(text, _BYTE_UNITS, "a size", "'80GB', '24GiB' or '512MiB'")


def parse_count(text: str | int | float) -> int:
    """``"124M"`` -> 124_000_000, ``"7B"`` -> 7e9, a bare number is a count."""
    return _parse(text, _COUNT_UNITS, "a parameter count", "'124M', '7B' or 350000000")


def fmt_bytes(n: float) -> str:
    """Binary units, three significant digits: what a person compares with ``free -h``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"
