"""``zeroshard bench link``'s options, refused before any namespace exists: configurations
(``[LABEL=]SCOPE[:JSON]``, the baseline first and full precision, ``--zero-kwargs`` on every
other), link points, and the tc arguments each link shape becomes."""
from __future__ import annotations

import pytest

from zeroshard.bench.netns_bench import LinkBench, RunConfig, configurations
from zeroshard.bench.netns_link import LinkSpec


def test_configurations_parse_and_zero_kwargs_skip_the_baseline():
    assert RunConfig.parse("hpz") == RunConfig("hpz", "hpz")
    assert RunConfig.parse('q=hybrid:{"mixed_precision": "bf16"}') == RunConfig("q", "hybrid", {"mixed_precision": "bf16"})
    c = configurations(["flat", "hpz", 'f8=flat:{"x": 1}'], '{"weight_codec": "int8"}')
    assert [x.label for x in c] == ["flat", "hpz", "f8"]
    assert c[0].kwargs == {} and c[1].kwargs == {"weight_codec": "int8"}
    assert c[2].kwargs == {"weight_codec": "int8", "x": 1}  # (its own kwargs win)


@pytest.mark.parametrize("spec, match", [("ring", "not one of"), ("a=flat:[1]", "not a JSON object"),
                                         ("a=flat:{bad", "not JSON")])
def test_bad_configurations_are_refused_naming_them(spec, match):
    with pytest.raises(ValueError, match=match):
        RunConfig.parse(spec)


def test_bad_benches_and_links_are_refused():
    with pytest.raises(ValueError, match="baseline"):
        LinkBench(model={"name": "tiny"}, configs=(RunConfig("hpz", "hpz"),))
    with pytest.raises(ValueError, match="repeat"):
        LinkBench(model={"name": "tiny"}, configs=configurations(["hpz", "hpz"], None))
    with pytest.raises(ValueError, match="does not split"):
        LinkBench(model={"name": "tiny"}, configs=configurations([], None), global_batch=6)
    with pytest.raises(ValueError, match="rate_gbit"):
        LinkBench(model={"name": "tiny"}, configs=configurations([], None), rates_gbit=(-1.0,))
    with pytest.raises(ValueError, match="nodes"):
        LinkSpec(nodes=1)


def test_each_link_shape_becomes_its_qdisc():
    assert LinkSpec(2).qdisc() == ["pfifo_fast"]
    tbf = LinkSpec(2, rate_gbit=2.5).qdisc()
    assert tbf[:3] == ["tbf", "rate", "2500mbit"] and int(tbf[4]) == 312500  # a burst of 1 ms at 2.5 Gbit/s
    assert LinkSpec(2, rate_gbit=1, delay_ms=0.5).qdisc() == ["netem", "delay", "500us", "rate", "1000mbit",
                                                              "limit", "100000"]
