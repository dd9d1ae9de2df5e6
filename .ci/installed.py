"""Exit 0 when this virtualenv already holds what `.ci/run` would install (the pinned torch,
this checkout installed editable, and every requirement of its "test" extra), else print what
is missing and exit 1. Lets `bash .ci/run` after the README's first command skip a silent,
minutes-long `pip install` (issue 39)."""
from __future__ import annotations

import importlib.metadata as md
import os
import sys

try:
    from packaging.requirements import Requirement
except ImportError:  # (pip vendors packaging)
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]

TORCH = sys.argv[1] if len(sys.argv) > 1 else "2.13.0"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def missing() -> list[str]:
    out = []
    try:
        if md.version("torch").split("+")[0] != TORCH:
            out.append(f"torch=={TORCH} (have {md.version('torch')})")
    except md.PackageNotFoundError:
        return [f"torch=={TORCH}"]
    try:
        dist = md.distribution("zeroshard")
    except md.PackageNotFoundError:
        return out + ["zeroshard (this checkout, editable)"]
    import importlib.util
    found = importlib.util.find_spec("zeroshard")  # (where it would import from; importing it costs seconds)
    origin = found.origin if found is not None and found.origin else "nowhere"
    if not os.path.abspath(origin).startswith(os.path.join(ROOT, "")):
        out.append(f"zeroshard from {ROOT} (this venv imports {origin})")
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": "test"}):
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            out.append(str(req))
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            out.append(f"{req} (have {have})")
    return out


if __name__ == "__main__":
    gaps = missing()
    if gaps:
        print("ci: to install: " + ", ".join(gaps), file=sys.stderr)
    sys.exit(1 if gaps else 0)
