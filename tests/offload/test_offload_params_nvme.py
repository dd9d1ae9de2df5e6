"""offload_params='nvme' (stage 3): shards, fp32 masters and gradients in a swap file,
bit-identical to in-memory training, checkpointed straight from and into the files."""
from __future__ import annotations

import os

import pytest
import torch

import zeroshard
from tests.support.dist_results import run_ranks
from tests.support.nvme_params_worker import CFG, make, run
from tests.support.asserts import assert_same
from zeroshard.io import DiskFullError, TruncatedFileError
from zeroshard.testing.toy import GPTConfig, TinyGPT, synthetic_batch


@pytest.fixture(scope="module", params=[1, 2], ids=lambda w: f"world{w}")
def results(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"w{request.param}")
    return run_ranks(run, request.param, d, str(d))


@pytest.mark.parametrize("mp", [None, "bf16"])
def test_swapped_training_is_bit_identical(results, mp):
    for r in results:
        assert r[f"equal_{mp}"], r


@pytest.mark.parametrize("mp", [None, "bf16"])
def test_nothing_per_parameter_stays_resident(results, mp):
    for r in results:
        assert r[f"resident_{mp}"] == 0 and r[f"offloaded_{mp}"] > 0, r


@pytest.mark.parametrize("mp", [None, "bf16"])
def test_checkpoint_streams_out_of_and_into_swap_files(results, mp):
    for r in results:
        assert r[f"resumed_{mp}_swap"] and r[f"resumed_{mp}_memory"] and r[f"consolidated_{mp}"], r


def test_needs_nvme_optimizer_offload(tmp_path):
    with pytest.raises(ValueError, match="offload_optimizer='nvme' too"):
        zeroshard.ZeroOptimizer(TinyGPT(CFG), torch.optim.AdamW, stage=3, offload_params="nvme",
                                offload_optimizer="cpu", nvme_path=str(tmp_path))


def test_truncated_param_swap_file_fails_the_next_gather(tmp_path):
    model, opt = make(str(tmp_path))
    os.truncate(opt.engine.unit_store.path, 4096)
    with pytest.raises(TruncatedFileError, match="zeroshard-params"):
        model(*synthetic_batch(0, 2, CFG)).backward()


def test_disk_too_small_fails_at_construction(tmp_path):
    from tests.support.io_helpers import mount_tmpfs
    import subprocess
    d = mount_tmpfs("256k")
    try:
        with pytest.raises(DiskFullError, match="offload_params='nvme' needs"):
            zeroshard.ZeroOptimizer(TinyGPT(GPTConfig(vocab=512, d_model=64, n_layers=2, n_heads=4)),
                                    torch.optim.AdamW, stage=3, offload_optimizer="nvme", offload_params="nvme",
                                    nvme_path=d)
        assert [f for f in os.listdir(d) if "params" in f] == []  # nothing half-made left behind
    finally:
        subprocess.run(["umount", d])


def test_meta_model_initialises_straight_into_the_swap_file(tmp_path):
    with torch.device("meta"):
        model = TinyGPT(CFG)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=3, offload_optimizer="nvme",
                                  offload_params="nvme", nvme_path=str(tmp_path))
    zeroshard.init_meta_weights(model, seed=3)
    rep = opt.memory_report()
    assert rep.parameters == 0
    loss = model(*synthetic_batch(0, 2, CFG))
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    full = zeroshard.full_state_dict(model)
    assert all(torch.isfinite(v).all() for v in full.values())


def test_async_save_streams_while_training_goes_on(tmp_path):
    """An asynchronous save of swapped state reads the swap files while the next forward and
    backward run; the next step waits for it, so the checkpoint holds the saved step exactly."""
    from tests.support.nvme_params_worker import train
    import torch.distributed as dist
    from zeroshard.testing.launch import free_port
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model, opt = make(str(tmp_path))
        train(model, opt, 0, 2)
        handle = zeroshard.save_checkpoint(str(tmp_path / "ckpt"), 2, model=model, optimizer=opt, async_save=True)
        train(model, opt, 2, 2)  # overlaps the save; its step waits for the write
        handle.wait()
        want = zeroshard.full_state_dict(model)
        fresh, fopt = make(str(tmp_path), seed=5)
        zeroshard.load_checkpoint(str(tmp_path / "ckpt"), model=fresh, optimizer=fopt)
        train(fresh, fopt, 2, 2)
        got = zeroshard.full_state_dict(fresh)
        assert_same(got, want, "resumed weights")
    finally:
        dist.destroy_process_group()


