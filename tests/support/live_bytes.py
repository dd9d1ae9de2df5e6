"""``LiveBytes``: the peak of the bytes held by tensors that operators created while it is on (a
dispatch mode; CPU has no allocator statistics): activations, gradients and backward's
transients, what the activation plan budgets. A storage counts the bytes its tensors cover (the
host pool's padded storages are mostly never touched); it stops counting when the storage is freed."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LiveBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.peak = 0
        self._live: dict[int, tuple[int, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func is not torch.ops.aten.set_.source_Storage_storage_offset:  # (the pool adopting a padded storage)
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided:
                    s = t.untyped_storage()
                    n = min(s.nbytes(), t.numel() * t.element_size())
                    ref, seen = self._live.get(s.data_ptr(), (0, -1))
                    if seen < 0:
                        self._live[s.data_ptr()] = (s._weak_ref(), n)
                    elif n > seen:
                        self._live[s.data_ptr()] = (ref, n)
        for key, (ref, _) in list(self._live.items()):
            if torch.UntypedStorage._expired(ref):
                torch.UntypedStorage._free_weak_ref(ref)
                del self._live[key]
        self.peak = max(self.peak, sum(n for _, n in self._live.values()))
        return out

    def __exit__(self, *exc: object) -> None:
        for ref, _ in self._live.values():
            torch.UntypedStorage._free_weak_ref(ref)
        self._live = {}
        super().__exit__(*exc)
