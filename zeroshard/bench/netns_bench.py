"""``zeroshard bench link``: step time of stage-3 sharding scopes over a shaped link between
namespaces on one machine (netns_link.py), as ratios against flat stage 3 in the same job.

One ``SlowLink`` for the whole sweep; at each (rate, delay) point the link is reshaped, probed
(round trip, bulk throughput: the link as measured, not as asked) and one job runs every
configuration, steps interleaved by round (netns_worker.py). The step time of a configuration
is the median over its timed steps of the slowest rank's barrier-to-barrier time."""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from zeroshard.bench.netns_launch import launch, probe
from zeroshard.bench.netns_link import LinkSpec, SlowLink, netem_available
from zeroshard.bench.netns_worker import SCOPES

BASELINE = "flat"


@dataclass(frozen=True)
class RunConfig:
    """One configuration of the job: a label, a sharding scope, extra ``ZeroOptimizer`` kwargs."""

    label: str
    scope: str
    kwargs: dict[str, object] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> "RunConfig":
        """``SCOPE``, ``LABEL=SCOPE`` or ``LABEL=SCOPE:{JSON kwargs}``."""
        head, _, raw = text.partition(":")
        label, eq, scope = head.partition("=")
        if not eq:
            scope = label
        kwargs = _json_object(raw, f"--config {text!r}") if raw else {}
        if scope.strip() not in SCOPES:
            raise ValueError(f"--config {text!r}: scope {scope!r} is not one of {', '.join(SCOPES)}")
        return cls(label.strip() or scope, scope.strip(), kwargs)

    def as_job(self) -> dict[str, object]:
        return {"label": self.label, "scope": self.scope, "kwargs": self.kwargs}


def _json_object(raw: str, what: str) -> dict[str, object]:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what}: not JSON ({exc}); write an object such as '{{\"mixed_precision\": \"bf16\"}}'")
    if not isinstance(value, dict):
        raise ValueError(f"{what}: {raw!r} is not a JSON object of ZeroOptimizer keyword arguments")
    return value


@dataclass(frozen=True)
class LinkBench:
    model: dict[str, object]
    """``ModelSource.parse`` arguments: ``name`` and optional ``d_model``, ``layers``, ``seq_len``."""
    configs: tuple[RunConfig, ...]
    rates_gbit: tuple[float, ...] = (10.0, 2.5, 1.0)
    delays_ms: tuple[float, ...] = (0.0,)
    nodes: int = 2
    per_node: int = 2
    steps: int = 3
    rounds: int = 3
    global_batch: int = 8
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        labels = [c.label for c in self.configs]
        if not labels or labels[0] != BASELINE or self.configs[0] != RunConfig(BASELINE, "flat"):
            raise ValueError(f"the first configuration must be the baseline {BASELINE!r} (flat stage 3, full "
                             f"precision, no extra kwargs); got {labels}")
        if len(set(labels)) != len(labels):
            raise ValueError(f"configuration labels repeat: {labels}; name them LABEL=SCOPE[:JSON]")
        if min(self.steps, self.rounds, self.per_node) < 1:
            raise ValueError(f"steps={self.steps}, rounds={self.rounds}, per_node={self.per_node} must be >= 1")
        if self.global_batch % (self.nodes * self.per_node):
            raise ValueError(f"global batch {self.global_batch} does not split over {self.nodes} x {self.per_node} ranks")
        for r in self.rates_gbit:
            for d in self.delays_ms:
                LinkSpec(self.nodes, r, d)  # (refuses a bad point before any namespace exists)


def configurations(specs: list[str], zero_kwargs: Optional[str]) -> tuple[RunConfig, ...]:
    """The baseline first, then ``specs`` (``RunConfig.parse``), each given ``zero_kwargs`` (a
    JSON object) under its own kwargs: the baseline stays flat stage 3 in full precision."""
    common = _json_object(zero_kwargs, "--zero-kwargs") if zero_kwargs else {}
    configs = [RunConfig(BASELINE, "flat")]
    for s in specs:
        c = RunConfig.parse(s)
        if c != configs[0]:
            configs.append(RunConfig(c.label, c.scope, {**common, **c.kwargs}))
    return tuple(configs)


def run_job(link: SlowLink, bench: LinkBench, out: str) -> list[dict]:
    """One job of every configuration across the link as shaped now: each rank's result."""
    job = {"model": bench.model, "global_batch": bench.global_batch, "steps": bench.steps, "rounds": bench.rounds,
           "nodes": bench.nodes, "per_node": bench.per_node, "configs": [c.as_job() for c in bench.configs],
           "out": out}
    path = os.path.join(out, "job.json")
    os.makedirs(out, exist_ok=True)
    with open(path, "w") as f:
        json.dump(job, f)
    return launch(link, bench.per_node, "zeroshard.bench.netns_worker", [path], out, bench.timeout_s,
                  run_id=f"zsnet-{os.getpid()}-{time.monotonic_ns()}")


