"""DeepSpeed's ``activation_checkpointing`` section, read for zeroshard (the JSON config and
``deepspeed.checkpointing.configure``).

What each key does here:
- ``cpu_checkpointing: true``: the checkpointed blocks' inputs wait for backward in host memory
  (``offload_activations="cpu"``: Note [activation offload] in zeroshard/offload/activations/offloader.py);
- ``partition_activations: true``: DeepSpeed splits each checkpointed input over the model-parallel
  ranks; zeroshard does not. Beside ``cpu_checkpointing`` the input leaves the device whole, which
  saves more, so it is accepted without effect; alone it is refused (its memory saving would
  silently be missing): use ``cpu_checkpointing`` instead;
- ``contiguous_memory_optimization``: each block's moved tensors share one host buffer already;
  without effect;
- ``number_checkpoints``: sizes DeepSpeed's contiguous buffers; zeroshard sizes a buffer per block
  as it runs; checked (an int >= 1), without effect;
- ``synchronize_checkpoint_boundary``: a device-wide synchronize around each checkpoint, for
  timing; zeroshard's copies are ordered by CUDA events; without effect;
- ``profile`` and any other key: not read, so reported as unsupported by the translator.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

SECTION = "activation_checkpointing"
_BOOLS = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
          "synchronize_checkpoint_boundary")


@dataclass(frozen=True)
class ActivationCheckpointing:
    """What the section means: the ZeroOptimizer option, the keys read and the keys without effect."""

    offload_activations: Optional[str] = None
    used: frozenset[str] = frozenset()
    noted: dict[str, str] = field(default_factory=dict)


def read_section(section: object) -> ActivationCheckpointing:
    """``section``: the config's ``activation_checkpointing`` value (None when absent)."""
    if section is None:
        return ActivationCheckpointing()
    if not isinstance(section, dict):
        raise ValueError(f"{SECTION}={section!r} must be an object, e.g. {{\"cpu_checkpointing\": true}}")
    flags = {}
    for key in _BOOLS:
        value = section.get(key, False)
        if not isinstance(value, bool):
            raise ValueError(f"{SECTION}.{key}={value!r} must be true or false")
        flags[key] = value
    count = section.get("number_checkpoints")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise ValueError(f"{SECTION}.number_checkpoints={count!r} must be an int >= 1 (or null)")
    used = {f"{SECTION}.{k}" for k in (*_BOOLS, "number_checkpoints") if k in section}
    noted = {}
    if flags["partition_activations"]:
        if flags["cpu_checkpointing"]:
            noted[f"{SECTION}.partition_activations"] = (
                "with cpu_checkpointing each checkpointed input leaves the device whole (not split over ranks)")
        else:  # (left unread: the translator refuses it by name)
            used.discard(f"{SECTION}.partition_activations")
    for key, why in (("contiguous_memory_optimization", "each block's offloaded tensors share one host buffer"),
                     ("number_checkpoints", "host buffers are sized per block as it runs"),
                     ("synchronize_checkpoint_boundary", "activation copies are ordered by CUDA events")):
        if key in section and section[key] not in (False, None):
            noted[f"{SECTION}.{key}"] = why
    return ActivationCheckpointing(offload_activations="cpu" if flags["cpu_checkpointing"] else None,
                                   used=frozenset(used), noted=noted)
