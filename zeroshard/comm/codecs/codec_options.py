"""Which codec the collectives use, per direction and per link: the options of ZeroOptimizer.

``ZeroOptimizer(..., weight_codec="int8", grad_codec="int4", codec_links="inter_node")`` (or the
DeepSpeed keys ``zero_quantized_weights`` / ``zero_quantized_gradients``: zeroshard/deepspeed_compat)
are read into one ``CollectiveCodecs`` (Note [quantized collectives] in
zeroshard/comm/codecs/coded.py). Each field is checked here with a message that names the fix.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from zeroshard.comm.codecs.codec_formats import CODEC_NAMES

WEIGHT_CODECS = ("none", "bf16", "fp8", "int8")
GRAD_CODECS = CODEC_NAMES
LINKS = ("all", "inter_node")
INTER_NODE_DIMENSIONS = frozenset({"dp", "replicate"})
"""Group dimensions whose collectives cross node boundaries: the replicas of a hybrid mesh and
hpZ's inter-node level ("replicate"), and one flat group over every rank ("dp", which spans the
nodes when there are several). "shard" (a hybrid shard group, hpZ's node level) stays inside."""


@dataclass(frozen=True)
class CollectiveCodecs:
    weights: str = "none"
    """Codec of stage-3 parameter gathers (units, frozen bases, hpZ's secondary rebuild):
    ``none | bf16 | fp8 | int8``; needs stage=3."""
    grads: str = "none"
    """Codec of gradient reductions (all-reduce at stages 0-1, reduce-scatter at 2-3, the hybrid
    replicas' all-reduce, hpZ's two levels): ``none | bf16 | fp8 | int8 | int4``."""
    links: str = "all"
    """``all``: every data-parallel link; ``inter_node``: only collectives that cross nodes
    (``INTER_NODE_DIMENSIONS``), full precision inside a node."""
    block: int = 256
    """Elements per fp32 scale of fp8/int8/int4 (Note [codec error bounds])."""
    error_feedback: bool = False
    """Gradients: carry each rank's quantization residual into its next reduction of the same
    unit (Note [gradient error feedback]); saved in checkpoints."""
    log_error: bool = False
    """Log the largest dequantization error of each step (logger ``zeroshard.codecs``, INFO)."""

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_CODECS:
            extra = " (int4 is for gradients only: weights lose too much at 4 bits)" if self.weights == "int4" else ""
            raise ValueError(f"weight_codec={self.weights!r} is not one of {WEIGHT_CODECS}{extra}")
        if self.grads not in GRAD_CODECS:
            raise ValueError(f"grad_codec={self.grads!r} is not one of {GRAD_CODECS}")
        if self.links not in LINKS:
            raise ValueError(f"codec_links={self.links!r} is not one of {LINKS}")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 2 or self.block % 2:
            raise ValueError(f"codec_block={self.block!r} must be an even int >= 2 (elements per fp32 scale, e.g. 256)")
        for name in ("error_feedback", "log_error"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{'grad_error_feedback' if name == 'error_feedback' else 'log_codec_error'}="
                                f"{getattr(self, name)!r} must be True or False")
        if self.error_feedback and self.grads == "none":
            raise ValueError("grad_error_feedback=True carries the residual of a quantized gradient reduction; "
                             "set grad_codec= (e.g. 'int8') too, or drop grad_error_feedback")

    def check_stage(self, stage: int) -> None:
        if self.weights != "none" and stage != 3:
            raise ValueError(f"weight_codec={self.weights!r} quantizes stage 3's parameter gathers; stage={stage} "
                             "gathers parameters once after the step, in full precision. Use stage=3 or "
                             "weight_codec='none'")

    @property
    def active(self) -> bool:
        return self.weights != "none" or self.grads != "none"

    def applies_to(self, dimension: str) -> bool:
        return self.links == "all" or dimension in INTER_NODE_DIMENSIONS


def codec_kwargs(spec: str) -> dict[str, object]:
    """ZeroOptimizer keyword arguments from a command-line spec, for launchers and benchmarks
    (``--codec``): ``"none"``, or comma-separated ``weights=int8``, ``grads=int4``,
    ``links=inter_node``, ``block=256``, ``feedback`` (error feedback), e.g.
    ``"weights=int8,grads=int4,links=inter_node,feedback"``. Checked as ``CollectiveCodecs`` is."""
    names = {"weights": "weight_codec", "grads": "grad_codec", "links": "codec_links", "block": "codec_block"}
    out: dict[str, object] = {}
    for part in (p.strip() for p in spec.split(",") if p.strip() and spec.strip() != "none"):
        key, _, value = part.partition("=")
        if key == "feedback" and not value:
            out["grad_error_feedback"] = True
        elif key in names and value:
            out[names[key]] = int(value) if key == "block" and value.isdigit() else value
        else:
            raise ValueError(f"--codec {spec!r}: {part!r} is not weights=, grads=, links=, block= or feedback "
                             "(e.g. 'weights=int8,grads=int4,links=inter_node,feedback')")
    CollectiveCodecs(str(out.get("weight_codec", "none")), str(out.get("grad_codec", "none")),
                     str(out.get("codec_links", "all")), cast(int, out.get("codec_block", 256)),
                     bool(out.get("grad_error_feedback", False)))
    return out
