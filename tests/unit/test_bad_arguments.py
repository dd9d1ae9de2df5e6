"""A catalogue of bad arguments: each is refused at construction (before any state is built)
with one line that names the argument or key; the CLIs print that line without a traceback.

Consumers: the ZeroOptimizer constructor, ``zeroshard.initialize`` with a DeepSpeed config
(dict and JSON file), ``zeroshard finetune`` and ``zeroshard bench aio`` (in-process, through
``zeroshard.cli.main``). ``test_catalogue_counts`` prints how many cases each consumer has."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.cli import main as cli

pytest.importorskip("transformers")


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def _meta_in_one() -> nn.Module:
    m = _net()
    m[0].weight = nn.Parameter(torch.empty(4, 4, device="meta"))
    return m


def _check(exc: BaseException, expected: str) -> None:
    msg = str(exc)
    assert isinstance(exc, (ValueError, TypeError, RuntimeError)), f"{type(exc).__name__}: {msg}"
    assert expected in msg, f"{expected!r} not named in: {msg}"
    assert "\n" not in msg, f"more than one line: {msg}"


# -- constructor ------------------------------------------------------------------------------
A = torch.optim.AdamW
CONSTRUCTOR = [  # (id, model factory, optimizer class, kwargs, what the message must name)
    ("loss-scale-inf", _net, A, dict(mixed_precision="fp16", initial_loss_scale=math.inf), "initial_loss_scale=inf"),
    ("loss-scale-0", _net, A, dict(mixed_precision="fp16", initial_loss_scale=0), "initial_loss_scale=0"),
    ("stage-2.7", _net, A, dict(stage=2.7), "stage=2.7"),
    ("stage-str", _net, A, dict(stage="3"), "stage='3'"),
    ("stage-bool", _net, A, dict(stage=True), "stage=True"),
    ("stage-5", _net, A, dict(stage=5), "stage=5"),
    ("nvme-path-alone", _net, A, dict(nvme_path="/tmp"), "nvme_path='/tmp'"),
    ("nvme-path-cpu", _net, A, dict(nvme_path="/tmp", offload_optimizer="cpu"), "nvme_path='/tmp'"),
    ("nvme-path-int", _net, A, dict(nvme_path=5, offload_optimizer="nvme"), "nvme_path=5"),
    ("nvme-no-path", _net, A, dict(offload_optimizer="nvme"), "nvme_path"),
    ("fused-adam-str", _net, A, dict(fused_adam="no"), "fused_adam='no'"),
    ("inflight-float", _net, A, dict(max_inflight_buckets=1.5), "max_inflight_buckets=1.5"),
    ("inflight-bool", _net, A, dict(max_inflight_buckets=True), "max_inflight_buckets=True"),
    ("inflight-0", _net, A, dict(max_inflight_buckets=0), "max_inflight_buckets=0"),
    ("live-units-0", _net, A, dict(max_live_units=0), "max_live_units=0"),
    ("bucket-str", _net, A, dict(bucket_size_mb="25"), "bucket_size_mb='25'"),
    ("bucket-inf", _net, A, dict(bucket_size_mb=math.inf), "bucket_size_mb=inf"),
    ("bucket-nan", _net, A, dict(bucket_size_mb=math.nan), "bucket_size_mb=nan"),
    ("bucket-neg", _net, A, dict(bucket_size_mb=-1), "bucket_size_mb=-1"),
    ("buffer-neg", _net, A, dict(offload_optimizer="cpu", offload_buffer_mb=-1), "offload_buffer_mb=-1"),
    ("growth-0", _net, A, dict(loss_scale_growth_interval=0), "loss_scale_growth_interval=0"),
    ("growth-float", _net, A, dict(loss_scale_growth_interval=2.5), "loss_scale_growth_interval=2.5"),
    ("unit-classes-str", _net, A, dict(stage=3, stage3_unit_classes="Block"), "stage3_unit_classes='Block'"),
    ("unit-classes-ints", _net, A, dict(stage=3, stage3_unit_classes=[1]), "stage3_unit_classes=[1]"),
    ("unit-numel-float", _net, A, dict(stage=3, stage3_unit_numel=2.5), "stage3_unit_numel=2.5"),
    ("precision-fp8", _net, A, dict(mixed_precision="fp8"), "mixed_precision='fp8'"),
    ("precision-bool", _net, A, dict(mixed_precision=True), "mixed_precision=True"),
    ("offload-disk", _net, A, dict(offload_optimizer="disk"), "offload_optimizer='disk'"),
    ("offload-params-stage2", _net, A, dict(offload_params="cpu"), "offload_params='cpu'"),
    ("reduce-int8", _net, A, dict(reduce_dtype="int8"), "reduce_dtype='int8'"),
    ("lr-str", _net, A, dict(lr="fast"), "lr='fast'"),
    ("lr-neg", _net, A, dict(lr=-1.0), "lr=-1.0"),
    ("lr-nan", _net, A, dict(lr=math.nan), "lr=nan"),
    ("betas-int", _net, A, dict(betas=5), "betas=5"),
    ("betas-one", _net, A, dict(betas=(0.9,)), "betas=(0.9,)"),
    ("betas-range", _net, A, dict(betas=(0.9, 1.5)), "betas=(0.9, 1.5)"),
    ("eps-str", _net, A, dict(eps="small"), "eps='small'"),
    ("wd-none", _net, A, dict(weight_decay=None), "weight_decay=None"),
    ("amsgrad-str", _net, A, dict(amsgrad="yes"), "amsgrad='yes'"),
    ("momentum-neg", _net, torch.optim.SGD, dict(lr=0.1, momentum=-1), "momentum=-1"),
    ("unknown-option", _net, A, dict(stagee=2), "stagee"),
    ("not-elementwise", _net, torch.optim.LBFGS, dict(), "LBFGS"),
    ("optimizer-str", _net, "AdamW", dict(), "optimizer_class"),
    ("group-no-params", lambda: [{"lr": 0.1}], torch.optim.SGD, dict(lr=0.1), "param group 0 has no 'params'"),
    ("group-lr-str", lambda: [{"params": list(_net().parameters()), "lr": "x"}], torch.optim.SGD, dict(lr=0.1),
     "param group 0: lr='x'"),
    ("group-params-str", lambda: [{"params": "weights"}], torch.optim.SGD, dict(lr=0.1), "'params' is a str"),
    ("params-tensor", lambda: torch.zeros(3, requires_grad=True), torch.optim.SGD, dict(lr=0.1), "single Tensor"),
    ("params-int", lambda: 5, torch.optim.SGD, dict(lr=0.1), "model_or_params"),
    ("params-empty", lambda: [], torch.optim.SGD, dict(lr=0.1), "empty parameter list"),
    ("meta-one-stage2", _meta_in_one, A, dict(), "'0.weight' are on the meta device"),
    ("meta-one-stage0", _meta_in_one, A, dict(stage=0), "'0.weight' are on the meta device"),
    ("meta-list", lambda: [nn.Parameter(torch.empty(3, device="meta"))], torch.optim.SGD, dict(lr=0.1),
     "on the meta device"),
    ("stage3-list", lambda: list(_net().parameters()), A, dict(stage=3), "nn.Module"),
    ("budget-neg-str", _net, A, dict(offload="auto", memory_budget="-1"), "memory_budget='-1'"),
    ("budget-overflow", _net, A, dict(offload="auto", memory_budget="1e400GB"), "memory_budget='1e400GB'"),
    ("budget-nan", _net, A, dict(offload="auto", memory_budget=math.nan), "memory_budget=nan"),
    ("budget-host-empty", _net, A, dict(offload="auto", memory_budget={"host": ""}), "memory_budget['host']=''"),
]


@pytest.mark.parametrize("case", CONSTRUCTOR, ids=[c[0] for c in CONSTRUCTOR])
def test_constructor_refuses(case, tmp_path):
    _, make, cls, kwargs, expected = case
    with pytest.raises(Exception) as info:
        zeroshard.ZeroOptimizer(make(), cls, **kwargs)
    _check(info.value, expected)
    assert os.listdir(tmp_path) == []


def test_stage3_meta_model_still_works():
    from zeroshard.testing.toy import GPTConfig, TinyGPT, synthetic_batch
    cfg = GPTConfig(vocab=32, d_model=16, n_layers=2, n_heads=2, seq_len=8)
    with torch.device("meta"):
        model = TinyGPT(cfg)
    opt = zeroshard.ZeroOptimizer(model, A, lr=1e-2, stage=3)
    zeroshard.init_meta_weights(model)
    model(*synthetic_batch(0, 2, cfg)).backward()
    opt.step()


# -- initialize with a DeepSpeed config -----------------------------------------------------------
OPT = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def _z(**zero) -> dict:
    return {**OPT, "zero_optimization": zero}


DEEPSPEED = [  # (id, config dict or a file's bytes, initialize overrides, what the message must name)
    ("stage-2.7", _z(stage=2.7), {}, "zero_optimization.stage=2.7"),
    ("stage-str", _z(stage="3"), {}, "zero_optimization.stage='3'"),
    ("stage-bool", _z(stage=True), {}, "zero_optimization.stage=True"),
    ("stage-override", OPT, {"stage": 2.5}, "stage=2.5"),
    ("clip-neg", {**OPT, "gradient_clipping": -1}, {}, "gradient_clipping=-1"),
    ("clip-str", {**OPT, "gradient_clipping": "1.0"}, {}, "gradient_clipping='1.0'"),
    ("clip-nan", {**OPT, "gradient_clipping": math.nan}, {}, "gradient_clipping=nan"),
    ("fp16-yes", {**OPT, "fp16": {"enabled": "yes"}}, {}, "fp16.enabled='yes'"),
    ("bf16-int", {**OPT, "bf16": {"enabled": 1}}, {}, "bf16.enabled=1"),
    ("fp16-not-object", {**OPT, "fp16": True}, {}, "fp16=True"),
    ("scale-power", {**OPT, "fp16": {"enabled": True, "initial_scale_power": 1000}}, {}, "fp16.initial_scale_power=1000"),
    ("scale-window", {**OPT, "fp16": {"enabled": True, "loss_scale_window": 0.5}}, {}, "fp16.loss_scale_window=0.5"),
    ("micro-true", {**OPT, "train_micro_batch_size_per_gpu": True}, {}, "train_micro_batch_size_per_gpu=True"),
    ("micro-override-true", OPT, {"micro_batch_size": True}, "micro_batch_size=True"),
    ("accum-float", {**OPT, "gradient_accumulation_steps": 1.5}, {}, "gradient_accumulation_steps=1.5"),
    ("batch-mismatch", {**OPT, "train_batch_size": 30, "train_micro_batch_size_per_gpu": 4,
                        "gradient_accumulation_steps": 2}, {}, "train_batch_size=30"),
    ("lr-str", {"optimizer": {"type": "AdamW", "params": {"lr": "fast"}}}, {}, "optimizer.params.lr='fast'"),
    ("betas-int", {"optimizer": {"type": "AdamW", "params": {"betas": 5}}}, {}, "optimizer.params.betas=5"),
    ("lr-override", OPT, {"lr": "fast"}, "lr='fast'"),
    ("params-list", {"optimizer": {"type": "AdamW", "params": [1]}}, {}, "optimizer.params=[1]"),
    ("optimizer-str", {"optimizer": "AdamW"}, {}, "optimizer='AdamW'"),
    ("optimizer-type-int", {"optimizer": {"type": 5}}, {}, "optimizer.type=5"),
    ("optimizer-lamb", {"optimizer": {"type": "Lamb"}}, {}, "optimizer.type='Lamb'"),
    ("adam-w-mode", {"optimizer": {"type": "Adam", "params": {"adam_w_mode": "no"}}}, {}, "adam_w_mode='no'"),
    ("bucket-bool", _z(stage=2, reduce_bucket_size=True), {}, "reduce_bucket_size=True"),
    ("bucket-neg", _z(stage=2, reduce_bucket_size=-1), {}, "reduce_bucket_size=-1"),
    ("device-list", _z(stage=2, offload_optimizer={"device": ["cpu"]}), {}, "offload_optimizer.device=['cpu']"),
    ("nvme-path-int", _z(stage=2, offload_optimizer={"device": "nvme", "nvme_path": 5}), {},
     "offload_optimizer.nvme_path=5"),
    ("nvme-no-path", _z(stage=2, offload_optimizer={"device": "nvme"}), {}, "nvme_path"),
    ("sched-steps-str", {**OPT, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "10"}}}, {},
     "scheduler.params.warmup_num_steps='10'"),
    ("sched-ratio", {**OPT, "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100,
                                                                               "cos_min_ratio": 5}}}, {},
     "scheduler.params.cos_min_ratio=5"),
    ("sched-cosine-short", {**OPT, "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 5,
                                                                                      "warmup_num_steps": 10}}},
     {}, "scheduler.params.total_num_steps=5 must exceed"),
    ("sched-type-list", {**OPT, "scheduler": {"type": ["WarmupLR"]}}, {}, "scheduler.type=['WarmupLR']"),
    ("sched-onecycle", {**OPT, "scheduler": {"type": "OneCycle"}}, {}, "scheduler.type='OneCycle'"),
    ("comm-dtype-list", {**OPT, "communication_data_type": ["fp16"]}, {}, "communication_data_type=['fp16']"),
    ("steps-per-print-0", {**OPT, "steps_per_print": 0}, {}, "steps_per_print=0"),
    ("unsupported-key", {**OPT, "zero_optimization": {"stage": 2, "frobnicate": 1}}, {},
     "zero_optimization.frobnicate"),
    ("no-optimizer", {}, {}, "'optimizer' section"),
    ("unknown-override", OPT, {"stagee": 2}, "stagee"),
    ("file-binary", bytes(range(256)), {}, "not UTF-8"),
    ("file-deep-list", b"[" * 100000 + b"]" * 100000, {}, "nests deeper"),
    ("file-deep-object", b'{"a":' * 100 + b"1" + b"}" * 100, {}, "nests more than"),
    ("file-bad-json", b'{"optimizer": ', {}, "not valid JSON"),
    ("file-list", b"[1, 2]", {}, "holds a list"),
    ("file-missing", None, {}, "cannot open"),
    ("file-directory", "dir", {}, "not a regular file"),
    ("file-fifo", "fifo", {}, "not a regular file"),
]


@pytest.mark.parametrize("case", DEEPSPEED, ids=[c[0] for c in DEEPSPEED])
def test_initialize_refuses(case, tmp_path):
    _, config, overrides, expected = case
    if isinstance(config, (bytes, type(None), str)):
        path = tmp_path / "ds.json"
        if isinstance(config, bytes):
            path.write_bytes(config)
        elif config == "dir":
            path.mkdir()
        elif config == "fifo":
            os.mkfifo(path)
        config = str(path)
    with pytest.raises(Exception) as info:
        zeroshard.initialize(_net(), config, **overrides)
    _check(info.value, expected)


# -- CLIs ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    from zeroshard.train.demo import write_corpus, write_tiny_gpt2
    root = tmp_path_factory.mktemp("ws")
    cfg = write_tiny_gpt2(str(root / "tiny"), n_embd=16, n_layer=1, n_positions=32)
    files = {
        "cfg": cfg, "data": write_corpus(str(root / "c.jsonl"), documents=4),
        "nodir": str(root / "missing"), "file": cfg, "emptydir": str(root / "empty"),
        "binary": str(root / "binary.txt"), "badjson": str(root / "bad.jsonl"), "nofield": str(root / "nof.jsonl"),
        "deep": str(root / "deep.jsonl"), "short": str(root / "short.txt"), "fifo": str(root / "fifo.txt"),
        "badcfg": str(root / "badcfg.json"), "bincfg": str(root / "bincfg.json"), "typecfg": str(root / "type.json"),
        "noweights": str(root / "noweights"), "badweights": str(root / "badweights"), "ds_bin": str(root / "ds.bin"),
        "ds_stage": str(root / "ds_stage.json"), "ds_key": str(root / "ds_key.json"),
    }
    os.makedirs(files["emptydir"])
    open(files["binary"], "wb").write(bytes(range(128, 256)) * 64)
    open(files["badjson"], "w").write('{"text": "a"}\n{"text": \n')
    open(files["nofield"], "w").write('{"body": "hello"}\n')
    open(files["deep"], "w").write("[" * 100000 + "]" * 100000 + "\n")
    open(files["short"], "w").write("hi")
    os.mkfifo(files["fifo"])
    open(files["badcfg"], "w").write("{not json")
    open(files["bincfg"], "wb").write(bytes(range(256)))
    open(files["typecfg"], "w").write(json.dumps({"model_type": "no-such-model"}))
    for d in ("noweights", "badweights"):
        os.makedirs(files[d])
        open(os.path.join(files[d], "config.json"), "w").write(open(cfg).read())
    open(os.path.join(files["badweights"], "model.safetensors"), "wb").write(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    open(files["ds_bin"], "wb").write(bytes(range(256)))
    open(files["ds_stage"], "w").write(json.dumps({**OPT, "zero_optimization": {"stage": 2.7}}))
    open(files["ds_key"], "w").write(json.dumps({**OPT, "frobnicate": 1}))
    files["out"] = str(root / "out")
    return files


BASE = ("--max-steps", "3", "--lr-schedule", "constant", "--no-progress", "--no-export", "--seq-len", "8")
FINETUNE = [  # (id, arguments with {placeholders} from the workspace, what the one line must name)
    ("stage-7", "--stage 7", "--stage"),
    ("seq-len-str", "--seq-len abc", "--seq-len"),
    ("lr-str", "--lr fast", "--lr"),
    ("precision", "--precision fp8", "--precision"),
    ("unknown-flag", "--frobnicate", "--frobnicate"),
    ("no-model", "NOMODEL", "--model"),
    ("both-models", "--model {noweights}", "exactly one of --model"),
    ("seq-len-0", "--seq-len 0", "--seq-len=0"),
    ("micro-neg", "--micro-batch-size -1", "--micro-batch-size=-1"),
    ("lr-inf", "--lr inf", "--lr=inf"),
    ("lr-nan", "--lr nan", "--lr=nan"),
    ("clip-neg", "--grad-clip -1", "--grad-clip=-1"),
    ("timeout-inf", "--collective-timeout inf", "--collective-timeout=inf"),
    ("min-lr-ratio", "--min-lr-ratio 2", "--min-lr-ratio=2"),
    ("cosine-short", "--lr-schedule cosine --max-steps 2", "--lr-schedule cosine"),
    ("bucket-0", "--bucket-size-mb 0", "--bucket-size-mb=0"),
    ("warmup-neg", "--warmup-steps -1", "--warmup-steps=-1"),
    ("offload-params-stage2", "--offload-params cpu", "--offload-params cpu: offload_params='cpu' needs stage=3"),
    ("offload-optimizer-stage0", "--stage 0 --offload-optimizer cpu",  # (ZeroConfig's rule: Note [one validator])
     "--stage 0 --offload-optimizer cpu --offload-params none: offload_optimizer='cpu' needs stage >= 1"),
    ("nvme-no-path", "--offload-optimizer nvme", "--nvme-path"),
    ("nvme-path-alone", "--nvme-path /tmp", "--nvme-path /tmp"),
    ("model-missing", "MODEL {nodir}", "does not exist"),
    ("model-file", "MODEL {file}", "is not a directory"),
    ("model-no-config", "MODEL {emptydir}", "has no config.json"),
    ("model-no-weights", "MODEL {noweights}", "no *.safetensors"),
    ("model-bad-weights", "MODEL {badweights}", "cannot build a causal LM"),
    ("config-not-json", "CONFIG {badcfg}", "cannot read the model config"),
    ("config-binary", "CONFIG {bincfg}", "cannot read the model config"),
    ("config-type", "CONFIG {typecfg}", "cannot read the model config"),
    ("config-dir-empty", "CONFIG {emptydir}", "has no config.json"),
    ("seq-len-long", "--seq-len 1000", "--seq-len 1000 is longer than the model's 32 positions"),
    ("data-missing", "DATA {nodir}", "does not exist"),
    ("data-dir", "DATA {emptydir}", "not a regular file"),
    ("data-fifo", "DATA {fifo}", "not a regular file"),
    ("data-binary", "DATA {binary}", "not UTF-8"),
    ("data-bad-jsonl", "DATA {badjson}", "bad.jsonl:2 is not a JSON object"),
    ("data-no-field", "DATA {nofield}", "no string field 'text'"),
    ("data-deep", "DATA {deep}", "nests too deeply"),
    ("data-short", "DATA {short}", "fewer than one block"),
    ("text-field", "--text-field body", "no string field 'body'"),
    ("output-is-file", "OUT {file}", "--output-dir"),
    ("ds-missing", "--deepspeed {nodir}", "cannot open the DeepSpeed config"),
    ("ds-binary", "--deepspeed {ds_bin}", "not UTF-8"),
    ("ds-stage", "--deepspeed {ds_stage}", "zero_optimization.stage=2.7"),
    ("ds-unsupported", "--deepspeed {ds_key}", "frobnicate"),
    ("lora-r-neg", "--lora-r -1", "--lora-r=-1"),
    ("lora-alpha-0", "--lora-r 4 --lora-alpha 0", "--lora-alpha=0"),
    ("lora-alpha-alone", "--lora-alpha 8", "need --lora-r"),
    ("lora-dropout-1", "--lora-r 4 --lora-dropout 1", "--lora-dropout=1"),
    ("lora-targets-empty", "--lora-r 4 --lora-targets ,", "names no module"),
    ("lora-targets-unknown", "--lora-r 4 --lora-targets nosuchlayer", "LoRA on"),
    ("peft-config-missing", "--peft-config {nodir}", "--peft-config"),
    ("peft-config-and-flags", "--peft-config {badcfg} --lora-r 4", "not both"),
    ("peft-config-bad", "--peft-config {typecfg}", "--peft-config"),
]


def _finetune_argv(ws: dict, spec: str, out: str) -> list[str]:
    model, data, output = ["--model-config", ws["cfg"]], ["--data", ws["data"]], ["--output-dir", out]
    extra = spec.format(**ws).split()
    if extra[:1] == ["NOMODEL"]:
        model, extra = [], extra[1:]
    elif extra[:1] == ["MODEL"]:
        model, extra = ["--model", extra[1]], extra[2:]
    elif extra[:1] == ["CONFIG"]:
        model, extra = ["--model-config", extra[1]], extra[2:]
    elif extra[:1] == ["DATA"]:
        data, extra = ["--data", extra[1]], extra[2:]
    elif extra[:1] == ["OUT"]:
        output, extra = ["--output-dir", extra[1]], extra[2:]
    elif extra[:1] == ["--model"]:
        model = model + extra[:2]
        extra = extra[2:]
    return ["finetune", *model, *data, *output, *BASE, *extra]


def _run_cli(argv: list[str], capsys) -> tuple[int, str]:
    try:
        rc = cli(argv)
    except SystemExit as exc:  # argparse: usage errors
        rc = exc.code if isinstance(exc.code, int) else 1
    return rc, capsys.readouterr().err


def _check_cli(rc: int, err: str, expected: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc not in (0, None), err
    assert "Traceback" not in err, err
    assert len(lines) == 1, f"expected one line, got {len(lines)}: {err}"
    assert expected in lines[0], f"{expected!r} not named in: {lines[0]}"


@pytest.mark.parametrize("case", FINETUNE, ids=[c[0] for c in FINETUNE])
def test_finetune_cli_refuses(case, ws, capsys, tmp_path):
    _, spec, expected = case
    rc, err = _run_cli(_finetune_argv(ws, spec, str(tmp_path / "out")), capsys)
    _check_cli(rc, err, expected)


def test_finetune_debug_shows_the_traceback(ws, tmp_path):
    with pytest.raises(ValueError, match="--seq-len 1000"):
        cli(_finetune_argv(ws, "--seq-len 1000 --debug", str(tmp_path / "out")))


AIO = [  # (id, arguments, what the one line must name)
    ("size-neg", "--size -5", "--size"),
    ("size-inf", "--size 1e400", "--size"),
    ("size-word", "--size lots", "--size"),
    ("size-unaligned", "--size 5000", "--size 5000"),
    ("block-unaligned", "--block-sizes 1000", "--block-sizes"),
    ("block-empty", "--block-sizes ,", "--block-sizes"),
    ("depth-word", "--queue-depths x", "--queue-depths"),
    ("depth-0", "--queue-depths 0", "--queue-depths"),
    ("backend", "--backend foo", "--backend"),
    ("path-missing", "PATH missing", "--path"),
    ("path-file", "PATH file", "--path"),
    ("no-path", "NOPATH", "--path"),
]


@pytest.mark.parametrize("case", AIO, ids=[c[0] for c in AIO])
def test_bench_aio_cli_refuses(case, capsys, tmp_path):
    _, spec, expected = case
    extra = spec.split()
    path = ["--path", str(tmp_path)]
    if extra[:1] == ["PATH"]:
        target = tmp_path / extra[1]
        if extra[1] == "file":
            target.write_bytes(b"x")
        path, extra = ["--path", str(target)], []
    elif extra == ["NOPATH"]:
        path, extra = [], []
    rc, err = _run_cli(["bench", "aio", *path, *extra], capsys)
    _check_cli(rc, err, expected)


def test_catalogue_counts():
    counts = {"constructor": len(CONSTRUCTOR), "initialize": len(DEEPSPEED), "finetune": len(FINETUNE),
              "bench aio": len(AIO)}
    print(f"bad-argument catalogue: {counts}, total {sum(counts.values())}")
    assert sum(counts.values()) >= 150


def test_a_64_mib_single_line_data_file_is_tokenised_in_bounded_memory(tmp_path):
    """The tokens (int32) are the only copy of the data held: a single 64 MiB line costs about
    5 bytes of memory per byte of text, not the ~30 of a Python list of ints."""
    import subprocess
    import sys
    text = "word " * ((64 << 20) // 5)
    (tmp_path / "one.jsonl").write_text(json.dumps({"text": text}) + "\n")
    del text
    code = ("import resource, sys, torch\n"
            "from zeroshard.train.text_data import ByteTokenizer, load_blocks\n"
            "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "blocks = load_blocks(sys.argv[1], ByteTokenizer(256), 128, sys.argv[2])\n"
            "print(blocks.shape[0], (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "one.jsonl"), str(tmp_path / "cache")],
                         capture_output=True, text=True, timeout=300, check=True).stdout.split()
    n, grew = int(out[0]), int(out[1])
    assert n == (64 << 20) // 5 * 5 // 128 and grew < 6 * (64 << 20), f"peak grew by {grew / 2**20:.0f} MiB"
