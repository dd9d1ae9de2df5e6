"""The sweep's table for docs/results.md, from the ranks' JSON results of
``quant_sweep_worker.sweep_worker`` (``python -m tests.support.quant_sweep_table res.rank0``):
per (mesh, stage, offload) context, how many codec combinations ran and which message refused
the others."""
from __future__ import annotations

import json
import sys
from collections import Counter, defaultdict

from tests.support.quant_sweep_worker import combinations


def table(results: dict) -> str:
    rows: dict[tuple[str, int, str], Counter] = defaultdict(Counter)
    for name, mesh, stage, offload, _, _, _ in combinations():
        cell = results[name]
        verdict = "crash: " + cell["crash"] if "crash" in cell else (
            "ran" if cell["ran"] else f"refused ({cell['type']}): {cell['message'].split(';')[0].split(' (')[0]}")
        rows[(mesh, stage, offload)][verdict] += 1
    lines = ["| mesh | stage | offload | combinations -> verdict |", "|---|---|---|---|"]
    for (mesh, stage, offload), verdicts in rows.items():
        said = "; ".join(f"{n} {v}" for v, n in sorted(verdicts.items()))
        lines.append(f"| {mesh} | {stage} | {offload} | {said} |")
    total = Counter(v.split(" (")[0].split(":")[0] for c in rows.values() for v in c.elements())
    lines.append("")
    lines.append(f"Total {sum(total.values())}: " + ", ".join(f"{n} {v}" for v, n in sorted(total.items())))
    named = [k for k in results if k.startswith(("ds-", "ef-"))]
    lines += ["", "| named case | verdict |", "|---|---|"]
    for k in named:
        c = results[k]
        lines.append(f"| {k} | " + ("ran: " + ", ".join(c["report"]) if c["ran"] else
                                    f"refused ({c['type']}): {c['message']}") + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        data = json.load(f)
    print(table(data[0] if isinstance(data, list) else data))
