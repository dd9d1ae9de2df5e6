"""``zeroshard convert-dcp`` streams: memory grows by a bound set by one tensor and the native
format's checksum blocks, not by the checkpoint; and what it writes is, tensor for tensor,
what the in-memory conversion (load into a ZeroOptimizer, save in the other format) wrote."""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import torch

import zeroshard
from tests.support import dcp_convert_in_memory
from tests.support.asserts import assert_same
from tests.support.dcp_convert_check import assert_same_checkpoint, contents
from zeroshard.checkpoint.dcp_convert import convert_dcp

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_streamed_conversion_equals_the_in_memory_one_both_ways(tmp_path):
    """Two param groups (one with its own lr), a BatchNorm's buffers (an int64 0-d one among
    them), AdamW's step, a scheduler and extra: native -> DCP and that DCP -> native, each
    compared with the in-memory conversion of the same source."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 3))
    opt = zeroshard.ZeroOptimizer([{"params": list(model[0].parameters()), "lr": 0.2},
                                   {"params": list(model[2].parameters()) + list(model[1].parameters())}],
                                  torch.optim.AdamW, stage=1, lr=0.1, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    for _ in range(2):
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
        sched.step()
    native = str(tmp_path / "native")
    zeroshard.save_checkpoint(native, 2, model=model, optimizer=opt, scheduler=sched, extra={"epoch": 1}).wait()
    streamed = convert_dcp(native, str(tmp_path / "dcp"))
    assert_same_checkpoint(streamed, dcp_convert_in_memory.convert_dcp(native, str(tmp_path / "dcp-ref")))
    back = convert_dcp(streamed, str(tmp_path / "native2"))
    assert_same_checkpoint(back, dcp_convert_in_memory.convert_dcp(streamed, str(tmp_path / "native2-ref")))


def test_streamed_conversion_equals_the_in_memory_one_for_other_optimizer_classes(tmp_path):
    """SGD's momentum buffers, Adam's (not AdamW's) options, RMSprop's square averages."""
    for i, (cls, options) in enumerate([(torch.optim.SGD, dict(lr=0.1, momentum=0.9)), (torch.optim.Adam, dict(lr=0.01)),
                                        (torch.optim.RMSprop, dict(lr=0.01))]):
        torch.manual_seed(i)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
        opt = zeroshard.ZeroOptimizer(model, cls, stage=1, **options)
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
        native = zeroshard.save_checkpoint(str(tmp_path / f"{i}"), 1, model=model, optimizer=opt).wait()
        streamed = convert_dcp(native, str(tmp_path / f"{i}-dcp"))
        assert_same_checkpoint(streamed, dcp_convert_in_memory.convert_dcp(native, str(tmp_path / f"{i}-dcp-ref")))
        back = convert_dcp(streamed, str(tmp_path / f"{i}-native"))
        assert_same_checkpoint(back, dcp_convert_in_memory.convert_dcp(streamed, str(tmp_path / f"{i}-native-ref")))


# Each conversion's growth of this process's peak RSS (VmHWM, reset between the two through
# clear_refs), over its RSS before: the converting process is measured, not the test's.
_RSS_CHILD = """
import sys, psutil
import torch._dynamo  # (code, not buffers: torch's dcp.save imports it on first use, Note [pipelining imported on first use])
from zeroshard.checkpoint.dcp_convert import convert_dcp
def hwm():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
grew = []
for src, dst in zip(sys.argv[1::2], sys.argv[2::2]):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = psutil.Process().memory_info().rss
    convert_dcp(src, dst)
    grew.append((hwm() - base) / 2**20)
print(grew)
"""
BOUND_MIB = 96
"""Two native checksum blocks' worth of buffers (64 MiB: a reader's verified block, or the
writer's buffers and checksummer) plus a few copies of the largest tensor (4 MiB here)."""


def test_convert_dcp_streams_both_ways_in_bounded_memory(tmp_path):
    """A 288 MiB checkpoint (24 4-MiB weights, AdamW's two moments each), three times the bound,
    converted native -> DCP -> native in one child process: each conversion grows its RSS by
    less than the bound, and the round trip gives back every tensor ``torch.equal``."""
    model = torch.nn.ModuleList([torch.nn.Linear(1024, 1024, bias=False) for _ in range(24)])
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, stage=1, lr=0.1)
    sum(layer(torch.ones(1, 1024)).sum() for layer in model).backward()
    opt.step()
    native = zeroshard.save_checkpoint(str(tmp_path / "native"), 1, model=model, optimizer=opt).wait()
    del model, opt
    size = sum(os.path.getsize(os.path.join(native, f)) for f in os.listdir(native))
    assert size >= 3 * BOUND_MIB << 20, size
    dcp_dir, back = str(tmp_path / "dcp"), str(tmp_path / "back")
    proc = subprocess.run([sys.executable, "-c", _RSS_CHILD, native, dcp_dir, os.path.join(dcp_dir, "step-00000001"),
                           back], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    grew = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    assert all(g < BOUND_MIB for g in grew), f"conversions grew RSS by {grew} MiB for a {size >> 20} MiB checkpoint"
    want, got = contents(native)[0], contents(os.path.join(back, "step-00000001"))[0]
    assert sorted(got) == sorted(want)
    assert_same(got, want, "native -> DCP -> native, streamed")
