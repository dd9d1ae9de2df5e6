"""Test tiers and session set-up.

- Full tier (CI, ``bash .ci/run``): every test.
- Quick tier (``bash .ci/run --quick`` or ``python -m pytest --quick tests``): one or a few
  representative tests per feature, listed in tests/quick_tier.txt, a few minutes on 2 cores.
  A test file with no entry there is represented by its first test, so a new file is never
  left out; an entry that names no collected test is an error (a rename must update the list).
- The native kernels are built (or loaded from the cache) once before the first test, with the
  loader's progress lines on the terminal, so no single test pays a first-use compile inside
  its timeout.
"""
from __future__ import annotations

import contextlib
import os
import pathlib

import pytest

from tests.support import background_mypy

# Each test rank gets its share of the cores; collectives time out instead of hanging CI.
os.environ.setdefault("ZEROSHARD_PG_TIMEOUT", "120")
# Ranks fork from one server that imported torch once (Note [start method] in zeroshard/testing/launch.py).
os.environ.setdefault("ZEROSHARD_START_METHOD", "forkserver")
# ... and imported the Hugging Face models the workers build once too (2 s of CPU per rank otherwise;
# the server skips one that is not installed).
os.environ.setdefault("ZEROSHARD_FORKSERVER_PRELOAD",
                      "transformers.models.gpt2.modeling_gpt2,transformers.models.llama.modeling_llama")

_HERE = os.path.dirname(os.path.abspath(__file__))
# (ZEROSHARD_QUICK_TIER: another list, for tests/unit/test_ci_setup.py)
QUICK_TIER_FILE = os.environ.get("ZEROSHARD_QUICK_TIER") or os.path.join(_HERE, "quick_tier.txt")
_DIST = pathlib.Path(_HERE, "dist").resolve()


def pytest_ignore_collect(collection_path: pathlib.Path, config: pytest.Config) -> bool | None:
    """tests/dist/ (the multi-rank tests) is collected: pytest's default ``norecursedirs`` skips any
    folder named ``dist`` (a build output). ``--ignore tests/dist`` still skips it."""
    if collection_path == _DIST and not any(pathlib.Path(p).resolve() == _DIST
                                            for p in config.getoption("ignore") or []):
        return False
    return None


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--quick", action="store_true", default=False,
                     help="run only the quick tier: the tests listed in tests/quick_tier.txt (plus the first "
                          "test of any test file it does not mention)")


def read_quick_tier(path: str = QUICK_TIER_FILE) -> list[str]:
    """The node ids of the quick tier (``#`` starts a comment). An id without ``[...]`` selects
    every parametrization of that test; ``tests/unit/test_x.py`` alone selects the whole file."""
    entries = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            entry = line.split("#", 1)[0].strip()
            if entry:
                entries.append(entry)
    return entries


def _selected(nodeid: str, entry: str) -> bool:
    return nodeid == entry or nodeid.startswith((entry + "[", entry + "::"))


def _whole_files(config: pytest.Config, items: list[pytest.Item]) -> set[str]:
    """The collected test files that were collected whole (named as a file or a directory on
    the command line, not through a node id), so every quick-tier entry in them must match."""
    roots = [os.path.abspath(str(a)) for a in config.args if "::" not in str(a)]
    out = set()
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        full = os.path.join(str(config.rootpath), path)
        if any(full == r or full.startswith(os.path.join(r, "")) for r in roots):
            out.add(path)
    return out


def _check_quick_tier(config: pytest.Config, items: list[pytest.Item], files: set[str]) -> None:
    entries = read_quick_tier()
    unused = [e for e in entries if e.split("::", 1)[0] in files and not any(_selected(i.nodeid, e) for i in items)]
    if unused:
        raise pytest.UsageError(f"tests/quick_tier.txt names tests that were not collected (renamed or removed?): "
                                f"{unused}; update the list")


@pytest.hookimpl(tryfirst=True)  # (before -k/-m/--deselect narrow the items)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("quick"):
        # Every run (CI's full tier too) checks the entries of the files it collected whole, so
        # a renamed test cannot leave `--quick` broken until someone runs it (issue 39).
        _check_quick_tier(config, items, _whole_files(config, items))
        return
    entries = read_quick_tier()
    _check_quick_tier(config, items, {item.nodeid.split("::", 1)[0] for item in items})
    keep: list[pytest.Item] = []
    represented: set[str] = set()
    first_of_file: dict[str, pytest.Item] = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        first_of_file.setdefault(path, item)
        if any(_selected(item.nodeid, e) for e in entries):
            keep.append(item)
            represented.add(path)
    unlisted = [first_of_file[p] for p in first_of_file if p not in represented]
    keep_ids = {i.nodeid for i in keep} | {i.nodeid for i in unlisted}
    config.hook.pytest_deselected(items=[i for i in items if i.nodeid not in keep_ids])
    items[:] = [i for i in items if i.nodeid in keep_ids]  # collection order (module fixtures stay shared)
    if unlisted:
        config._quick_unlisted = sorted(p for p in first_of_file if p not in represented)  # type: ignore[attr-defined]


def pytest_report_header(config: pytest.Config) -> str | None:
    if config.getoption("quick"):
        return f"quick tier: tests/quick_tier.txt ({len(read_quick_tier())} entries)"
    return None


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    unlisted = getattr(config, "_quick_unlisted", None)
    if unlisted:
        terminalreporter.write_line(f"quick tier: {len(unlisted)} test file(s) have no entry in tests/quick_tier.txt "
                                    f"and ran their first test only: {', '.join(unlisted)}")


def pytest_collection_finish(session: pytest.Session) -> None:
    # After collection (so --collect-only stays instant): build or load the kernels once.
    if session.config.option.collectonly or not session.items:
        return
    if len(session.items) > 1 and any(i.nodeid == background_mypy.MYPY_TEST for i in session.items):
        background_mypy.start()  # Note [mypy in the background]
    capman = session.config.pluginmanager.getplugin("capturemanager")
    with capman.global_and_fixture_disabled() if capman else contextlib.nullcontext():
        from zeroshard.io._native import native
        from zeroshard.ops._loader import REGISTRY

        REGISTRY.cpu()
        native()


def pytest_unconfigure(config: pytest.Config) -> None:
    background_mypy.stop()
