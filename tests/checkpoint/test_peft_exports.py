"""PEFT exports at their edges (issue "Nothing lost on the way out"): every variant PEFT merges
comes out of ``export_merged`` as ``merge_and_unload`` makes it, and a write that fails on
rank 0 (a read-only target, a full disk) raises on every rank, within the timeout, leaving
nothing behind."""
from __future__ import annotations

import json
import os

import pytest
import torch

import zeroshard
from tests.support import lora_worker as w
from tests.support.dist_results import run_ranks
from tests.support.io_helpers import fill_disk, read_only_mount, small_filesystem

VARIANTS = {
    "dora": dict(target_modules=["q_proj", "v_proj"], use_dora=True),
    "modules_to_save": dict(target_modules=["q_proj"], modules_to_save=["lm_head"]),
    "embedding": dict(target_modules=["embed_tokens", "q_proj"]),
    "lora_bias": dict(target_modules=["q_proj"], lora_bias=True),
}


def variant_model(variant: str, seed: int = 1) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM
    config = w.llama_config()
    config.attention_bias = True  # (lora_bias merges into the base layer's bias)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    torch.manual_seed(seed)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, **VARIANTS[variant]))


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 3) -> None:
    for step in range(steps):
        ids = w.tokens(step)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("variant,stage", [(v, 3) for v in sorted(VARIANTS)] + [("dora", 0)])
def test_export_merged_equals_merge_and_unload(tmp_path, variant, stage):
    """DoRA (its magnitude), modules_to_save (the trained copy under the original name), LoRA
    on embeddings and lora_bias: the exported model equals PEFT's merge_and_unload of the same
    trained weights bit for bit, and so do its logits (before the fix: DoRA Δ 0.15, no
    lm_head.weight, embeddings unmerged)."""
    from transformers import LlamaForCausalLM
    model = variant_model(variant)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=stage)
    train(model, opt)
    trained = zeroshard.full_state_dict(model)
    zeroshard.export_merged(model, str(tmp_path / "merged"), max_shard_size="200KB")
    opt.close()
    ref = variant_model(variant, seed=7)
    ref.load_state_dict(trained)
    want = ref.merge_and_unload().state_dict()
    got = LlamaForCausalLM.from_pretrained(str(tmp_path / "merged"))
    sd = got.state_dict()
    assert sorted(sd) == sorted(want)
    differ = [k for k in want if not torch.equal(sd[k], want[k])]
    assert differ == [], differ
    ids = w.tokens(9)
    assert torch.equal(got(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_trainable_tokens_are_refused_by_name(tmp_path):
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(w.base_model(), LoraConfig(r=4, target_modules=["q_proj"],
                                                      trainable_token_indices={"embed_tokens": [1, 2]}))
    with pytest.raises(ValueError, match="trainable_token_indices"):
        zeroshard.export_merged(model, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def failing_writes_worker(rank: int, world: int, out: str, read_only: str, full: str, good: str) -> None:
    """Each export into a read-only target and onto a full disk: every rank raises (none waits
    for the timeout, none returns as if it succeeded); nothing is left in the target; the same
    exports then succeed into a good directory."""
    import time
    model = w.lora_model()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=3)
    train(model, opt, steps=1)
    res: dict = {}
    cases = [("adapter_ro", lambda: zeroshard.save_adapter(model, os.path.join(read_only, "adapter"))),
             ("merged_ro", lambda: zeroshard.export_merged(model, os.path.join(read_only, "merged"))),
             ("merged_full", lambda: zeroshard.export_merged(model, os.path.join(full, "merged"),
                                                             max_shard_size="40KB")),
             ("adapter_full", lambda: zeroshard.save_adapter(model, os.path.join(full, "adapter")))]
    for name, call in cases:
        if name == "adapter_full" and rank == 0:  # (the adapter is small: no room at all now)
            fill_disk(full, "filler2")
        t0 = time.monotonic()
        try:
            call()
            res[name] = "returned"
        except RuntimeError as exc:
            res[name] = str(exc)
        res[name + "_s"] = time.monotonic() - t0
    res["left_in_full"] = sorted(set(os.listdir(full)) - {"lost+found"})
    res["merged_ok"] = zeroshard.export_merged(model, os.path.join(good, "merged"), max_shard_size="40KB")
    res["adapter_ok"] = zeroshard.save_adapter(model, os.path.join(good, "adapter"))
    opt.close()
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(res, f)


def test_failed_writes_raise_on_every_rank_and_leave_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROSHARD_PG_TIMEOUT", "30")
    good = tmp_path / "good"
    with read_only_mount(str(tmp_path)) as ro, small_filesystem(str(tmp_path / "small"), size_mb=1) as full:
        with open(os.path.join(full, "filler"), "wb") as f:  # (leaves less room than the merged model)
            f.write(b"\0" * (os.statvfs(full).f_bavail * os.statvfs(full).f_frsize - 300 * 1024))
        r0, r1 = run_ranks(failing_writes_worker, 2, tmp_path, ro, full, str(good))
    for r in (r0, r1):
        for name in ("adapter_ro", "merged_ro", "merged_full", "adapter_full"):
            assert r[name] != "returned" and "rank 0" in r[name], (name, r[name])
            assert r[name + "_s"] < 20, (name, r)  # agreed, not the collective timeout
        assert "Read-only" in r["merged_ro"] and "Read-only" in r["adapter_ro"], r
        assert "No space" in r["merged_full"] or "space" in r["merged_full"].lower(), r
        assert r["left_in_full"] == ["filler", "filler2"], r  # no shard, no index, no staging directory
    assert r0["merged_ok"] and r1["merged_ok"] is None
    index = json.load(open(good / "merged" / "model.safetensors.index.json"))
    assert sorted(set(index["weight_map"].values())) == sorted(
        f for f in os.listdir(good / "merged") if f.endswith(".safetensors"))
    assert (good / "adapter" / "adapter_model.safetensors").exists()
