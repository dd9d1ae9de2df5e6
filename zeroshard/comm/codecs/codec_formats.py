"""Codecs for collectives: how a 1-D float tensor is written into a byte buffer and read back.

Note [codec error bounds]: every codec states the largest error one element can have after
``decode(encode(x))``, per block of ``block`` elements (``bound(x)`` computes it for a given
tensor; tests/unit/test_codecs.py checks it on random, adversarial and constant data). With
``a`` = the block's largest magnitude:

- ``none``: exact (0).
- ``bf16``: round to nearest even, 8 significant bits: ``|x - q| <= |x| * 2**-8`` per element,
  so ``<= a * 2**-8`` per block (no scale; values beyond bf16's range do not exist in fp32's
  either, as bf16 has fp32's exponent).
- ``fp8`` (e4m3, ``torch.float8_e4m3fn``): per block an fp32 scale ``s = a / 448`` (448: e4m3's
  largest finite value), then ``x / s`` rounded to 3 mantissa bits: ``<= |x| * 2**-4`` for
  normal values, ``<= s * 2**-10`` below e4m3's smallest normal, so ``<= a * 2**-4`` per block.
- ``int8``: symmetric, per block an fp32 scale ``s = a / 127``, ``q = round(x / s)`` in
  [-127, 127]: ``<= s / 2 = a / 254`` per block.
- ``int4``: as int8 with ``s = a / 7`` and q in [-7, 7], two values per byte: ``<= a / 14``
  per block (for gradients: error feedback, Note [gradient error feedback], carries the rest
  to the next step).

Each bound gets a relative slack of 2**-20 for the fp32 arithmetic of the scale itself. A
size that does not divide the block is padded with zeros up to whole blocks (the padding
costs bytes, never accuracy: zeros encode exactly); nothing falls back to another path. A
block holding inf or NaN decodes to NaN throughout (its scale is not finite), so an overflow
that mixed precision's loss scaler must see still reaches it after a quantized reduction.

Buffer layout of the block codecs: ``[fp32 scale per block][payload]``, one ``uint8`` tensor;
``encoded_bytes(n)`` is its exact size, so every rank can size the buffers it receives.
"""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from types import ModuleType
from typing import ClassVar, Optional

import torch

CODEC_NAMES = ("none", "bf16", "fp8", "int8", "int4")
_SLACK = 2.0 ** -20


