"""Fine-tune CLI edges (issue 28, "Defaults and messages"): a ``--peft-config`` written by PEFT
itself trains; bad values in it are refused naming the file, the field and the accepted range
(the same cap as ``--lora-r``); a missing text field names ``--text-field``; a DeepSpeed
``optimizer`` without a usable ``type`` names ``optimizer.type`` and the supported types."""
from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

from zeroshard.cli import main as cli  # noqa: E402
from zeroshard.train.finetune_config import FinetuneConfig  # noqa: E402


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    from zeroshard.train.demo import write_corpus, write_tiny_gpt2
    root = tmp_path_factory.mktemp("cli-edges")
    cfg = write_tiny_gpt2(str(root / "tiny"), n_embd=16, n_layer=1, n_positions=32)
    return {"root": root, "cfg": cfg, "data": write_corpus(str(root / "c.jsonl"), documents=4)}


def _run(argv: list[str], capsys) -> tuple[int, str]:
    try:
        rc = cli(argv)
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    return rc, capsys.readouterr().err


BASE = ("--max-steps", "2", "--lr-schedule", "constant", "--no-progress", "--no-export", "--seq-len", "8",
        "--save-interval", "100")


def _peft_written_adapter_config(ws: dict, directory: str) -> str:
    """What ``PeftModel.save_pretrained`` writes (``inference_mode: true`` among the rest)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ws["cfg"]))
    get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"])).save_pretrained(directory)
    path = os.path.join(directory, "adapter_config.json")
    with open(path) as f:
        assert json.load(f)["inference_mode"] is True  # (what PEFT writes: the trap this test is about)
    return path


def test_peft_config_written_by_peft_trains(ws, tmp_path, capsys):
    path = _peft_written_adapter_config(ws, str(tmp_path / "adapter"))
    lora = FinetuneConfig(data="d.txt", output_dir=str(tmp_path / "o"), model_config=ws["cfg"],
                          peft_config=path).lora_config()
    assert lora.inference_mode is False and lora.r == 4
    out = tmp_path / "run"
    rc, err = _run(["finetune", "--model-config", ws["cfg"], "--data", ws["data"], "--output-dir", str(out), *BASE,
                    "--peft-config", path], capsys)
    assert rc == 0, err  # (before: "no parameter requires grad", PEFT's inference_mode froze the adapters)


def _write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


BAD_PEFT = [  # (id, file contents, what the message must name besides the file)
    ("r-str", {"r": "8"}, ("'r'", "[1, 65536]")),
    ("r-float", {"r": 2.5}, ("'r'", "[1, 65536]")),
    ("r-huge", {"r": 1e9}, ("'r'", "[1, 65536]")),
    ("r-over-cap", {"r": 100000}, ("'r'", "[1, 65536]")),
    ("r-zero", {"r": 0}, ("'r'", "[1, 65536]")),
    ("r-bool", {"r": True}, ("'r'", "[1, 65536]")),
    ("alpha-str", {"r": 4, "lora_alpha": "16"}, ("'lora_alpha'", "positive")),
    ("alpha-nan", {"r": 4, "lora_alpha": float("nan")}, ("'lora_alpha'", "positive")),
    ("dropout-1.5", {"r": 4, "lora_dropout": 1.5}, ("'lora_dropout'", "[0, 1)")),
    ("targets-int", {"r": 4, "target_modules": 5}, ("'target_modules'",)),
    ("rank-pattern", {"r": 4, "rank_pattern": {"c_attn": 100000}}, ("'rank_pattern'", "[1, 65536]")),
    ("peft-type", {"r": 4, "peft_type": "IA3"}, ("'peft_type'", "LORA")),
    ("unknown", {"r": 4, "rr": 5}, ("'rr'",)),
    ("not-object", [1, 2], ("JSON object",)),
]


@pytest.mark.parametrize("case", BAD_PEFT, ids=[c[0] for c in BAD_PEFT])
def test_peft_config_bad_values_name_the_file_the_field_and_the_range(case, tmp_path):
    _, raw, expected = case
    path = _write(tmp_path, "adapter_config.json", json.dumps(raw))
    with pytest.raises(ValueError) as err:
        FinetuneConfig(data="d.txt", output_dir=str(tmp_path / "o"), model_config="c.json",
                       peft_config=path).lora_config()
    msg = str(err.value)
    assert path in msg and "\n" not in msg, msg
    for part in expected:
        assert part in msg, f"{part!r} not in: {msg}"


@pytest.mark.parametrize("text", ["{not json", "", "\xff\xfe", '{"r": ' * 100000])
def test_peft_config_unreadable_json_names_the_file(text, tmp_path):
    path = tmp_path / "adapter_config.json"
    path.write_bytes(text.encode("latin-1") if text.startswith("\xff") else text.encode())
    with pytest.raises(ValueError) as err:
        FinetuneConfig(data="d.txt", output_dir=str(tmp_path / "o"), model_config="c.json",
                       peft_config=str(path)).lora_config()
    assert str(path) in str(err.value) and "--peft-config" in str(err.value)


def test_lora_rank_cap_is_the_same_for_the_flag_the_file_and_the_planner(tmp_path):
    from zeroshard.planner.peft_shape import lora_counts
    from zeroshard.train.finetune_config import LORA_R_MAX
    assert LORA_R_MAX == 65536
    with pytest.raises(ValueError, match=r"\[1, 65536\]"):
        FinetuneConfig(data="d.txt", output_dir="o", model_config="c.json", lora_r=LORA_R_MAX + 1)
    FinetuneConfig(data="d.txt", output_dir="o", model_config="c.json", lora_r=LORA_R_MAX)  # the cap itself is fine
    path = _write(tmp_path, "a.json", json.dumps({"r": LORA_R_MAX + 1}))
    with pytest.raises(ValueError, match=r"\[1, 65536\]"):
        FinetuneConfig(data="d.txt", output_dir="o", model_config="c.json", peft_config=path).lora_config()
    with pytest.raises(ValueError, match=r"\[1, 65536\]"):
        lora_counts(str(tmp_path), LORA_R_MAX + 1)


# -- --text-field -------------------------------------------------------------------------------
FIELD_CASES = [  # (id, file name, contents, fields the message must list)
    ("missing", "d.jsonl", '{"content": "a b c", "id": 1}\n', ("'content'", "'id'")),
    ("missing-later", "d.jsonl", '{"text": "a b c"}\n{"text": "d e"}\n{"body": "f"}\n', ("'body'",)),
    ("null", "d.jsonl", '{"text": null, "body": "x"}\n', ("'body'", "null")),
    ("number", "d.jsonl", '{"text": 5}\n', ("int",)),
    ("json-array", "d.json", json.dumps([{"content": "a b"}, {"content": "c"}], indent=2), ("'content'",)),
]


@pytest.mark.parametrize("case", FIELD_CASES, ids=[c[0] for c in FIELD_CASES])
def test_missing_text_field_names_the_field_the_fields_there_and_the_flag(case, ws, tmp_path, capsys):
    _, name, text, fields = case
    data = _write(tmp_path, name, text)
    rc, err = _run(["finetune", "--model-config", ws["cfg"], "--data", data, "--output-dir", str(tmp_path / "o"),
                    *BASE], capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc not in (0, None) and len(lines) == 1 and "Traceback" not in err, err
    for part in ("'text'", "--text-field", *fields):
        assert part in lines[0], f"{part!r} not in: {lines[0]}"


def test_text_field_on_plain_text_is_refused_by_name(ws, tmp_path, capsys):
    data = _write(tmp_path, "d.txt", "plain text " * 50)
    rc, err = _run(["finetune", "--model-config", ws["cfg"], "--data", data, "--output-dir", str(tmp_path / "o"),
                    *BASE, "--text-field", "body"], capsys)
    assert rc not in (0, None) and "--text-field" in err and "d.txt" in err, err


# -- DeepSpeed optimizer.type --------------------------------------------------------------------
@pytest.mark.parametrize("section", [{"params": {"lr": 1e-3}}, {"type": "Optimizer", "params": {"lr": 1e-3}},
                                     {"type": "lr_scheduler", "params": {"lr": 1e-3}}, {"type": "Frobnicate"},
                                     {"type": ""}],
                         ids=["no-type", "base-class", "module", "unknown", "empty"])
def test_deepspeed_optimizer_type_errors_name_optimizer_type_and_the_supported_types(section):
    from zeroshard.train.deepspeed_config import translate
    with pytest.raises(ValueError) as err:
        translate({"optimizer": section})
    msg = str(err.value)
    assert "optimizer.type" in msg and "optimizer.params.lr" not in msg, msg
    for name in ("AdamW", "Adam", "SGD", "Adagrad"):
        assert name in msg, msg
