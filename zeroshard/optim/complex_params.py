"""Complex parameters (Note [complex parameters] in zeroshard/layout/unit_layout.py): what they
cannot be combined with, refused at construction naming the parameter and the fix."""
from __future__ import annotations

from collections.abc import Sequence

from zeroshard.comm.tensor_parallel import is_dtensor
from zeroshard.config import ZeroConfig
from zeroshard.layout import NamedParam


def check_complex(config: ZeroConfig, trainable: Sequence[NamedParam], whole_groups: Sequence[int]) -> None:
    """Refuses complex parameters where their real view is not what the user trains: a
    narrower compute dtype (there is no bf16/fp16 complex to compute in), an optimizer that
    reads whole tensors (its update of the ``(*shape, 2)`` reals is not its update of the complex
    matrix), a DTensor shard."""
    complex_ = [m for m in trainable if m.param.dtype.is_complex]
    if not complex_:
        return
    first = complex_[0]
    more = f" (and {len(complex_) - 1} more complex parameter(s))" if len(complex_) > 1 else ""
    if config.mixed_precision is not None:
        raise ValueError(
            f"parameter {first.name!r} is {first.param.dtype}{more}: mixed_precision={config.mixed_precision!r} "
            "computes in a 16-bit real dtype and has no complex one. Train complex parameters without "
            "mixed_precision, or keep them out of the optimizer's param groups")
    whole = [m for m in complex_ if m.group in set(whole_groups)]
    if whole:
        raise ValueError(
            f"parameter {whole[0].name!r} is {whole[0].param.dtype} and in param group {whole[0].group}, whose "
            "optimizer reads whole tensors (Muon, Adafactor, ...): its update of the real view is not its update "
            "of the complex matrix. Put complex parameters in a group with an elementwise optimizer (AdamW, SGD)")
    dtensors = [m for m in complex_ if is_dtensor(m.param)]
    if dtensors:
        raise ValueError(f"parameter {dtensors[0].name!r} is a complex DTensor (tensor parallelism): not supported; "
                         "use real parameters with tensor parallelism")