def test_checkpoint_from_two_ranks_streams_into_one(tmp_path):
    """A checkpoint written from the swap files of 2 ranks loads at world size 1 straight into
    new swap files, and then holds exactly what an in-memory optimizer loads from it."""
    from tests.support.nvme_params_worker import save_swapped
    assert all(r["saved"] for r in run_ranks(save_swapped, 2, tmp_path, str(tmp_path)))
    loaded = []
    for nvme in (str(tmp_path), None):
        model, opt = make(nvme, "bf16", seed=7)
        info = zeroshard.load_checkpoint(str(tmp_path / "ckpt"), model=model, optimizer=opt)
        assert info["resharded"] and info["step"] == 2
        loaded.append((zeroshard.full_state_dict(model), opt.consolidated_state_dict()))
    (a, sa), (b, sb) = loaded
    assert_same(b, a, "weights")
    assert_same(sb["state"], sa["state"], "optimizer state")


def test_files_of_a_killed_run_are_removed_by_the_next(tmp_path):
    """A SIGKILLed run leaves its swap files behind; the next run of that rank on the same
    nvme_path removes them (their process is gone) and never reads them."""
    import signal
    import subprocess
    import sys
    code = ("import os, signal, torch, zeroshard\n"
            "from tests.support.nvme_params_worker import make, CFG\n"
            "from zeroshard.testing.toy import synthetic_batch\n"
            f"model, opt = make({str(tmp_path)!r})\n"
            "model(*synthetic_batch(0, 2, CFG)).backward(); opt.step()\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert proc.wait(timeout=120) == -signal.SIGKILL
    left = sorted(f for f in os.listdir(tmp_path) if f.endswith(".swap"))
    assert len(left) == 2 and f"-pid{proc.pid}-" in left[0]  # moments + parameters
    model, opt = make(str(tmp_path))
    now = sorted(f for f in os.listdir(tmp_path) if f.endswith(".swap"))
    assert not set(left) & set(now) and len(now) == 2
    model(*synthetic_batch(0, 2, CFG)).backward()
    opt.step()


@pytest.mark.parametrize("world", [1, 2])
def test_every_offload_placement_matches_memory_bit_for_bit(world, tmp_path):
    """offload_optimizer cpu/nvme at stages 1-3 and offload_params cpu/nvme at stage 3, fp32 and
    bf16, gradient accumulation and clipping, on 1 and 2 gloo ranks: the same bits as in memory."""
    from tests.support.nvme_params_worker import run_matrix
    for r in run_ranks(run_matrix, world, tmp_path, str(tmp_path)):
        assert len(r) == 2 * (2 + 2 + 4) and all(r.values()), [k for k, v in r.items() if not v]


def test_fp16_overflow_skips_and_zero_grad_to_zeros_match_memory(tmp_path):
    """fp16 loss scaling (overflowing steps skipped, scale halved) and zero_grad(set_to_none=False)
    behave exactly as in memory when gradients live in the swap file."""
    def run(nvme):
        torch.manual_seed(0)
        model = TinyGPT(CFG)
        opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=3, mixed_precision="fp16",
                                      initial_loss_scale=2.0**40, offload_optimizer="nvme" if nvme else None,
                                      offload_params="nvme" if nvme else None, nvme_path=nvme)
        scales = []
        for step in range(4):
            opt.backward(model(*synthetic_batch(step, 4, CFG)))
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad(set_to_none=step % 2 == 0)
            scales.append(opt.loss_scale)
        return zeroshard.full_state_dict(model), scales
    (a, sa), (b, sb) = run(None), run(str(tmp_path))
    assert sa == sb and sa[0] < 2.0**40  # overflow happened and was skipped alike
    assert_same(b, a, "weights, NVMe vs memory")


def test_safetensors_weights_load_straight_into_the_swap_file(tmp_path):
    from safetensors.torch import save_file
    torch.manual_seed(0)
    src = TinyGPT(CFG)
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(tmp_path / "m.safetensors"))
    with torch.device("meta"):
        model = TinyGPT(CFG)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, stage=3, offload_optimizer="nvme",
                                  offload_params="nvme", nvme_path=str(tmp_path))
    zeroshard.load_safetensors(model, str(tmp_path / "m.safetensors"))
    assert opt.memory_report().parameters == 0
    got = zeroshard.full_state_dict(model)
    assert_same(got, src.state_dict(), "loaded weights")


def test_clipping_reads_no_gradient_back_from_the_swap_file(tmp_path):
    """The 2-norm and the overflow check come from statistics noted when each gradient was last
    written; only other norm types read the gradients back."""
    model, opt = make(str(tmp_path))
    model(*synthetic_batch(0, 2, CFG)).backward()
    opt.engine.reducer.finalize()
    reads = []
    real = opt.engine.unit_store.aio.pread
    opt.engine.unit_store.aio.pread = lambda *a, **k: reads.append(a) or real(*a, **k)
    norm = opt.clip_grad_norm_(1.0)
    assert reads == [] and torch.isfinite(norm)
    opt.clip_grad_norm_(1.0, norm_type=float("inf"))
    assert len(reads) == len(opt.units)  # one read per unit for the max norm
