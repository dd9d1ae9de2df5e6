"""offload="auto" never plans activations onto NVMe when no ``nvme_path`` is set (its capacity is 0):
a model whose blocks the offloader checkpoints (``PlannedActivations(checkpointed=False)``) trains with
every input kept, where the first forward used to put inputs on NVMe and fail; a budget that would need
NVMe is refused saying to set nvme_path, naming the longest sequence that fits without it."""
from __future__ import annotations

import re

import pytest

from tests.support import act_offload_worker as w


@pytest.mark.filterwarnings("ignore:offload='auto'")
def test_no_nvme_path_keeps_inputs_and_the_refusal_says_set_nvme_path():
    kw = dict(declared=False, checkpointed=False, prefetch=1, n_layers=4, steps=1)
    big = 1 << 30
    roomy = w.train_planned(big, None, True, **kw)
    for plan in roomy["plans"]:
        assert "nvme" not in plan["blocks"].values() and "saved-nvme" not in plan["blocks"].values(), plan
        assert plan["memory_left"]["nvme"] == 0
    assert roomy["moved"] == [0], "nothing moves: there is nowhere to move it to on a CPU without NVMe"
    state = big - roomy["plans"][0]["memory_left"]["device"]
    with pytest.raises(ValueError, match=r"longest sequence that fits is (\d+) tokens.*set nvme_path=") as err:
        w.train_planned(state + 1, None, True, **kw)
    assert int(re.search(r"longest sequence that fits is (\d+)", str(err.value)).group(1)) < w.CFG.seq_len
