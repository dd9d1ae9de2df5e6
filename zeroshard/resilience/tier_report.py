"""What a memory tier's directory holds, for ``zeroshard inspect <tier root>``: every slot (whose
state, which step and world size, which run, its bytes, whether its checksum holds) and the
steps the slots cover together (Note [peer memory tier] in zeroshard/resilience/memory_tier.py)."""
from __future__ import annotations

import os

from zeroshard.resilience import slots


def is_tier_root(path: str) -> bool:
    """``path`` holds a memory tier (``rank-<r>/own`` or ``rank-<r>/replica-<s>`` slot pairs)."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(n.startswith("rank-") and os.path.isdir(os.path.join(path, n, "own")) for n in names)


def describe(root: str) -> dict:
    """Every stamped slot under ``root`` with its checksum verified, and the covered steps."""
    found = []
    for rdir in sorted(os.listdir(root)):
        base = os.path.join(root, rdir)
        if not rdir.startswith("rank-") or os.path.islink(base) or not os.path.isdir(base):
            continue
        for sub in sorted(os.listdir(base)):
            if sub not in ("own", "parity") and not sub.startswith("replica-"):
                continue
            for name in slots.SLOTS:
                path = os.path.join(base, sub, name)
                stamp = slots.read_stamp(path)
                if stamp is None:
                    continue
                problem = None
                try:
                    slots.read(slots.SlotInfo(path, stamp, None))
                except (OSError, ValueError, KeyError, TypeError) as exc:
                    problem = str(exc)
                copy = sub if sub in ("own", "parity") else "replica"  # (parity: Note [parity memory tier])
                found.append({"path": path, "holder": rdir, "copy": copy,
                              "owner": stamp.get("owner"), "step": stamp.get("step"),
                              "world_size": stamp.get("world_size"), "run_id": stamp.get("run_id"),
                              "bytes": slots.slot_bytes(path), "valid": problem is None, "problem": problem,
                              "every": stamp.get("every"), "commit_cost": stamp.get("commit_cost"),
                              "parity_group": stamp.get("parity_group"), "rebuilt": stamp.get("rebuilt") is True})
    cover: dict[tuple, set] = {}
    for s in found:
        if s["valid"] and s["copy"] != "parity":  # (a parity slot's owner is its holder: it covers no one's state)
            cover.setdefault((s["run_id"], s["step"], s["world_size"]), set()).add(s["owner"])
    steps = [{"run_id": run, "step": step, "world_size": n, "owners": sorted(o),
              "complete": set(range(n)) <= o if isinstance(n, int) else False}
             for (run, step, n), o in sorted(cover.items(), key=lambda kv: (str(kv[0][0]), kv[0][1]))]
    return {"root": root, "slots": found, "steps": steps, "bytes": sum(s["bytes"] for s in found)}
