"""export_hf: Hugging Face layout that transformers loads with the same logits; streaming."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import zeroshard
from zeroshard.cli import main as cli

from tests.support.asserts import assert_same

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_export_loads_in_transformers_with_same_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    model = transformers.GPT2LMHeadModel(cfg)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, stage=1, lr=1e-2, bucket_size_mb=0.01)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randint(0, 64, (2, 16), generator=g)
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    root, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    zeroshard.save_checkpoint(root, 2, model=model, optimizer=opt)
    assert cli(["export", root, out, "--max-shard-size", "40KB", "--no-progress"]) == 0
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    # The tied alias is exported too (issue 12: a strict load_state_dict needs every key).
    assert "lm_head.weight" in index["weight_map"] and "transformer.wte.weight" in index["weight_map"]
    assert os.path.exists(os.path.join(out, "config.json"))  # saved with the checkpoint
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    model.eval()
    x = torch.arange(16).view(1, 16) % 64
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)
    from safetensors.torch import load_file
    exported = {}
    for shard in shards:
        exported.update(load_file(os.path.join(out, shard)))
    strict = transformers.GPT2LMHeadModel(cfg)
    strict.load_state_dict(exported, strict=True)  # failed before: lm_head.weight was missing


def test_export_dtype_and_cli(tmp_path):
    root = str(tmp_path / "ckpt")
    model = torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.LayerNorm(20), torch.nn.Linear(20, 5))
    opt = zeroshard.ZeroOptimizer(model, torch.optim.SGD, stage=1, lr=0.1)
    zeroshard.save_checkpoint(root, 7, model=model, optimizer=opt)
    zeroshard.export_hf(root, str(tmp_path / "bf16"), max_shard_size="1KB", dtype="bf16")
    from safetensors.torch import load_file
    got = {}
    for f in os.listdir(tmp_path / "bf16"):
        if f.endswith(".safetensors"):
            got.update(load_file(str(tmp_path / "bf16" / f)))
    assert {k: v.dtype for k, v in got.items()} == {k: torch.bfloat16 for k in model.state_dict()}
    assert_same(got, {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, "bf16 export")
    assert cli(["inspect", root, "--tensors"]) == 0
    assert cli(["verify", root]) == 0
    data = os.path.join(root, "step-00000007", "rank-00000.safetensors")
    raw = bytearray(open(data, "rb").read())
    raw[-3] ^= 1
    open(data, "wb").write(raw)
    assert cli(["verify", root]) == 1
    assert cli(["export", root, str(tmp_path / "bad"), "--no-progress"]) == 1


# VmHWM (this process's peak RSS), not ru_maxrss, which keeps the forking parent's peak.
_RSS_CHILD = """
import sys, psutil, zeroshard
def hwm():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
base = psutil.Process().memory_info().rss
zeroshard.export_hf(sys.argv[1], sys.argv[2], max_shard_size=sys.argv[3])
print((hwm() - base) / 2**20)
"""


def test_export_streams_in_bounded_memory(tmp_path):
    """A 256 MiB model exported in 32 MB shards: the exporting process grows by less than
    the model: a fixed ~100 MiB (one 32 MiB checksum block, two 16 MiB write buffers, piece
    chunks) plus runtime warm-up, not the state. benchmarks/bench_checkpoint.py --export
    measures it for a model many times max_shard_size."""
    root = str(tmp_path / "ckpt")
    model = torch.nn.ModuleList([torch.nn.Linear(2048, 4096, bias=False) for _ in range(8)])
    opt = zeroshard.ZeroOptimizer(model, torch.optim.SGD, stage=0, lr=0.1)
    zeroshard.save_checkpoint(root, 1, model=model, optimizer=opt)
    del model, opt
    proc = subprocess.run([sys.executable, "-c", _RSS_CHILD, root, str(tmp_path / "hf"), "32MB"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    grew_mib = float(proc.stdout.strip().splitlines()[-1])
    assert len([f for f in os.listdir(tmp_path / "hf") if f.endswith(".safetensors")]) == 8
    assert grew_mib < 200, f"export grew RSS by {grew_mib:.0f} MiB for a 256 MiB model"
