"""Writing result rows (dicts) as Markdown and CSV, with the columns chosen by the caller."""
from __future__ import annotations

import csv
import io
from typing import Any, Callable, Sequence

Column = tuple[str, str, Callable[[Any], str]]
"""(header, key in the row, how to print the value)."""


def mib(v: Any) -> str:
    return "" if v is None or v == "" else f"{v / 2**20:.2f}"


def ratio(v: Any) -> str:
    return "" if v is None or v == "" else f"{v:.3f}"


def text(v: Any) -> str:
    return "" if v is None else str(v)


def markdown(rows: Sequence[dict], columns: Sequence[Column], keys: int = 2) -> str:
    """One line per row; a row with an ``error`` prints its first ``keys`` cells and then,
    in one cell, why it could not run, instead of a row of blanks."""
    out = ["| " + " | ".join(h for h, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        if r.get("error"):
            head = [fmt(r.get(k)) for _, k, fmt in columns[:keys]]
            why = str(r["error"]).replace("|", "/")
            out.append("| " + " | ".join(head) + f" | could not run: {why} |" + " |" * (len(columns) - keys - 1))
            continue
        out.append("| " + " | ".join(fmt(r.get(k)) for _, k, fmt in columns) + " |")
    return "\n".join(out)


def csv_text(rows: Sequence[dict]) -> str:
    """Every key of every row, raw values (bytes, seconds): for plotting and diffing."""
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=keys, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: r.get(k, "") for k in keys})
    return buf.getvalue()