def _point(link: SlowLink, bench: LinkBench, spec: LinkSpec, out: str, log: Callable[[str], None]) -> list[dict]:
    link.shape(spec)
    # about 0.25 s of traffic at the asked rate: long enough that scheduling noise does not set the figure
    measured = probe(link, nbytes=int(min(64 << 20, max(8 << 20, spec.rate_gbit * 1e9 / 8 / 4 or 64 << 20))))
    log(f"link {spec.describe()}: measured {measured['gbit_s']:.2f} Gbit/s, round trip {measured['rtt_ms']:.3f} ms")
    t0 = time.perf_counter()
    ranks = run_job(link, bench, out)
    log(f"  job of {len(ranks)} ranks: {time.perf_counter() - t0:.1f} s")
    nodes_of_ranks = sorted({(r["node"], r["rank"] // bench.per_node) for r in ranks})
    rows = []
    for c in bench.configs:
        per_step = [max(r["configs"][c.label]["times"][i] for r in ranks)
                    for i in range(len(ranks[0]["configs"][c.label]["times"]))]
        rows.append({"rate_gbit": spec.rate_gbit, "delay_ms": spec.delay_ms, "config": c.label, "scope": c.scope,
                     "kwargs": json.dumps(c.kwargs) if c.kwargs else "", "step_s": statistics.median(per_step),
                     "inter_node_bytes": max(r["configs"][c.label]["inter_node"] for r in ranks),
                     "intra_node_bytes": max(r["configs"][c.label]["intra_node"] for r in ranks),
                     "final_loss": ranks[0]["configs"][c.label]["losses"][-1],
                     "measured_gbit_s": measured["gbit_s"], "rtt_ms": measured["rtt_ms"],
                     "node_of_rank_block": nodes_of_ranks})
    base = rows[0]["step_s"]
    for r in rows:
        r["vs_flat"] = r["step_s"] / base
        log(f"  {r['config']}: {r['step_s']:.3f} s/step ({r['vs_flat']:.3f} x flat)")
    return rows


def run(bench: LinkBench, log: Callable[[str], None] = print) -> dict:
    rows: list[dict] = []
    delay_line = any(bench.delays_ms) and not netem_available()  # (Note [delay line])
    with tempfile.TemporaryDirectory(prefix="zsnet-") as tmp, SlowLink(LinkSpec(bench.nodes), delay_line=delay_line) as link:
        for d in bench.delays_ms:
            for r in bench.rates_gbit:
                rows += _point(link, bench, LinkSpec(bench.nodes, r, d), os.path.join(tmp, f"r{r}-d{d}"), log)
    return {"model": bench.model, "nodes": bench.nodes, "per_node": bench.per_node, "steps": bench.steps,
            "rounds": bench.rounds, "global_batch": bench.global_batch,
            "configs": [c.as_job() for c in bench.configs], "rows": rows}


def report_markdown(result: dict) -> str:
    labels = [c["label"] for c in result["configs"]]
    m = result["model"]
    head = (f"TinyGPT preset {m['name']!r}" + "".join(f", {k}={v}" for k, v in m.items() if k != "name" and v)
            + f"; {result['nodes']} namespaces x {result['per_node']} gloo ranks; global batch "
            f"{result['global_batch']}; median of {result['rounds']} rounds x {result['steps']} steps "
            "(slowest rank per step) after a warm-up step; configurations interleaved in one job per link point")
    lines = [head, "", "| link (asked) | measured Gbit/s | round trip ms | flat s/step | "
             + " | ".join(f"{lab} ÷ flat" for lab in labels[1:]) + " |", "|" + "---|" * (3 + len(labels))]
    points: dict[tuple[float, float], dict[str, dict]] = {}
    for r in result["rows"]:
        points.setdefault((r["rate_gbit"], r["delay_ms"]), {})[r["config"]] = r
    for (rate, delay), by in points.items():
        b = by[labels[0]]
        lines.append(f"| {LinkSpec(result['nodes'], rate, delay).describe()} | {b['measured_gbit_s']:.2f} | "
                     f"{b['rtt_ms']:.3f} | {b['step_s']:.3f} | "
                     + " | ".join(f"{by[lab]['vs_flat']:.3f}" for lab in labels[1:]) + " |")
    first = next(iter(points.values()))
    lines += ["", "| configuration | scope | extra kwargs | inter-node MiB/rank/step | intra-node MiB/rank/step |",
              "|---|---|---|---|---|"]
    lines += [f"| {lab} | {first[lab]['scope']} | {first[lab]['kwargs']} | "
              f"{first[lab]['inter_node_bytes'] / 2**20:.2f} | {first[lab]['intra_node_bytes'] / 2**20:.2f} |"
              for lab in labels]
    return "\n".join(lines)
