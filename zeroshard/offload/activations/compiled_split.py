"""Whether a forward runs inside a whole-model ``torch.compile`` with inductor, where activation
offload cannot give the bits of the run without it (Note [activation offload under inductor]).

Note [activation offload under inductor]: the offloader's hooks cannot be traced (they copy to
host buffers or write files, and take a lock), so dynamo breaks the compiled forward at each
covered block: a model compiled whole is, with offload, compiled as one graph per piece between
blocks. With ``backend="aot_eager"`` the pieces compute exactly what the whole graph does (same
bits, tests/offload/test_activation_offload_auto.py). With inductor they do not, and no setting
makes them: measured on TinyGPT (3 blocks, dropout 0.1, checkpointed, CPU, torch 2.13;
``benchmarks/check_compile_offload_inductor.py``), the offload run's gradients are bit for bit
those of the same model compiled with a ``torch._dynamo.graph_break()`` at each block's start and
end, and differ from the unbroken compile (a) by 1.4e-2 with inductor's own RNG: inductor draws
each graph's dropout masks from a seed of its own, and a checkpointed block that breaks leaves
the compiled checkpoint and draws from torch's eager generator; (b) still by 1.2e-8 with
``torch._inductor.config.fallback_random = True`` (same masks): inductor fuses and orders the
arithmetic across a block boundary differently from two graphs meeting there. So under inductor
the first forward of a whole compiled model is refused, naming what is bit-identical: compiling
each covered block's ``forward`` (``block.forward = torch.compile(block.forward)``: the hooks
stay outside the compiled code and every graph is the same with and without offload; same
bits, dropout included, checked by tests/offload/test_activation_offload_inductor.py) or
``backend="aot_eager"``; or ``inductor_split=True`` to accept the split graphs' numerics.
"""
from __future__ import annotations

import torch


@torch.compiler.disable(recursive=False)  # (dynamo skips this frame but keeps its callback: what we read)
def compiling_with_inductor() -> bool:
    """True when the caller runs under a dynamo frame callback whose backend is inductor."""
    from torch._dynamo.eval_frame import innermost_backend  # (private: read only here, fails soft below)
    try:
        callback = torch._C._dynamo.eval_frame.get_eval_frame_callback()
        if not callable(callback):  # (None, or True: run cached code only)
            return False
        backend = innermost_backend(callback)
    except (AttributeError, RuntimeError, AssertionError):
        return False
    name = getattr(backend, "compiler_name", None) or getattr(backend, "__name__", "")
    return name == "inductor" or type(backend).__name__ == "_TorchCompileInductorWrapper"


def refuse_inductor_split(model: torch.nn.Module, allowed: bool) -> None:
    """A RuntimeError naming the bit-identical alternatives when the model's forward is compiled whole
    with inductor (Note [activation offload under inductor]), unless ``allowed``."""
    if allowed or not compiling_with_inductor():
        return
    raise RuntimeError(
        f"activation offload under torch.compile with inductor: {type(model).__name__} is compiled whole, and the "
        "offloader's hooks split its compiled forward at each covered block, so inductor fuses (and, with dropout, "
        "draws its random masks) differently from the same model compiled without offload: the gradients would "
        "not be the same bits (Note [activation offload under inductor]). For the same bits compile each block "
        "instead (for b in blocks: b.forward = torch.compile(b.forward)), or use torch.compile(..., "
        "backend='aot_eager'); to accept the split graphs' numerics pass inductor_split=True "
        "(ActivationOffload(..., inductor_split=True) or PlannedActivations(..., inductor_split=True))")
