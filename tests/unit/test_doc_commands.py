"""Every ``python benchmarks/...`` / ``python examples/...`` command in the docs names a script
that exists and, where the script has an argparse parser, parses with it (one subprocess runs
each script's own parser on the documented arguments and stops there: nothing is measured).
A documented command that fails before it runs (issue 39: ``bench_stage3_overhead.py``'s
default ``--modes`` was refused by its own parser) fails here."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

from tests.support.doc_commands import ROOT, doc_commands, uses_argparse

# Scripts the docs run that read sys.argv themselves (no parser to check): the reason each
# cannot be checked here, so a new one is a decision, not an accident.
NO_PARSER = {
    "benchmarks/check_compile_dropout.py": "takes one positional backend name from sys.argv",
    "benchmarks/check_compile_offload_inductor.py": "takes one optional word (fallback) from sys.argv",
    "benchmarks/profile_tier_commit.py": "takes one optional number (steps) from sys.argv",
}


def test_documented_commands_parse():
    commands = doc_commands()
    assert len(commands) >= 10, commands  # (the extraction found the docs' commands)
    missing = [(where, argv[0]) for where, argv in commands if not os.path.exists(os.path.join(ROOT, argv[0]))]
    assert not missing, f"documented scripts that do not exist: {missing}"
    unchecked = sorted({argv[0] for _, argv in commands if not uses_argparse(argv[0])} - set(NO_PARSER))
    assert not unchecked, f"documented scripts without an argparse parser (add to NO_PARSER with a reason): {unchecked}"
    todo = [argv for _, argv in commands if uses_argparse(argv[0])]
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "support", "doc_commands.py")], input=json.dumps(todo),
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-3000:]
    verdicts = json.loads(out.stdout.strip().splitlines()[-1])
    where = {shlex.join(argv): w for w, argv in commands}
    bad = {f"{where[c]}: {c}": v for c, v in verdicts.items() if v != "parsed"}
    assert not bad, json.dumps(bad, indent=1)


def test_stage3_overhead_selects_every_default_placement():
    """The documented command with its default --modes (one placement is named "auto, half the
    state", with a comma: the script's own parser used to refuse its default), as a dry run."""
    script = os.path.join(ROOT, "benchmarks", "bench_stage3_overhead.py")
    out = subprocess.run([sys.executable, script, "--layers", "12", "--steps", "7", "--dir", "DIR", "--dry-run"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-3000:]
    runs = [line.split(":", 1)[0] for line in out.stdout.splitlines()]
    assert runs == ["plain", "stage 3", "auto, half the state", "all NVMe"], out.stdout
    short = subprocess.run([sys.executable, script, "--modes", "stage3,auto-half", "--dry-run"], capture_output=True,
                           text=True, timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert [line.split(":", 1)[0] for line in short.stdout.splitlines()] == ["plain", "stage 3",
                                                                            "auto, half the state"], short.stderr
