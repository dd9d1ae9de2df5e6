"""The peers' suites ported (tests/support/conformance/cases.py), each case at world 1 and 2 (4 where
the original uses 4), every case of a world in one gloo group. Issue 12's counts:
``python -m pytest -q tests/dist/test_ported_peer_suites.py -rs``."""
from __future__ import annotations

import pytest

from tests.support.conformance import cases
from tests.support.dist_results import run_ranks

ITEMS = [(name, world) for name, (_, worlds, _) in cases.CASES.items() for world in worlds]


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    cache: dict[int, list[dict]] = {}

    def get(world: int) -> list[dict]:
        if world not in cache:
            names = [n for n, w in ITEMS if w == world]
            cache[world] = run_ranks(cases.run, world, tmp_path_factory.mktemp(f"conf{world}"), names)
        return cache[world]
    return get


@pytest.mark.parametrize("name,world", ITEMS, ids=[f"{n}-w{w}" for n, w in ITEMS])
def test_ported_case(verdicts, name, world):
    if name in cases.KNOWN_FAILING:
        pytest.xfail(cases.KNOWN_FAILING[name])
    for rank, result in enumerate(verdicts(world)):
        assert result[name] == "pass", f"{cases.CASES[name][0]} (rank {rank}):\n{result[name]}"


@pytest.mark.parametrize("original", sorted(cases.NOT_APPLICABLE))
def test_not_applicable(original):
    pytest.skip(f"n/a: {cases.NOT_APPLICABLE[original]}")
