"""The planner's table, as Markdown (what ``zeroshard estimate`` prints)."""
from __future__ import annotations

from zeroshard.planner.estimate import Plan
from zeroshard.planner.sizes import fmt_bytes


def plan_markdown(p: Plan) -> str:
    hw, w, s = p.hardware, p.workload, p.shape
    lines = [
        f"model: {s.name}: {s.n_params / 1e6:.1f}M " + (
            "trainable parameters" if w.trainable_fraction == 1 else
            f"parameters, {w.trainable_fraction:.2%} trainable (the rest frozen: weights only)")
        + f", {s.n_layers} layers, d_model {s.d_model}, vocab {s.vocab}",
        f"hardware: {hw.nodes} node(s) × {hw.n_gpus} GPU(s) × {fmt_bytes(hw.gpu_memory)}, tp {w.tp}, pp {w.pp}, "
        f"{w.scope} sharding, CPU {fmt_bytes(hw.cpu_memory)} per node, "
        f"NVMe {fmt_bytes(hw.nvme)} ({hw.usable_fraction:.0%} of GPU/CPU memory usable)",
        f"workload: micro-batch {w.micro_batch} × {w.seq_len} tokens per GPU, "
        f"{w.mixed_precision or 'fp32'}, {w.optim_bytes_per_param:.3g} optimizer bytes/param",
        "",
        "| configuration | GPU model states | GPU buffers | activations | GPU total | CPU (node) "
        "| NVMe | + async ckpt CPU | bytes/step intra-node | inter-node | fits |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    best = p.recommended
    for e in p.estimates:
        mark = "**yes** (recommended)" if e is best else ("yes" if e.fits else f"no: {e.why_not}")
        t = e.traffic
        intra, inter = (fmt_bytes(t.intra_node), fmt_bytes(t.inter_node)) if t is not None else ("?", "?")
        lines.append(
            f"| {e.choice.label} | {fmt_bytes(e.gpu_states.model_states)} | {fmt_bytes(e.gpu_states.buffers)} "
            f"| {fmt_bytes(e.activations)} | {fmt_bytes(e.gpu_total)} | {fmt_bytes(e.cpu_total)} "
            f"| {fmt_bytes(e.nvme_total)} | {fmt_bytes(e.checkpoint_async_cpu)} | {intra} "
            f"| {inter} | {mark} |")
    lines.append("")
    if best is None:
        lines.append("nothing fits: add GPUs, use a smaller micro-batch, or offload to NVMe with more space.")
    else:
        c = best.choice
        kw = {**c.zero_kwargs(), **({"mixed_precision": w.mixed_precision} if w.mixed_precision else {}),
              **({"mesh": "mesh_2d"} if w.scope != "flat" else {}), **({"hpz": True} if w.scope == "hpz" else {})}
        args = [f"{k}={v if k == 'mesh' else repr(v)}" for k, v in kw.items()]
        lines.append(f"recommended (fastest that fits): {c.label}: "
                     f"zeroshard.ZeroOptimizer(model, torch.optim.AdamW, {', '.join(args)})"
                     + (" with activation checkpointing" if c.activation_checkpointing else ""))
        if best.checkpoint_async_cpu + best.cpu_total > hw.cpu_memory * hw.usable_fraction:
            lines.append("note: an async checkpoint save would not fit in CPU memory; save synchronously.")
    lines.append("Speed order is a heuristic (Choice.relative_cost), memory is the estimate: "
                 "model states by the ZeRO formulas, activations by a per-tensor count.")
    return "\n".join(lines)
