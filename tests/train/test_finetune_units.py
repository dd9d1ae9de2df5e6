"""The fine-tuning pieces on their own: schedules against DeepSpeed's stepping, the config
translation, command-line options, text data, preemption flags, the watchdog."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys

import pytest
import torch

from zeroshard.checkpoint import jsontree
from zeroshard.train import faults
from zeroshard.train.finetune_config import FinetuneConfig, parse
from zeroshard.train.deepspeed_config import translate
from zeroshard.train.preemption import PreemptionHandler
from zeroshard.train.schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR, build_schedule
from zeroshard.train.text_data import ByteTokenizer, load_blocks, load_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class DeepSpeedStyle:
    """DeepSpeed's stepping, written independently: lr set at construction for iteration -1,
    ``step()`` after every optimizer step moves to the next iteration."""

    def __init__(self, kind: str, base_lr: float, **p) -> None:
        self.kind, self.base, self.p, self.it = kind, base_lr, p, -1

    def lr(self) -> float:
        p, it = self.p, self.it
        n = max(2, p.get("warmup_num_steps", 1000))
        ramp = (lambda i: math.log(i + 1) / math.log(n)) if p.get("warmup_type", "log") == "log" else (lambda i: i / n)
        if self.kind == "WarmupCosineLR":
            if it < 0:
                return 0.0
            if it < n:
                lo = p.get("warmup_min_ratio", 0.0)
                return self.base * (lo + ramp(it) * (1 - lo))
            cmin = p.get("cos_min_ratio", 1e-4)
            cos = (1 + math.cos(math.pi * (it - n + 1) / (p["total_num_steps"] - n))) / 2
            return self.base * max(0.0, cmin + (1 - cmin) * cos)
        lo, hi = p.get("warmup_min_lr", 0.0), p.get("warmup_max_lr", self.base)
        if it < 0:
            return lo
        if it < n:
            gamma = ramp(it)
        elif self.kind == "WarmupDecayLR":
            gamma = max(0.0, (p["total_num_steps"] - it) / max(1.0, p["total_num_steps"] - n))
        else:
            gamma = 1.0
        return lo + (hi - lo) * gamma


SCHEDULE_CASES = [
    ("WarmupLR", {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 7}),
    ("WarmupLR", {"warmup_max_lr": 0.01, "warmup_num_steps": 5, "warmup_type": "linear"}),
    ("WarmupLR", {"warmup_num_steps": 0}),  # DeepSpeed clamps the warmup to 2 steps
    ("WarmupDecayLR", {"total_num_steps": 20, "warmup_max_lr": 0.02, "warmup_num_steps": 4}),
    ("WarmupDecayLR", {"total_num_steps": 12, "warmup_min_lr": 0.001, "warmup_max_lr": 0.02,
                       "warmup_num_steps": 3, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 20, "warmup_num_steps": 5, "cos_min_ratio": 0.1}),
    ("WarmupCosineLR", {"total_num_steps": 15, "warmup_num_steps": 3, "warmup_min_ratio": 0.2,
                        "warmup_type": "linear"}),
]


@pytest.mark.parametrize("kind,params", SCHEDULE_CASES)
def test_schedules_follow_deepspeed_step_by_step_and_resume_from_state(kind, params):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.01)
    sched = build_schedule(kind, opt, params)
    ref = DeepSpeedStyle(kind, 0.01, **params)
    seen = []
    for _ in range(25):  # the lr each optimizer step uses, with the usual opt.step(); sched.step()
        seen.append(opt.param_groups[0]["lr"])
        assert opt.param_groups[0]["lr"] == pytest.approx(ref.lr(), rel=1e-12, abs=1e-15)
        opt.step()
        sched.step()
        ref.it += 1
    # The state is plain JSON (checkpoints store no pickle) and resumes the same sequence.
    state = jsontree.decode(json.loads(json.dumps(jsontree.encode(sched.state_dict()))))
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.01)
    resumed = build_schedule(kind, opt2, params)
    resumed.load_state_dict(state)
    for _ in range(5):
        opt.step(), opt2.step()
        sched.step()
        resumed.step()
        assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_schedule_state_is_the_position_so_a_longer_run_stretches_it():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    short = WarmupDecayLR(opt, 10, warmup_max_lr=0.1, warmup_num_steps=2, warmup_type="linear")
    for _ in range(6):
        opt.step()
        short.step()
    assert short.state_dict() == {"last_epoch": 6, "_step_count": 7}
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    longer = WarmupDecayLR(opt2, 20, warmup_max_lr=0.1, warmup_num_steps=2, warmup_type="linear")
    longer.load_state_dict(short.state_dict())
    # iteration 5 of a decay from step 2 to 20: (20 - 5) / 18 of the peak
    assert opt2.param_groups[0]["lr"] == pytest.approx(0.1 * 15 / 18)


def test_schedule_errors_name_the_fix():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.01)
    with pytest.raises(ValueError, match="warmup_type='cubic'"):
        WarmupLR(opt, warmup_type="cubic")
    with pytest.raises(ValueError, match="total_num_steps=5 must exceed warmup_num_steps=10"):
        WarmupCosineLR(opt, 5, warmup_num_steps=10)
    with pytest.raises(ValueError, match="total_num_steps=0"):
        WarmupDecayLR(opt, 0)
    with pytest.raises(ValueError, match="OneCycle"):
        build_schedule("OneCycle", opt)


def test_translate_maps_the_common_subset():
    plan = translate({
        "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 2**20,
                              "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"},
                              "offload_param": {"device": "nvme", "nvme_path": "/nvme"}},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "betas": [0.9, 0.95]}},
        "fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 500},
        "communication_data_type": "bf16",
    }, world_size=2)
    assert plan.zero == {"stage": 3, "offload_optimizer": "nvme", "offload_params": "nvme", "nvme_path": "/nvme",
                         "bucket_size_mb": 2.0, "mixed_precision": "fp16", "initial_loss_scale": 4096.0,
                         "loss_scale_growth_interval": 500, "reduce_dtype": "bf16"}
    assert plan.optimizer_class is torch.optim.AdamW  # DeepSpeed's Adam is AdamW unless adam_w_mode is false
    assert plan.optimizer_kwargs == {"weight_decay": 0.0, "lr": 1e-4, "betas": (0.9, 0.95)}
    assert (plan.micro_batch_size, plan.gradient_accumulation_steps, plan.gradient_clipping) == (4, 4, 1.0)


def test_translate_refuses_what_zeroconfig_refuses():
    """One validator (issue 44): a config the optimizer could not be built from is refused as the
    DeepSpeed config is read, with ZeroConfig's own message (parameters on NVMe need the
    optimizer state there too), not later at construction."""
    with pytest.raises(ValueError, match="DeepSpeed config: offload_params='nvme' needs offload_optimizer='nvme'"):
        translate({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                         "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}}, world_size=2)


def test_translate_auto_values():
    auto = {"train_micro_batch_size_per_gpu": "auto", "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_max_lr": "auto",
                                                              "warmup_min_lr": "auto"}},
            "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}, "bf16": {"enabled": "auto"}}
    with pytest.raises(ValueError, match="optimizer.params.lr is 'auto'.*pass lr="):
        translate(auto)
    with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu is 'auto'.*micro_batch_size="):
        translate(auto, overrides={"lr": 1.0, "total_num_steps": 10})
    plan = translate(auto, overrides={"micro_batch_size": 2, "lr": 3e-4, "total_num_steps": 100,
                                      "mixed_precision": "bf16"})
    assert plan.micro_batch_size == 2 and plan.optimizer_kwargs["lr"] == 3e-4
    assert plan.scheduler_params == {"total_num_steps": 100, "warmup_max_lr": None, "warmup_min_lr": 0.0}
    assert plan.zero["mixed_precision"] == "bf16" and "bucket_size_mb" not in plan.zero


def test_command_line_fills_a_hugging_face_style_all_auto_config(tmp_path):
    hf_style = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                "fp16": {"enabled": "auto", "loss_scale": 0}, "bf16": {"enabled": "auto"},
                "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                          "weight_decay": "auto"}},
                "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                                  "warmup_num_steps": "auto", "total_num_steps": "auto"}},
                "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                      "stage3_param_persistence_threshold": "auto"}}
    cfg = parse(["--data", "d.txt", "--output-dir", str(tmp_path), "--model-config", "c.json", "--deepspeed", "x",
                 "--bf16", "--micro-batch-size", "3", "--warmup-steps", "7", "--max-steps", "70", "--lr", "0.01"])
    with pytest.warns(UserWarning, match="stage3_prefetch_bucket_size"):
        plan = translate(hf_style, world_size=2, overrides=cfg.overrides(), auto=cfg.auto_values())
    assert plan.zero["stage"] == 3 and plan.zero["mixed_precision"] == "bf16"
    assert plan.optimizer_kwargs == {"weight_decay": 0.0, "lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8}
    assert plan.scheduler_params == {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 7,
                                     "total_num_steps": 70}
    assert (plan.micro_batch_size, plan.gradient_accumulation_steps, plan.train_batch_size) == (3, 1, 6)
    assert plan.gradient_clipping == 1.0


def test_translate_refusals_name_the_problem():
    with pytest.raises(ValueError, match="optimizer.type='OneBitAdam'"):
        translate({"optimizer": {"type": "OneBitAdam"}})
    with pytest.raises(ValueError, match="train_batch_size=30 != train_micro_batch_size_per_gpu=4"):
        translate({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
                  world_size=4)
    with pytest.raises(ValueError, match="scheduler.type='OneCycle'"):
        translate({"scheduler": {"type": "OneCycle"}})
    with pytest.raises(TypeError, match="unknown override"):
        translate({}, overrides={"learning_rate": 1.0})
    with pytest.raises(ValueError, match="nvme_path differ"):
        translate({"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/a"},
                                         "offload_param": {"device": "nvme", "nvme_path": "/b"}}})


def test_command_line_options_validate_and_translate(tmp_path):
    base = ["--data", "x.txt", "--output-dir", str(tmp_path)]
    with pytest.raises(ValueError, match="exactly one of --model"):
        parse(base)
    with pytest.raises(ValueError, match="--offload-params cpu: offload_params='cpu' needs stage=3"):
        parse(base + ["--model-config", "c.json", "--offload-params", "cpu"])
    with pytest.raises(ValueError, match="--micro-batch-size=0"):
        parse(base + ["--model-config", "c.json", "--micro-batch-size", "0"])
    cfg = parse(base + ["--model-config", "c.json", "--stage", "3", "--bf16", "--offload-optimizer", "cpu",
                        "--per-device-train-batch-size", "4", "--gradient-accumulation-steps", "8",
                        "--lr-schedule", "linear", "--warmup-steps", "10", "--max-steps", "100"])
    plan = translate(cfg.as_deepspeed(), world_size=2)
    assert plan.zero["stage"] == 3 and plan.zero["mixed_precision"] == "bf16"
    assert plan.zero["offload_optimizer"] == "cpu" and plan.micro_batch_size == 4
    assert plan.gradient_accumulation_steps == 8 and plan.scheduler == "WarmupDecayLR"
    # With --deepspeed, only flags given explicitly override the file.
    cfg = parse(base + ["--model-config", "c.json", "--deepspeed", "ds.json", "--lr", "0.5", "--fp16"])
    assert cfg.overrides() == {"lr": 0.5, "mixed_precision": "fp16"}
    assert FinetuneConfig(data="d", output_dir="o", model="m").explicit == frozenset()


def test_redundancy_flag_validates_and_reaches_the_optimizer(tmp_path):
    """``--redundancy peer`` (issue 45): a bad value or a refused combination names the fix at
    parse time; the flag becomes ``ZeroOptimizer(redundancy=PeerRedundancy(...))`` through
    ``initialize``, with a run id of the output directory; an NVMe DeepSpeed file is refused
    at construction (every rank builds the optimizer)."""
    import zeroshard
    from zeroshard.train.initialize_from_config import initialize
    base = ["--data", "x.txt", "--output-dir", str(tmp_path), "--model-config", "c.json"]
    with pytest.raises(SystemExit):  # argparse's choices
        parse(base + ["--redundancy", "buddy"])
    with pytest.raises(ValueError, match="--redundancy='buddy': use one of"):
        FinetuneConfig(data="d", output_dir="o", model="m", redundancy="buddy")
    with pytest.raises(ValueError, match="--redundancy-every=0 must be .auto. or a positive integer"):
        parse(base + ["--redundancy", "peer", "--redundancy-every", "0"])
    with pytest.raises(ValueError, match="add --redundancy peer, or drop them"):
        parse(base + ["--redundancy-every", "2"])
    with pytest.raises(ValueError, match="add --redundancy peer, or drop them"):
        parse(base + ["--redundancy-parity", "2"])
    with pytest.raises(ValueError, match="--redundancy-parity=1 must be an int >= 2"):
        parse(base + ["--redundancy", "peer", "--redundancy-parity", "1"])
    cfg = parse(base + ["--redundancy", "peer", "--redundancy-parity", "4"])
    assert cfg.peer_redundancy().parity == 4 and parse(base).redundancy_summary() is None
    assert cfg.redundancy_summary().startswith("memory tier: XOR parity over groups of 4 ranks, commit every auto step(s)")
    with pytest.raises(ValueError, match="does not combine with --offload-optimizer nvme"):
        parse(base + ["--redundancy", "peer", "--offload-optimizer", "nvme", "--nvme-path", str(tmp_path)])
    assert parse(base).peer_redundancy() is None
    cfg = parse(base + ["--redundancy", "peer", "--redundancy-every", "3", "--redundancy-path", str(tmp_path / "t")])
    peer = cfg.peer_redundancy()
    assert (peer.every, peer.root, peer.parity) == (3, str(tmp_path / "t"), None) and peer.run_id.startswith("finetune-")
    assert parse(base + ["--redundancy", "peer"]).peer_redundancy().every == "auto"  # (the default: Note [commit pacing])
    assert parse(base + ["--redundancy", "peer", "--redundancy-every", "auto"]).peer_redundancy().every == "auto"
    with pytest.raises(SystemExit):  # neither auto nor an integer
        parse(base + ["--redundancy", "peer", "--redundancy-every", "often"])
    assert parse(["--data", "y", "--output-dir", str(tmp_path / "other"), "--model-config", "c"] +
                 ["--redundancy", "peer"]).peer_redundancy().run_id != peer.run_id
    model = torch.nn.Linear(4, 4)
    opt = initialize(model, {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, redundancy=peer).optimizer
    assert opt.engine.memory_tier is not None and opt.engine.memory_tier.root == str(tmp_path / "t")
    opt.close()
    nvme = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}}
    with pytest.raises(ValueError, match="redundancy='peer' .* does not combine with NVMe offload"):
        initialize(torch.nn.Linear(4, 4), nvme, redundancy=zeroshard.PeerRedundancy(path=str(tmp_path / "n")))


def test_text_blocks_from_jsonl_with_byte_fallback(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"body": t}) for t in ("héllo world", "second doc")) + "\n")
    tok = load_tokenizer(None, vocab_size=257, eos_token_id=256)
    assert isinstance(tok, ByteTokenizer) and tok.eos_token_id == 256
    blocks = load_blocks(str(data), tok, 4, str(tmp_path / "cache"), text_field="body")
    ids = list("héllo world".encode()) + [256] + list(b"second doc") + [256]
    assert blocks.tolist() == torch.tensor(ids[:len(ids) // 4 * 4]).view(-1, 4).tolist()
    assert len(os.listdir(tmp_path / "cache")) == 1  # cached for the other ranks and for restarts
    with pytest.raises(ValueError, match="no string field 'text'"):
        load_blocks(str(data), tok, 4, str(tmp_path / "cache2"))
    with pytest.raises(ValueError, match="vocab_size=100 < 256"):
        load_tokenizer(None, vocab_size=100, eos_token_id=None)


def test_preemption_signal_only_sets_a_flag():
    with PreemptionHandler() as handler:
        assert not handler.requested
        os.kill(os.getpid(), signal.SIGUSR1)
        assert handler.received == signal.SIGUSR1
        stop, values = handler.agree(values=[2.5])  # one process: no collective
        assert stop and values == [2.5]
    assert signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, signal.default_int_handler)


def test_fault_spec_parsing():
    assert faults.from_env({"ZEROSHARD_FAULT": "sigkill@1:5"}) == faults.Fault("sigkill", 1, 5)
    assert faults.from_env({"ZEROSHARD_FAULT": "sigkill@1:5", "TORCHELASTIC_RESTART_COUNT": "1"}) is None
    assert faults.from_env({}) is None
    with pytest.raises(ValueError, match="use <kind>@<rank>:<step>"):
        faults.from_env({"ZEROSHARD_FAULT": "kill rank 1"})


def test_watchdog_exits_with_a_message_when_no_step_completes():
    code = ("import time; from zeroshard.train.failures import StepWatchdog; "
            "w = StepWatchdog(0.5, rank=1).start(); w.beat(7); time.sleep(30)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert "rank 1 made no progress for 0.5s after step 7" in proc.stderr


def test_zeroshard_finetune_subcommand_and_shipped_ds_config(tmp_path):
    from zeroshard.cli import build_parser
    args = build_parser().parse_args(["finetune", "--model-config", "c.json", "--data", "d.txt", "--output-dir",
                                      str(tmp_path), "--stage", "1", "--save-steps", "7"])
    cfg = FinetuneConfig.from_args(args)
    assert (cfg.stage, cfg.save_interval, cfg.explicit >= {"stage", "save_interval"}) == (1, 7, True)
    with pytest.warns(UserWarning, match="overlap_comm"):  # only supported keys; the no-op ones are named
        plan = translate(os.path.join(REPO, "examples", "ds_config.json"))
    assert plan.scheduler == "WarmupCosineLR" and plan.zero["stage"] == 2
