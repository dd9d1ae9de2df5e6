"""The memory chart: one stacked bar per (world size, configuration), one colour per
category, and the ZeRO formula's model states as a black tick on each bar."""
from __future__ import annotations

from typing import Sequence

CATEGORY_COLOURS = {"parameters": "#4c72b0", "gradients": "#dd8452", "master_weights": "#55a868",
                    "optimizer_states": "#c44e52", "buffers": "#8172b3"}


def memory_chart(rows: Sequence[dict], path: str, title: str) -> str:
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("the chart needs matplotlib: pip install 'zeroshard[bench]'") from exc
    matplotlib.use("Agg")  # files only; never open a window
    import matplotlib.pyplot as plt

    ok = [r for r in rows if not r.get("error")]
    if not ok:
        raise RuntimeError("no configuration ran, so there is nothing to chart")
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(ok) + 2), 4.5))
    x = range(len(ok))
    bottom = [0.0] * len(ok)
    for cat, colour in CATEGORY_COLOURS.items():
        values = [r.get(cat, 0) / 2**20 for r in ok]
        ax.bar(x, values, bottom=bottom, color=colour, label=cat.replace("_", " "), width=0.7)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.scatter(x, [r["theory_model_states"] / 2**20 for r in ok], marker="_", s=600, color="black",
               linewidths=2, label="ZeRO formula (model states)", zorder=3)
    ax.set_xticks(list(x))
    ax.set_xticklabels([f"{r['config'].replace('stage ', 's')}\nN={r['world_size']}" for r in ok], fontsize=8)
    ax.set_ylabel("MiB per rank")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