@dataclass(frozen=True)
class Codec:
    """A lossy (or exact) encoding of 1-D float tensors into ``uint8`` buffers.

    ``encode(x, out)`` writes ``x`` (any float dtype, ``x.numel() == n``) into ``out`` (``uint8``,
    ``encoded_bytes(n)``); ``decode(buf, out)`` writes the ``out.numel()`` values back (in
    ``out``'s dtype). Both are deterministic: equal bytes decode to equal values on every rank."""
    name: ClassVar[str] = "none"
    block: int = 256

    def __post_init__(self) -> None:
        if not isinstance(self.block, int) or self.block < 2 or self.block % 2:
            raise ValueError(f"codec {self.name!r}: block={self.block!r} must be an even int >= 2 (elements per "
                             "fp32 scale; e.g. 256)")

    def blocks(self, n: int) -> int:
        return math.ceil(n / self.block)

    def encoded_bytes(self, n: int) -> int:
        return 4 * n

    def encode(self, x: torch.Tensor, out: torch.Tensor) -> None:
        out.view(torch.float32).copy_(x.reshape(-1))

    def decode(self, buf: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(buf.view(torch.float32)[:out.numel()])

    def bound(self, x: torch.Tensor) -> torch.Tensor:
        """The stated largest error of each block of ``x`` (Note [codec error bounds])."""
        return torch.zeros(self.blocks(x.numel()))

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """``decode(encode(x))`` in fp32 (for tests, error feedback and the error statistics)."""
        buf = torch.empty(self.encoded_bytes(x.numel()), dtype=torch.uint8, device=x.device)
        self.encode(x, buf)
        out = torch.empty(x.numel(), dtype=torch.float32, device=x.device)
        self.decode(buf, out)
        return out


def _absmax_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """(blocks, block) fp32 view of ``x`` padded with zeros; the pad is a copy only when needed."""
    n = x.numel()
    nb = math.ceil(n / block)
    flat = x.reshape(-1).float()
    if nb * block != n:
        flat = torch.cat([flat, flat.new_zeros(nb * block - n)])
    return flat.view(nb, block)


def _block_bound(x: torch.Tensor, block: int, factor: float) -> torch.Tensor:
    a = _absmax_blocks(x, block).abs().amax(dim=1)
    return a * (factor * (1 + _SLACK)) + torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class Bf16Codec(Codec):
    name: ClassVar[str] = "bf16"

    def encoded_bytes(self, n: int) -> int:
        return 2 * n

    def encode(self, x: torch.Tensor, out: torch.Tensor) -> None:
        out.view(torch.bfloat16).copy_(x.reshape(-1))

    def decode(self, buf: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(buf.view(torch.bfloat16)[:out.numel()])

    def bound(self, x: torch.Tensor) -> torch.Tensor:
        return _block_bound(x, self.block, 2.0 ** -8)


@dataclass(frozen=True)
class _ScaledCodec(Codec, abc.ABC):
    """Block-wise symmetric codecs: an fp32 scale per block, then a payload of codes."""
    qmax: ClassVar[float] = 127.0
    bytes_per_block_num: ClassVar[int] = 1  # payload bytes per element = num / den
    bytes_per_block_den: ClassVar[int] = 1

    def _payload(self, nb: int) -> int:
        return nb * self.block * self.bytes_per_block_num // self.bytes_per_block_den

    def encoded_bytes(self, n: int) -> int:
        nb = self.blocks(n)
        return 4 * nb + self._payload(nb)

    def _scaled(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        v = _absmax_blocks(x, self.block)
        scale = v.abs().amax(dim=1) / self.qmax
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        return v / safe[:, None], scale

    def encode(self, x: torch.Tensor, out: torch.Tensor) -> None:
        kernel = _codec_kernel(self.name, x, out)
        if kernel is None:
            return self.reference_encode(x, out)
        getattr(kernel, f"{self.name}_encode")(x.reshape(-1), out, self.block)

    def decode(self, buf: torch.Tensor, out: torch.Tensor) -> None:
        kernel = _codec_kernel(self.name, out, buf)
        if kernel is None:
            return self.reference_decode(buf, out)
        getattr(kernel, f"{self.name}_decode")(buf, out, self.block)

    def reference_encode(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """The torch path (any device and float dtype), which the C++ kernels equal bit for bit."""
        nb = self.blocks(x.numel())
        v, scale = self._scaled(x)
        out[:4 * nb].view(torch.float32).copy_(scale)
        self._pack(v.clamp_(-self.qmax, self.qmax), out[4 * nb:4 * nb + self._payload(nb)])

    def reference_decode(self, buf: torch.Tensor, out: torch.Tensor) -> None:
        n = out.numel()
        nb = self.blocks(n)
        scale = buf[:4 * nb].view(torch.float32)
        v = self._unpack(buf[4 * nb:4 * nb + self._payload(nb)]).view(nb, self.block) * scale[:, None]
        out.copy_(v.view(-1)[:n])

    @abc.abstractmethod
    def _pack(self, v: torch.Tensor, payload: torch.Tensor) -> None:
        """Writes the clamped scaled values ``v`` (blocks x block) as this codec's codes."""

    @abc.abstractmethod
    def _unpack(self, payload: torch.Tensor) -> torch.Tensor:
        """The codes of ``payload`` as float32 values (before the block scale)."""


def _codec_kernel(name: str, *tensors: torch.Tensor) -> Optional[ModuleType]:
    """The kernels' module where it has codec ``name``'s and takes these tensors (contiguous,
    float32 values): on the CPU the C++ kernels (csrc/adam/codec_int8.cpp, codec_blocks_avx2.cpp,
    codec_fp8_int4.cpp), on one CUDA device the CUDA ones (cuda_codec_kernel.cu, in the CUDA Adam
    module of a CUDA build of torch); else None (the torch path, whose bytes on the CPU both
    equal bit for bit)."""
    if not all(t.is_contiguous() for t in tensors) or tensors[0].dtype != torch.float32:
        return None
    from zeroshard.ops._loader import REGISTRY
    if all(t.device.type == "cpu" for t in tensors):
        module = REGISTRY.cpu().module
    elif all(t.device == tensors[0].device for t in tensors) and tensors[0].device.type == "cuda":
        module = REGISTRY.cuda().module
    else:
        return None
    return module if module is not None and hasattr(module, f"{name}_encode") else None


@dataclass(frozen=True)
class Int8Codec(_ScaledCodec):
    name: ClassVar[str] = "int8"

    def _pack(self, v: torch.Tensor, payload: torch.Tensor) -> None:
        payload.view(torch.int8).copy_(v.round_().view(-1))

    def _unpack(self, payload: torch.Tensor) -> torch.Tensor:
        return payload.view(torch.int8).float()

    def bound(self, x: torch.Tensor) -> torch.Tensor:
        return _block_bound(x, self.block, 1 / 254)


@dataclass(frozen=True)
class Int4Codec(_ScaledCodec):
    name: ClassVar[str] = "int4"
    qmax: ClassVar[float] = 7.0
    bytes_per_block_den: ClassVar[int] = 2

    def _pack(self, v: torch.Tensor, payload: torch.Tensor) -> None:
        q = (v.round_().view(-1, 2) + 8).to(torch.uint8)  # (codes 1..15, two per byte)
        payload.copy_(q[:, 0] | (q[:, 1] << 4))

    def _unpack(self, payload: torch.Tensor) -> torch.Tensor:
        lo = (payload & 0x0F).float() - 8
        hi = (payload >> 4).float() - 8
        return torch.stack([lo, hi], dim=1).view(-1)

    def bound(self, x: torch.Tensor) -> torch.Tensor:
        return _block_bound(x, self.block, 1 / 14)


@dataclass(frozen=True)
class Fp8Codec(_ScaledCodec):
    name: ClassVar[str] = "fp8"
    qmax: ClassVar[float] = 448.0  # (e4m3fn's largest finite value)

    def _pack(self, v: torch.Tensor, payload: torch.Tensor) -> None:
        payload.view(torch.float8_e4m3fn).copy_(v.view(-1))

    def _unpack(self, payload: torch.Tensor) -> torch.Tensor:
        return payload.view(torch.float8_e4m3fn).float()

    def bound(self, x: torch.Tensor) -> torch.Tensor:
        return _block_bound(x, self.block, 2.0 ** -4)


_CODECS: dict[str, type[Codec]] = {"none": Codec, "bf16": Bf16Codec, "fp8": Fp8Codec, "int8": Int8Codec,
                                   "int4": Int4Codec}


def make_codec(name: str, block: int = 256) -> Optional[Codec]:
    """The codec called ``name`` with ``block`` elements per scale; None for ``"none"`` (the
    collectives then take their full-precision path unchanged)."""
    if name not in _CODECS:
        raise ValueError(f"codec {name!r} is not one of {CODEC_NAMES}")
    return None if name == "none" else _CODECS[name](block=block)
