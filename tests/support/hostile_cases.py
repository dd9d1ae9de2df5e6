"""A catalogue of hostile checkpoints: each case damages a copy of a good two-step root.

Every case edits step 2 (the one ``latest`` names) or the root around it, as an attacker or
an accident would: checksum-valid but malformed values (the manifest's CRC recomputed),
wrong types, FIFOs, symlinks out of the root, absurd sizes, forged step names. ``expect`` is
the step a root load must land on (1: step 2 is refused and the load falls back; 2: step 2
is intact and the hostile thing around it is ignored); ``match`` is a regex the refusal
must contain (it names the problem).
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

MANIFEST = "manifest.json"
S1, S2 = "step-00000001", "step-00000002"
DATA0, RNG0 = "rank-00000.safetensors", "rng-00000.json"


@dataclass(frozen=True)
class Case:
    name: str
    cls: str  # the class of problem
    build: Callable[["Ctx"], None]
    expect: int
    match: Optional[str]


@dataclass
class Ctx:
    root: str
    outside: str  # a directory outside the root: nothing in it may be opened
    world: int

    @property
    def s2(self) -> str:
        return os.path.join(self.root, S2)

    def path(self, name: str) -> str:
        return os.path.join(self.s2, name)

    @property
    def last_data(self) -> str:
        return f"rank-{self.world - 1:05d}.safetensors"


# -- attacker's tools: edit a file and fix every checksum that covers it --------------------
def body(step_dir: str) -> dict:
    with open(os.path.join(step_dir, MANIFEST)) as f:
        return json.load(f)["manifest"]


def write_body(step_dir: str, b: dict) -> None:
    canon = json.dumps(b, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()
    with open(os.path.join(step_dir, MANIFEST), "w") as f:
        json.dump({"manifest": b, "crc32": zlib.crc32(canon)}, f, allow_nan=True)


def edit(ctx: Ctx, fn: Callable[[dict], Any]) -> None:
    b = body(ctx.s2)
    fn(b)
    write_body(ctx.s2, b)


def put_file(ctx: Ctx, name: str, raw: bytes, block: Optional[int] = None) -> None:
    """Replaces a listed file and records its true size and block checksums."""
    with open(ctx.path(name), "wb") as f:
        f.write(raw)
    b = body(ctx.s2)
    meta = b["files"][name]
    block = block or (max(1, len(raw)) if name.endswith(".json") else meta["block_size"])
    meta.update(bytes=len(raw), block_size=block,
                crc32=[zlib.crc32(raw[i:i + block]) for i in range(0, len(raw), block)])
    write_body(ctx.s2, b)


def header(ctx: Ctx, name: str) -> tuple[dict, bytes]:
    raw = open(ctx.path(name), "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def put_header(ctx: Ctx, name: str, h: Any, data: bytes, n: Optional[int] = None) -> None:
    raw = json.dumps(h).encode()
    raw += b" " * (-len(raw) % 8)
    put_file(ctx, name, struct.pack("<Q", len(raw) if n is None else n) + raw + data)


def edit_header(ctx: Ctx, name: str, fn: Callable[[dict], Any]) -> None:
    h, data = header(ctx, name)
    fn(h)
    put_header(ctx, name, h, data)


def first_piece(b: dict, with_scalars: bool = False) -> dict:
    for meta in b["tensors"].values():
        for p in meta["pieces"]:
            if meta["kind"] == "sharded" and (p["scalars"] or not with_scalars):
                return p
    raise AssertionError("no sharded piece")


def link_outside(ctx: Ctx, name: str, content: bytes) -> None:
    """``name`` in step 2 becomes a symlink to a file outside the root with ``content``,
    whose size and checksum the manifest is made to agree with."""
    target = os.path.join(ctx.outside, f"secret-{name}")
    with open(target, "wb") as f:
        f.write(content)
    put_file(ctx, name, content)
    os.unlink(ctx.path(name))
    os.symlink(target, ctx.path(name))


def fifo(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)
    os.mkfifo(path)


def sparse(path: str, size: int) -> None:
    with open(path, "wb") as f:
        f.truncate(size)


def forged_dir(ctx: Ctx, name: str, latest: bool = False) -> None:
    """A directory ``name`` holding a copy of step 1 (valid, but not step ``name`` says)."""
    shutil.copytree(os.path.join(ctx.root, S1), os.path.join(ctx.root, name))
    if latest:
        with open(os.path.join(ctx.root, "latest"), "w") as f:
            f.write(name + "\n")


def _scalar(v: Any) -> Callable[[dict], None]:
    return lambda b: first_piece(b, True)["scalars"].update({next(iter(first_piece(b, True)["scalars"])): v})


def _group(key: str, v: Any) -> Callable[[dict], None]:
    return lambda b: b["param_groups"][0].update({key: v})


def _trainer(key: str, v: Any) -> Callable[[dict], None]:
    return lambda b: b["trainer"].update({key: v})


def _deep(n: int) -> Any:
    v: Any = 0
    for _ in range(n):
        v = [v]
    return v


def _rng(ctx: Ctx, fn: Callable[[dict], Any]) -> None:
    state = json.load(open(ctx.path(RNG0)))
    fn(state)
    put_file(ctx, RNG0, json.dumps(state).encode())


def _flip(ctx: Ctx, name: str) -> None:
    raw = bytearray(open(ctx.path(name), "rb").read())
    raw[-3] ^= 0x40  # in the data, not the header
    open(ctx.path(name), "wb").write(raw)


def _overlap(h: dict) -> None:
    keys = [k for k, e in h.items() if k != "__metadata__" and e["data_offsets"][1] > e["data_offsets"][0]]
    a, b = h[keys[0]], h[keys[1]]
    n = a["data_offsets"][1] - a["data_offsets"][0]
    size = {"F32": 4, "BF16": 2, "F16": 2}[b["dtype"]]
    b["data_offsets"] = [a["data_offsets"][0], a["data_offsets"][0] + n // size * size]
    b["shape"] = [n // size]


def _entry_dtype(h: dict) -> None:
    k = next(k for k, e in h.items() if k.endswith("|param") and e["dtype"] == "F32")
    h[k]["dtype"] = "I32"


def _step_dir_link(ctx: Ctx) -> None:
    target = os.path.join(ctx.outside, "step-00000003")
    shutil.copytree(ctx.s2, target)
    b = body(target)
    b["step"] = 3
    write_body(target, b)
    os.symlink(target, os.path.join(ctx.root, "step-00000003"))
    with open(os.path.join(ctx.root, "latest"), "w") as f:
        f.write("step-00000003\n")


def _latest_link(ctx: Ctx) -> None:
    target = os.path.join(ctx.outside, "latest")
    with open(target, "w") as f:
        f.write("step-00000001\n")
    os.unlink(os.path.join(ctx.root, "latest"))
    os.symlink(target, os.path.join(ctx.root, "latest"))


def _huge_blocks(ctx: Ctx, block: int) -> None:
    size = 1 << 30  # a 1 GiB sparse data file: rejecting it must not cost 1 GiB of memory
    sparse(ctx.path(DATA0), size)
    edit(ctx, lambda b: b["files"][DATA0].update(bytes=size, block_size=block,
                                                 crc32=[0] * -(-size // block)))


def _link_manifest(ctx: Ctx) -> None:
    raw = open(ctx.path(MANIFEST), "rb").read()
    target = os.path.join(ctx.outside, "manifest.json")
    open(target, "wb").write(raw)
    os.unlink(ctx.path(MANIFEST))
    os.symlink(target, ctx.path(MANIFEST))


def _replace(path: str, make: Callable[[str], None]) -> None:
    os.unlink(path)
    make(path)


def _raw_manifest(ctx: Ctx, raw: bytes) -> None:
    open(ctx.path(MANIFEST), "wb").write(raw)


CASES: list[Case] = [
    # decoded and validated before anything is applied (checksum-valid, malformed)
    Case("scalar-pickle", "decode-before-apply", lambda c: edit(c, _scalar({"__zeroshard__": "pickle"})), 1, "pickle"),
    Case("scalar-string", "decode-before-apply", lambda c: edit(c, _scalar("many")), 1, "scalar"),
    Case("trainer-missing", "decode-before-apply", lambda c: edit(c, lambda b: b.pop("trainer")), 1, "'trainer'"),
    Case("scheduler-str", "decode-before-apply", lambda c: edit(c, _trainer("scheduler", "soon")), 1, "scheduler"),
    Case("scheduler-epoch-str", "decode-before-apply",
         lambda c: edit(c, lambda b: b["trainer"]["scheduler"].update(last_epoch="x")), 1, "last_epoch"),
    Case("extra-bad-tensor", "decode-before-apply", lambda c: edit(c, _trainer("extra", {
        "__zeroshard__": "tensor", "dtype": "F32", "shape": [1 << 20], "data": "AAAA"})), 1, "trainer.extra"),
    Case("extra-deep", "decode-before-apply", lambda c: edit(c, _trainer("extra", _deep(80))), 1, "nested"),
    Case("dataloader-int", "decode-before-apply",
         lambda c: edit(c, lambda b: b["trainer"].update(dataloader=[5] * c.world)), 1, "dataloader"),
    Case("dataloader-epoch-str", "decode-before-apply",
         lambda c: edit(c, lambda b: [s.update(epoch="x") for s in b["trainer"]["dataloader"]]), 1, "epoch"),
    Case("loss-scaler-str", "decode-before-apply", lambda c: edit(c, _trainer("loss_scaler", {"scale": "big"})),
         1, "loss_scaler"),
    Case("rng-python-5", "decode-before-apply", lambda c: put_file(c, RNG0, b'{"python": 5}'), 1, "RNG state"),
    Case("rng-torch-short", "decode-before-apply", lambda c: _rng(c, lambda s: s.update(torch={
        "__zeroshard__": "tensor", "dtype": "U8", "shape": [3], "data": "AAAA"})), 1, "RNG state"),
    Case("rng-not-json", "decode-before-apply", lambda c: put_file(c, RNG0, b"{python"), 1, "not valid JSON"),
    # hyperparameters of the wrong type
    Case("lr-fast", "hyperparameter-type", lambda c: edit(c, _group("lr", "fast")), 1, "'lr'.*not a number"),
    Case("betas-5", "hyperparameter-type", lambda c: edit(c, _group("betas", 5)), 1, "'betas'.*pair"),
    Case("amsgrad-yes", "hyperparameter-type", lambda c: edit(c, _group("amsgrad", "yes")), 1, "amsgrad"),
    Case("param-groups-dict", "hyperparameter-type", lambda c: edit(c, lambda b: b.update(param_groups={})),
         1, "param_groups"),
    # malformed values: zeroshard's error, not ValueError/TypeError/struct.error/...
    Case("crc-abc", "malformed-value", lambda c: edit(c, lambda b: b["files"][DATA0].update(crc32=["abc"])), 1, "CRC32"),
    Case("crc-nan", "malformed-value", lambda c: edit(c, lambda b: b["files"][DATA0].update(crc32=[float("nan")])),
         1, "CRC32"),
    Case("pieces-5", "malformed-value", lambda c: edit(c, lambda b: next(iter(b["tensors"].values())).update(pieces=5)),
         1, "malformed entry"),
    Case("frozen-5", "malformed-value", lambda c: edit(c, lambda b: b.update(frozen=5)), 1, "frozen is not an object"),
    Case("frozen-digest-int", "malformed-value", lambda c: edit(c, lambda b: next(iter(b["frozen"]["tensors"].values()))
                                                                .update(digest=5)), 1, "frozen tensor"),
    Case("data-3-bytes", "malformed-value", lambda c: put_file(c, DATA0, b"abc"), 1, "too short"),
    Case("header-list", "malformed-value", lambda c: put_header(c, c.last_data, [1, 2], b""), 1, "header is a list"),
    Case("header-entry-bad", "malformed-value",
         lambda c: edit_header(c, DATA0, lambda h: h[next(k for k in h if k != "__metadata__")].update(dtype="X")),
         1, "malformed header entry"),
    Case("header-length-huge", "malformed-value", lambda c: put_header(c, DATA0, {}, b"", n=1 << 62), 1, "header length"),
    Case("manifest-deep", "malformed-value", lambda c: _raw_manifest(c, b"[" * 100000 + b"]" * 100000), 1, "deeply"),
    Case("manifest-not-utf8", "malformed-value", lambda c: _raw_manifest(c, b"\xff\xfe{\x00"), 1, "not valid JSON"),
    Case("manifest-list", "malformed-value", lambda c: _raw_manifest(c, b"[1]"), 1, "no 'manifest'"),
    Case("manifest-dir", "malformed-value", lambda c: _replace(c.path(MANIFEST), os.mkdir), 1, "a directory"),
    Case("rng-deep", "malformed-value", lambda c: put_file(c, RNG0, b"[" * 100000 + b"]" * 100000), 1, "deeply"),
    Case("step-str", "malformed-value", lambda c: edit(c, lambda b: b.update(step="2")), 1, "step='2'"),
    Case("world-true", "malformed-value", lambda c: edit(c, lambda b: b.update(world_size=True)), 1, "world_size=True"),
    Case("stage-float", "malformed-value", lambda c: edit(c, lambda b: b.update(stage=2.0)), 1, "stage=2.0"),
    Case("shape-bool", "malformed-value",
         lambda c: edit(c, lambda b: next(iter(b["tensors"].values())).update(shape=[True])), 1, "dimension=True"),
    Case("block-size-0", "malformed-value", lambda c: edit(c, lambda b: b["files"][DATA0].update(block_size=0)),
         1, "block_size=0"),
    Case("piece-names-rng", "malformed-value", lambda c: edit(c, lambda b: first_piece(b).update(file=RNG0)),
         1, "not a listed data file"),
    Case("files-incomplete", "malformed-value", lambda c: edit(c, lambda b: b["files"].pop(RNG0)), 1, "world size"),
    Case("key-of-other-piece", "malformed-value", lambda c: edit(c, lambda b: first_piece(b)["keys"].update(
        param="gain|full")), 1, "stored under"),
    # FIFOs: open only regular files
    Case("fifo-manifest", "fifo", lambda c: fifo(c.path(MANIFEST)), 1, "FIFO"),
    Case("fifo-rng", "fifo", lambda c: fifo(c.path(RNG0)), 1, "FIFO"),
    Case("fifo-data", "fifo", lambda c: fifo(c.path(c.last_data)), 1, "FIFO"),
    Case("fifo-latest", "fifo", lambda c: fifo(os.path.join(c.root, "latest")), 2, None),
    # symlinks: nothing outside the root is opened
    Case("link-data", "symlink", lambda c: link_outside(c, DATA0, b"root:x:0:0:root:/root:/bin/bash\n" * 64),
         1, "symbolic link"),
    Case("link-rng", "symlink", lambda c: link_outside(c, RNG0, open(c.path(RNG0), "rb").read()), 1, "symbolic link"),
    Case("link-manifest", "symlink", _link_manifest, 1, "symbolic link"),
    Case("link-manifest-dev-zero", "symlink",
         lambda c: _replace(c.path(MANIFEST), lambda p: os.symlink("/dev/zero", p)), 1, "symbolic link"),
    Case("link-latest", "symlink", _latest_link, 2, None),
    Case("link-step-dir", "symlink", _step_dir_link, 2, None),
    # bounded reads
    Case("manifest-sparse-4g", "bounded-read", lambda c: _replace(c.path(MANIFEST), lambda p: sparse(p, 4 << 30)),
         1, "more than"),
    Case("block-size-2^34", "bounded-read", lambda c: _huge_blocks(c, 1 << 34), 1, "block_size"),
    Case("sparse-data-1g", "bounded-read", lambda c: _huge_blocks(c, 64 << 20), 1, "checksum mismatch"),
    # safetensors headers
    Case("overlapping-entries", "safetensors-header", lambda c: edit_header(c, DATA0, _overlap), 1, "overlap"),
    Case("entry-dtype-i32", "safetensors-header", lambda c: edit_header(c, DATA0, _entry_dtype), 1, "dtype"),
    # step names: the directory name must be the manifest's step
    Case("unicode-digits-dir", "step-name", lambda c: forged_dir(c, "step-0000000\u0669"), 2, None),
    Case("newline-dir", "step-name", lambda c: forged_dir(c, "step-00000009\n"), 2, None),
    Case("renamed-step", "step-name", lambda c: forged_dir(c, "step-00000009", latest=True), 2, "named"),
    # plain damage (the fallback everything above relies on)
    Case("flipped-byte", "damage", lambda c: _flip(c, c.last_data), 1, "checksum mismatch"),
    Case("truncated", "damage", lambda c: os.truncate(c.path(DATA0), 100), 1, "truncated"),
    Case("missing-data", "damage", lambda c: os.unlink(c.path(c.last_data)), 1, "missing"),
    Case("missing-manifest", "damage", lambda c: os.unlink(c.path(MANIFEST)), 1, "missing"),
]
