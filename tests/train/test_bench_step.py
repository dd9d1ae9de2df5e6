"""``bench step``: a small real run against a peer (ratios and memory from one session), the
checks it reports, and how a peer that cannot run is shown."""
from __future__ import annotations

import pytest

from zeroshard.bench import step
from zeroshard.bench.models import ModelSource


def test_small_run_against_zero_redundancy_optimizer() -> None:
    bench = step.StepBench(ModelSource.parse("tiny"), ("zeroshard_stage2", "ddp_zero1"),
                           world_size=2, rounds=1, steps=1, global_batch=4)
    result = step.run(bench, log=lambda _: None)
    rows = {r["config"]: r for r in result["rows"]}
    assert not any("error" in r for r in rows.values()), rows
    # tensor accounting, fp32 AdamW on 2 ranks: stage 2 = 4 + 4/2 + 8/2 bytes/param, ZeRO-1 = 4 + 4 + 8/2
    n = result["params"]
    assert rows["zeroshard_stage2"]["memory_bytes"] == pytest.approx(10 * n, rel=0.02)
    assert rows["ddp_zero1"]["memory_bytes"] == pytest.approx(12 * n, rel=0.02)
    assert rows["zeroshard_stage2"]["step_s"] > 0 and rows["zeroshard_stage2"]["vs_ddp"] is None
    names = [c["check"] for c in result["checks"]]
    assert any("ZeroRedundancyOptimizer" in c for c in names) and any("fastest peer" in c for c in names)
    # The memory check, not the step-time one (a 1-step tiny run's timing is noise, reported only).
    assert next(c for c in result["checks"] if "≤ ZeroRedundancyOptimizer" in c["check"])["passed"]


def test_report_says_why_a_peer_could_not_run() -> None:
    rows = [{"config": "single", "step_s": 1.0, "memory_bytes": 16, "peak_rss": 1, "vs_single": 1.0, "vs_ddp": None},
            {"config": "zeroshard_stage2", "step_s": 0.5, "memory_bytes": 10, "peak_rss": 1, "vs_single": 0.5},
            {"config": "fsdp2", "step_s": 0.6, "memory_bytes": 8, "peak_rss": 1, "vs_single": 0.6},
            {"config": "ddp_zero1", "step_s": 0.52, "memory_bytes": 12, "peak_rss": 1, "vs_single": 0.52},
            {"config": "deepspeed_stage2", "error": "ModuleNotFoundError: No module named 'deepspeed'"}]
    checks = step.checks(rows)
    fastest = next(c for c in checks if "fastest peer" in c["check"])
    assert "(ddp_zero1)" in fastest["check"] and fastest["passed"]  # fsdp2 holds less memory: not compared
    result = {"model": "m", "params": 1, "global_batch": 4, "seq_len": 8, "world_size": 2, "rounds": 1,
              "steps": 1, "machine": "here", "rows": rows, "checks": checks}
    text = step.report_markdown(result)
    assert "| deepspeed_stage2 | could not run: ModuleNotFoundError: No module named 'deepspeed' |" in text
    assert step._reason(RuntimeError("2 of 2 ranks failed\n--- rank 0 ---\nTraceback\nValueError: bad | x")) \
        == "ValueError: bad / x"


def test_bad_settings_name_the_fix() -> None:
    with pytest.raises(ValueError, match="choose from"):
        step.StepBench(ModelSource.parse("tiny"), ("megatron",))
    with pytest.raises(ValueError, match="does not split"):
        step.StepBench(ModelSource.parse("tiny"), world_size=3, global_batch=8)
