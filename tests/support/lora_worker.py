"""Runs inside each rank: LoRA fine-tuning with the real ``peft`` library on a ``transformers``
Llama built from a small config, ZeroOptimizer in place of torch.optim.AdamW, against plain
PEFT + torch.optim.AdamW on one process with the same global batch. Writes per-cell results
as JSON for tests/integrations/test_lora.py."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

import zeroshard

STEPS = 8
GLOBAL_BATCH = 4
SEQ = 16
VOCAB = 128
MAX_NORM = 0.5
TARGETS = ("q_proj", "v_proj", "down_proj")


def llama_config(hidden: int = 64, layers: int = 2):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                       max_position_embeddings=64, tie_word_embeddings=False)


def base_model(dtype: torch.dtype = torch.float32, hidden: int = 64, layers: int = 2) -> torch.nn.Module:
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config(hidden, layers)).to(dtype)


def lora_config():
    from peft import LoraConfig
    return LoraConfig(r=4, lora_alpha=8, target_modules=list(TARGETS), lora_dropout=0.0)


def lora_model(dtype: torch.dtype = torch.float32, hidden: int = 64, layers: int = 2) -> torch.nn.Module:
    """PEFT's own wrapping; the adapters' random init is seeded so both runs start equal
    (PEFT keeps adapters in fp32 over a bf16 base, its default ``autocast_adapter_dtype``)."""
    from peft import get_peft_model
    model = base_model(dtype, hidden, layers)
    torch.manual_seed(1)
    peft_model = get_peft_model(model, lora_config())
    torch.manual_seed(2)  # lora_B starts at zero in PEFT: give it values so every adapter trains from step 0
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    return peft_model


def tokens(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)


@dataclass(frozen=True)
class Cell:
    stage: int
    dtype: str = "fp32"
    offload: Optional[str] = None
    recompute: bool = False
    """Activation checkpointing (non-reentrant), in both runs."""

    @property
    def key(self) -> str:
        return f"stage{self.stage}-{self.dtype}-{self.offload or 'none'}" + ("-recompute" if self.recompute else "")

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.dtype == "bf16" else torch.float32


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, world: int) -> list[float]:
    """The loop as people write it; only the optimizer differs between the two runs."""
    return _steps(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s)), 0, STEPS,
                  rank, world)


def full_weights(model: torch.nn.Module, stage: int) -> dict[str, torch.Tensor]:
    if stage == 3:
        return zeroshard.full_state_dict(model, rank0_only=False)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _options(cell: Cell, nvme_dir: str) -> dict[str, Any]:
    if cell.offload == "cpu":
        return dict(offload_params="cpu", offload_optimizer="cpu")
    if cell.offload == "nvme":
        os.makedirs(nvme_dir, exist_ok=True)
        return dict(offload_params="nvme", offload_optimizer="nvme", nvme_path=nvme_dir)
    return {}


def _recompute(model: torch.nn.Module, on: bool) -> torch.nn.Module:
    if on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def run_cell(cell: Cell, rank: int, world: int, nvme_dir: str) -> dict:
    ref = _recompute(lora_model(cell.torch_dtype), cell.recompute)
    initial = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    train(ref, ref_opt, 0, 1)
    expected = ref.state_dict()
    model = _recompute(lora_model(cell.torch_dtype), cell.recompute)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, stage=cell.stage,
                                  **_options(cell, nvme_dir))
    report = opt.memory_report()
    train(model, opt, rank, world)
    got = full_weights(model, cell.stage)
    adapter_diff, base_changed, adapter_moved = 0.0, [], 0.0
    ulp_excess = 0.0
    for k, ref_v in expected.items():
        v = got[k].float()
        if "lora_" in k:
            diff = (v - ref_v.float()).abs()
            adapter_diff = max(adapter_diff, float(diff.max()))
            # bf16-base cells: the bound of tests/dist/test_parity.py, 1 ulp of the value + 1e-3
            ulp = ref_v.float().abs() * 2.0 ** -7 + 1e-3
            ulp_excess = max(ulp_excess, float((diff - ulp).max()))
            adapter_moved = max(adapter_moved, float((v - initial[k].float()).abs().max()))
        elif not torch.equal(got[k], initial[k]):
            base_changed.append(k)
    frozen_numel = sum(v.numel() for k, v in initial.items() if "lora_" not in k)
    out = {"adapter_diff": adapter_diff, "ulp_excess": ulp_excess, "adapter_moved": adapter_moved,
           "base_changed": base_changed, "frozen_bytes": report.frozen, "frozen_offloaded": report.frozen_offloaded,
           "frozen_whole_bytes": frozen_numel * initial[next(iter(k for k in initial if "lora_" not in k))].element_size()}
    opt.close()
    return out


def worker(rank: int, world: int, out_path: str, cells: list[tuple], nvme_dir: str) -> None:
    results = {}
    for spec in cells:
        cell = Cell(*spec)
        try:
            results[cell.key] = run_cell(cell, rank, world, os.path.join(nvme_dir, cell.key))
        except Exception as exc:  # reported per cell; the other cells still run
            results[cell.key] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            if world > 1:
                raise
        if world > 1:
            dist.barrier()
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(results, f)


def _steps(model: torch.nn.Module, opt: Any, sched: Any, start: int, stop: int, rank: int, world: int) -> list[float]:
    per = GLOBAL_BATCH // world
    losses = []
    for step in range(start, stop):
        batch = tokens(step)[rank * per:(rank + 1) * per]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        sched.step()
        model.zero_grad()
        losses.append(float(loss))
    return losses


def _fresh(cell: Cell, nvme_dir: str, perturb: bool = False) -> tuple[torch.nn.Module, Any, Any]:
    model = lora_model(cell.torch_dtype)
    if perturb:  # another base: one frozen weight differs
        with torch.no_grad():
            model.base_model.model.model.layers[1].mlp.up_proj.weight[0, 0] += 1.0
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, stage=cell.stage,
                                  **_options(cell, nvme_dir))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    return model, opt, sched


def _bytes_under(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def ckpt_worker(rank: int, world: int, out_path: str, spec: tuple, root: str) -> None:
    """Save at step 4 (what trains only, then with save_frozen=True), resume in a fresh model
    and optimizer, train to step 8: bit for bit the uninterrupted run; a different base is refused."""
    cell = Cell(*spec)
    nvme = os.path.join(root, f"nvme{rank}")
    model, opt, sched = _fresh(cell, os.path.join(nvme, "a"))
    _steps(model, opt, sched, 0, 4, rank, world)
    zeroshard.save_checkpoint(os.path.join(root, "lean"), 4, model=model, optimizer=opt, scheduler=sched)
    zeroshard.save_checkpoint(os.path.join(root, "full"), 4, model=model, optimizer=opt, scheduler=sched,
                              save_frozen=True)
    at4 = full_weights(model, cell.stage)
    _steps(model, opt, sched, 4, STEPS, rank, world)
    want = full_weights(model, cell.stage)
    if rank == 0:  # what another world size must load, and where it must arrive
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in at4.items()}, os.path.join(root, "at4.safetensors"))
        save_file({k: v.contiguous() for k, v in want.items()}, os.path.join(root, "at8.safetensors"))
    opt.close()
    out: dict[str, Any] = {}
    if world > 1:
        dist.barrier()
    out["lean_bytes"] = _bytes_under(os.path.join(root, "lean"))
    out["full_bytes"] = _bytes_under(os.path.join(root, "full"))
    for label, sub, perturb in (("lean", "lean", False), ("full_other_base", "full", True)):
        model, opt, sched = _fresh(cell, os.path.join(nvme, label), perturb)
        zeroshard.load_checkpoint(os.path.join(root, sub), model=model, optimizer=opt, scheduler=sched)
        _steps(model, opt, sched, 4, STEPS, rank, world)
        got = full_weights(model, cell.stage)
        out[label] = [k for k in want if not torch.equal(want[k], got[k])]
        opt.close()
    model, opt, sched = _fresh(cell, os.path.join(nvme, "refused"), perturb=True)
    try:
        zeroshard.load_checkpoint(os.path.join(root, "lean"), model=model, optimizer=opt, scheduler=sched)
        out["refused"] = None
    except Exception as exc:  # the message is what the test checks
        out["refused"] = f"{type(exc).__name__}: {exc}"
    opt.close()
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(out, f)


def resume_worker(rank: int, world: int, out_path: str, spec: tuple, root: str) -> None:
    """A checkpoint of ``ckpt_worker`` (world 2) loaded at this world size: the state right
    after loading is the saved one bit for bit; training on matches the world-2 run."""
    from safetensors.torch import load_file
    cell = Cell(*spec)
    at4, at8 = load_file(os.path.join(root, "at4.safetensors")), load_file(os.path.join(root, "at8.safetensors"))
    model, opt, sched = _fresh(cell, os.path.join(root, f"nvme-r{rank}"))
    zeroshard.load_checkpoint(os.path.join(root, "lean"), model=model, optimizer=opt, scheduler=sched)
    loaded = full_weights(model, cell.stage)
    out: dict[str, Any] = {"diff": [k for k in at4 if not torch.equal(at4[k], loaded[k])]}
    _steps(model, opt, sched, 4, STEPS, rank, world)
    got = full_weights(model, cell.stage)
    out["final_diff"] = max(float((got[k].float() - at8[k].float()).abs().max()) for k in at8)
    opt.close()
    model, opt, sched = _fresh(cell, os.path.join(root, f"nvme-r{rank}-x"), perturb=True)
    try:
        zeroshard.load_checkpoint(os.path.join(root, "lean"), model=model, optimizer=opt, scheduler=sched)
        out["refused"] = None
    except Exception as exc:
        out["refused"] = f"{type(exc).__name__}: {exc}"
    opt.close()
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(out, f)


def _frozen_gathered(opt: Any) -> int:
    return sum(u.flat.untyped_storage().nbytes() for u in opt.engine.frozen_units)


def memory_worker(rank: int, world: int, out_path: str, root: str) -> None:
    """Per-rank frozen bytes at stage 3, in memory and with offload_params='nvme', and how much
    of the base is gathered at once through forward and backward."""
    out: dict[str, Any] = {}
    model = lora_model(torch.bfloat16, hidden=128, layers=4)
    out["whole"] = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=3)
    out["frozen"] = opt.memory_report().frozen
    peak = [0]

    def sample(*_: Any) -> None:
        peak[0] = max(peak[0], _frozen_gathered(opt))

    def on_output(module: Any, args: Any, output: Any) -> None:
        sample()
        hidden = output[0] if isinstance(output, tuple) else output
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(lambda g: sample())
    handles = [layer.register_forward_hook(on_output) for layer in model.base_model.model.model.layers]
    batch = tokens(0)[rank:rank + 1]
    model(input_ids=batch, labels=batch).loss.backward()
    out["peak_gathered_frozen"] = peak[0]
    out["after_backward_gathered"] = _frozen_gathered(opt)
    for h in handles:
        h.remove()
    opt.close()
    nvme = os.path.join(root, f"nvme{rank}")
    os.makedirs(nvme, exist_ok=True)
    model = lora_model(torch.bfloat16, hidden=128, layers=4)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=3, offload_optimizer="nvme",
                                  offload_params="nvme", nvme_path=nvme)
    report = opt.memory_report()
    out["frozen_nvme_resident"] = report.frozen
    out["frozen_nvme_file"] = report.frozen_offloaded
    opt.close()
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(out, f)


def meta_worker(rank: int, world: int, out_path: str, base_dir: str, stage: int) -> None:
    """A Llama built on ``meta``, wrapped by ``peft.get_peft_model``, its base filled from a
    Hugging Face directory (each rank reading its ranges) and its adapters by PEFT's own init;
    then trained against plain PEFT started from the same weights."""
    from peft import get_peft_model
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        model = get_peft_model(LlamaForCausalLM(llama_config()), lora_config())
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, stage=stage)
    missing = zeroshard.load_safetensors(model, base_dir)
    zeroshard.init_meta_weights(model)
    start = zeroshard.full_state_dict(model, rank0_only=False)
    files = load_file(os.path.join(base_dir, "model.safetensors"))
    out: dict[str, Any] = {"missing_non_adapter": [n for n in missing if "lora_" not in n]}
    base_names = {k: k.replace("base_model.model.", "", 1).replace(".base_layer.", ".") for k in start if "lora_" not in k}
    out["base_differs"] = [k for k, f in base_names.items() if not torch.equal(start[k], files[f])]
    out["lora_B_zero"] = all(bool((v == 0).all()) for k, v in start.items() if "lora_B" in k)
    bound = max(float(v.abs().max()) for k, v in start.items() if "lora_A" in k)
    out["lora_A_bound"] = bound  # kaiming_uniform(a=sqrt(5)) of fan_in 64: |w| <= 1/8
    out["lora_A_nonzero"] = all(bool((v != 0).any()) for k, v in start.items() if "lora_A" in k)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    # lora_B = 0 at PEFT's init: give both runs the same non-zero B so A trains from step 0
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        values = {k: torch.randn(v.shape, generator=g) * 0.02 for k, v in start.items() if "lora_B" in k}
    model.load_state_dict(values, strict=False)
    start.update(values)
    _steps(model, opt, sched, 0, STEPS, rank, world)
    got = zeroshard.full_state_dict(model, rank0_only=False)
    ref = get_peft_model(LlamaForCausalLM(llama_config()), lora_config())
    ref.load_state_dict(start)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    _steps(ref, ref_opt, torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (1 + 0.1 * s)), 0, STEPS, 0, 1)
    want = ref.state_dict()
    out["adapter_diff"] = max(float((got[k] - want[k]).abs().max()) for k in want if "lora_" in k)
    out["base_changed"] = [k for k in want if "lora_" not in k and not torch.equal(got[k], start[k])]
    opt.close()
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(out, f)


def export_worker(rank: int, world: int, out_path: str, spec: tuple, root: str) -> None:
    """Train, then export the adapter (PEFT's format) and the merged model (sharded
    safetensors); rank 0 checks both load with PEFT / transformers and equal the trained model."""
    cell = Cell(*spec)
    model, opt, sched = _fresh(cell, os.path.join(root, f"nvme{rank}"))
    _steps(model, opt, sched, 0, 4, rank, world)
    trained = full_weights(model, cell.stage)
    adapter_dir, merged_dir = os.path.join(root, "adapter"), os.path.join(root, "merged")
    zeroshard.save_adapter(model, adapter_dir)
    zeroshard.export_merged(model, merged_dir, max_shard_size="100KB")
    out: dict[str, Any] = {}
    if rank == 0:
        from peft import PeftModel
        from transformers import LlamaForCausalLM
        loaded = PeftModel.from_pretrained(base_model(cell.torch_dtype), adapter_dir)
        sd = loaded.state_dict()
        out["adapter_diff"] = [k for k in trained if "lora_" in k and not torch.equal(sd[k], trained[k])]
        ref = PeftModel.from_pretrained(base_model(cell.torch_dtype), adapter_dir).merge_and_unload()
        merged = LlamaForCausalLM.from_pretrained(merged_dir, dtype=cell.torch_dtype)
        want, got = ref.state_dict(), merged.state_dict()
        out["merged_keys_differ"] = sorted(set(want) ^ set(got))
        out["merged_diff"] = max(float((got[k].float() - want[k].float()).abs().max()) for k in want)
        out["shards"] = len([f for f in os.listdir(merged_dir) if f.endswith(".safetensors")])
        ids = tokens(0)
        out["logits_diff"] = float((merged(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max())
    opt.close()
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(out, f)
