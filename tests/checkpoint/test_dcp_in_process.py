"""DCP checks that need no process group (world 1, in this process): what a DCP round trip
hands back, and that a DCP save leaves torch's process-wide serialization settings alone."""
from __future__ import annotations

import io
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


def test_async_dcp_save_leaves_torch_save_crc32_on_for_the_rest_of_the_process(tmp_path):
    """While the background thread writes the DCP chunks, a torch.save elsewhere in the process
    (here: at each chunk write) still writes its per-record CRC32s; the switch is never off."""
    model, opt = _trained()
    seen: list[tuple[bool, list[int]]] = []

    def at_chunk(point: str) -> None:
        if point == "dcp-chunk":
            buf = io.BytesIO()
            torch.save(torch.arange(1000.0), buf)
            seen.append((torch.serialization.get_crc32_options(),
                         [i.CRC for i in zipfile.ZipFile(io.BytesIO(buf.getvalue())).infolist()]))
    commit.fault_hook = at_chunk
    try:
        zeroshard.save_checkpoint(str(tmp_path), 1, model=model, optimizer=opt, format="dcp", async_save=True).wait()
    finally:
        commit.fault_hook = None
    assert seen and all(on and all(crcs) for on, crcs in seen), seen
    assert zeroshard.load_checkpoint(str(tmp_path), model=model, optimizer=opt)["step"] == 1
