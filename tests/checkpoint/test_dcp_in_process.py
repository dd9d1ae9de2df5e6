"""DCP checks that need no process group (world 1, in this process): what a DCP round trip
hands back, and that a DCP save leaves torch's global serialization switches alone."""
from __future__ import annotations

import io
import threading
import zipfile

import torch

import zeroshard
from zeroshard.checkpoint import commit


def _trained() -> tuple[torch.nn.Module, zeroshard.ZeroOptimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, stage=1, lr=0.1)
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    return model, opt


def test_dcp_round_trip_gives_back_the_saved_extra_as_native_does(tmp_path):
    model, opt = _trained()
    extra = {"epoch": 3, "best": 0.5, "tags": ["a", "b"], "nested": {"x": (1, 2)}, "name": "run"}
    got = {}
    for fmt in ("native", "dcp"):
        zeroshard.save_checkpoint(str(tmp_path / fmt), 1, model=model, optimizer=opt, extra=extra, format=fmt).wait()
        got[fmt] = zeroshard.load_checkpoint(str(tmp_path / fmt), model=model, optimizer=opt)["extra"]
    assert got["dcp"] == got["native"] == extra, got
    zeroshard.save_checkpoint(str(tmp_path / "none"), 1, model=model, optimizer=opt, format="dcp").wait()
    assert zeroshard.load_checkpoint(str(tmp_path / "none"), model=model, optimizer=opt)["extra"] is None


def _crcs(obj: object) -> list[int]:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return [i.CRC for i in zipfile.ZipFile(io.BytesIO(buf.getvalue())).infolist()]


def test_async_dcp_save_leaves_torch_save_crc32_on_for_the_rest_of_the_process(tmp_path):
    """While the background thread writes the DCP chunks, a torch.save in the main thread
    still writes its per-record CRC32s, and so does one on the writing thread itself: torch's
    switch is never turned off (it is context-local in torch 2.13, so the writing thread's
    check is the one the old code, which turned it off around dcp.save, fails; in older
    torch, a module global, the main thread's failed too)."""
    model, opt = _trained()
    writing, checked = threading.Event(), threading.Event()
    on_writer: list[tuple[bool, list[int]]] = []

    def at_chunk(point: str) -> None:
        if point == "dcp-chunk":
            on_writer.append((torch.serialization.get_crc32_options(), _crcs(torch.arange(10.0))))
            writing.set()
            checked.wait(60)  # (the main thread saves while this save is mid-write)
    commit.fault_hook = at_chunk
    try:
        handle = zeroshard.save_checkpoint(str(tmp_path), 1, model=model, optimizer=opt, format="dcp",
                                           async_save=True)
        assert writing.wait(60)
        main = (torch.serialization.get_crc32_options(), _crcs(torch.arange(1000.0)))
        checked.set()
        handle.wait()
    finally:
        commit.fault_hook = None
        checked.set()
    assert main[0] and main[1] and all(main[1]), main
    assert on_writer and all(on and all(crcs) for on, crcs in on_writer), on_writer
    assert zeroshard.load_checkpoint(str(tmp_path), model=model, optimizer=opt)["step"] == 1
