"""XOR parity of the memory tier (``PeerRedundancy(parity=g)``, Note [parity memory tier] in
zeroshard/resilience/parity.py): a lost member's bytes rebuilt from real, odd-length data; the
groups; the recovery's choice of what to rebuild; the option's refusals."""
from __future__ import annotations

import pytest
import torch

import zeroshard
from zeroshard.checkpoint.parity_rebuild import plan
from zeroshard.resilience import parity
from zeroshard.resilience.redundancy_options import check_composition


@pytest.mark.parametrize("g", [2, 3, 4])
def test_any_one_lost_member_is_rebuilt_bitwise_from_the_others_and_the_parity(g):
    gen = torch.Generator().manual_seed(g)
    lengths = [1001, 77, 1, 513][:g]  # (odd, unequal: padding and recorded lengths matter)
    datas = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in lengths]
    size, pars = parity.encode(datas, g)
    assert size == parity.chunk_bytes(1001, g) and all(p.numel() == size for p in pars)
    assert size <= -(-1001 // (g - 1)) + parity.ALIGN  # 1/(g - 1) of the longest, plus alignment
    for lost in range(g):
        got = parity.rebuild(lost, g, size, lengths[lost], {i: d for i, d in enumerate(datas) if i != lost},
                             {i: p for i, p in enumerate(pars) if i != lost})
        assert torch.equal(got, datas[lost]), lost
    flipped = pars[1 % g].clone()
    flipped[0] ^= 1  # a damaged parity byte changes the rebuilt bytes (what the recovery's crc32 catches)
    others = {i: d for i, d in enumerate(datas) if i != 0}
    assert not torch.equal(parity.rebuild(0, g, size, lengths[0], others, {**{i: p for i, p in enumerate(pars) if i}, 1 % g: flipped})
                           if g > 1 else datas[0], datas[0])
    with pytest.raises(ValueError, match="needs the data and parity"):
        parity.rebuild(0, g, size, lengths[0], {i: d for i, d in enumerate(datas) if i > 1}, dict(enumerate(pars)))


def test_groups_are_consecutive_ranks_or_one_rank_per_node(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert parity.groups(8, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # 4 nodes of 2 ranks: a node loss is one member per group
    assert parity.groups(8, 4) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # 2 nodes, groups of 4: cannot spread, consecutive
    assert parity.groups(8, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_recovery_rebuilds_one_loss_per_group_and_names_two_losses_in_one_group():
    grp = [0, 1, 2, 3]

    def held(owners: list[int], holders: list[int], step: int = 5) -> list[tuple[list, list]]:
        return [([(o, step, 4, 128) for o in owners], [(h, step, 4, grp, 64) for h in holders])]
    assert plan(held([0, 1, 2, 3], grp)) == (None, "")
    assert plan(held([0, 2, 3], [0, 2, 3])) == ((5, 4, {1: grp}), "")
    chosen, why = plan(held([0, 3], [0, 3]))
    assert chosen is None and why == ("step 5: parity group [0, 1, 2, 3] lost the slots of rank(s) [1, 2] "
                                      "(one XOR parity rebuilds one member of a group)")
    chosen, why = plan(held([0, 2, 3], [0, 3]))
    assert chosen is None and "rank 1's slot is gone and so is the parity of rank(s) [2]" in why
    chosen, why = plan([([(o, 5, 4, 128) for o in (0, 1)], [(h, 5, 4, [0, 1], 64) for h in (0, 1)])])
    assert chosen is None and why == ("step 5: rank 2's slot is gone and no parity slot of its group survives "
                                      "(every member of the group is lost)")
    assert plan([([(0, 5, 2, 128)], [])]) == (None, "")  # (a replica tier: nothing to rebuild, its own report)


def test_parity_option_is_checked_with_the_fix():
    for bad in (1, 0, True, "2", 2.0):
        with pytest.raises(ValueError, match="parity=.* must be None .* or an int >= 2"):
            zeroshard.PeerRedundancy(parity=bad)
    options = zeroshard.PeerRedundancy(parity=4)
    with pytest.raises(ValueError, match=r"divisible by it, and this shard group has 6 ranks: use parity= one of \[2, 3, 6\]"):
        check_composition(options, nvme=False, tp=False, pp=False, hybrid=False, world=6)
    with pytest.raises(ValueError, match="at least 2 ranks"):
        check_composition(options, nvme=False, tp=False, pp=False, hybrid=False, world=1)
    check_composition(options, nvme=False, tp=False, pp=False, hybrid=False, world=8)
    with pytest.raises(ValueError, match="NVMe"):
        check_composition(options, nvme=True, tp=False, pp=False, hybrid=False, world=8)
