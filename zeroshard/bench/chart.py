"""The memory chart: one panel per world size, one stacked bar per configuration (a colour per
category, NVMe-resident state hatched on top), and the ZeRO formula's model states as a black
tick on each bar."""
from __future__ import annotations

from typing import Sequence

CATEGORY_COLOURS = {"parameters": "#4c72b0", "gradients": "#dd8452", "master_weights": "#55a868",
                    "optimizer_states": "#c44e52", "buffers": "#8172b3"}


def short_label(config: str) -> str:
    """``stage 3 + optim→nvme + params→cpu`` -> ``s3 o:nvme p:cpu`` (fits under a bar)."""
    return (config.replace("stage ", "s").replace(" + optim→", "\no:").replace(" + params→", "\np:")
            .replace(" + act-ckpt", "\nckpt"))


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
    worlds = sorted({r["world_size"] for r in ok})
    widest = max(sum(r["world_size"] == w for r in ok) for w in worlds)
    fig, axes = plt.subplots(1, len(worlds), sharey=True, squeeze=False,
                             figsize=(max(6.0, 0.75 * widest * len(worlds) + 1.5), 4.8))
    for ax, world in zip(axes[0], worlds):
        panel = [r for r in ok if r["world_size"] == world]
        x = list(range(len(panel)))
        bottom = [0.0] * len(panel)
        for cat, colour in CATEGORY_COLOURS.items():
            values = [r.get(cat, 0) / 2**20 for r in panel]
            ax.bar(x, values, bottom=bottom, color=colour, label=cat.replace("_", " "), width=0.75)
            bottom = [b + v for b, v in zip(bottom, values)]
        nvme = [r.get("offloaded", 0) / 2**20 for r in panel]
        if any(nvme):
            ax.bar(x, nvme, bottom=bottom, color="white", edgecolor="grey", hatch="//", width=0.75,
                   label="on NVMe (not in memory)")
        ax.scatter(x, [r["theory_model_states"] / 2**20 for r in panel], marker="_", s=500, color="black",
                   linewidths=2, label="ZeRO formula (model states)", zorder=3)
        ax.set_xticks(x)
        ax.set_xticklabels([short_label(r["config"]) for r in panel], fontsize=7)
        ax.set_title(f"world size {world}", fontsize=9)
    axes[0][0].set_ylabel("MiB per rank")
    handles, labels = axes[0][-1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=4, fontsize=8, bbox_to_anchor=(0.5, 0.93))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.86))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
