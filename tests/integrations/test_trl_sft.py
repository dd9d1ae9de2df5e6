"""TRL's SFTTrainer with a ZeroOptimizer (issue 39): the real trl, one process, a tiny GPT-2 and a
word-level tokenizer built in memory (no download). The losses and weights match the same
SFTTrainer with torch's AdamW, and ``SFTTrainer(peft_config=...)`` over an optimizer built on the
base model is refused naming the fix (get_peft_model first, then the optimizer)."""
from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("transformers")
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

import zeroshard  # noqa: E402
from zeroshard.integrations.transformers import ZeroCallback  # noqa: E402

LR = 3e-3


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(["<eos>", "<unk>"] + [f"w{i}" for i in range(62)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>", pad_token="<eos>")


def _model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0))


def _data() -> Dataset:
    g = torch.Generator().manual_seed(0)
    return Dataset.from_dict({"text": [" ".join(f"w{int(i)}" for i in torch.randint(0, 62, (12,), generator=g))
                                       for _ in range(16)]})


def _config(out: str) -> SFTConfig:
    return SFTConfig(output_dir=out, report_to=[], use_cpu=True, bf16=False, fp16=False, learning_rate=LR,
                     max_steps=4, per_device_train_batch_size=4, logging_steps=1, save_strategy="no", max_length=16,
                     seed=0, data_seed=0, dataloader_num_workers=0, weight_decay=0.0, lr_scheduler_type="constant",
                     warmup_steps=0, optim="adamw_torch")  # (torch.optim.AdamW: transformers 5 defaults to the fused one)


def _losses(trainer: SFTTrainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("stage", [1, 2])
def test_sft_trainer_trains_as_with_torch_adamw(tmp_path, stage):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = SFTTrainer(model=_model(), args=_config(str(tmp_path / "ref")), train_dataset=_data(),
                         processing_class=_tokenizer())
        ref.train()
        model = _model()
        opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, stage=stage, lr=LR, weight_decay=0.0)
        ours = SFTTrainer(model=model, args=_config(str(tmp_path / "zero")), train_dataset=_data(),
                          processing_class=_tokenizer(), optimizers=(opt, None), callbacks=[ZeroCallback()])
        ours.train()
    want, got = _losses(ref), _losses(ours)
    assert len(want) == 4 and got == pytest.approx(want, rel=1e-5, abs=1e-6), (want, got)
    # Weights within 2e-6 (measured 1.7e-6, in 3 elements of one bias): the SFTTrainer clips at
    # max_grad_norm=1.0 (the norm is ~1.1 here), and zeroshard's norm is summed in float64 where
    # torch's is float32; Adam then divides the gradient by sqrt(v) ~ eps for near-zero gradients,
    # which magnifies a last-bit difference of the clip coefficient. Issue 39 measured 1.2e-6 at 2 ranks.
    # (With the AVX2/AVX-512 kernels' fused multiply-adds the gap was 2.2e-6 with the packages of
    # 2026-12-06: Note [unfused update] in csrc/adam/adam_body.inc.)
    full = zeroshard.full_state_dict(model)
    for name, p in ref.model.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), rtol=1e-5, atol=2e-6, msg=lambda m, n=name: f"{n}: {m}")
    opt.close()


def test_sft_trainer_with_peft_config_names_the_fix(tmp_path):
    peft = pytest.importorskip("peft")
    model = _model()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, stage=0, lr=LR)
    with warnings.catch_warnings(), pytest.raises(ValueError, match=r"get_peft_model\(model, peft_config\)"):
        warnings.simplefilter("ignore")
        SFTTrainer(model=model, args=_config(str(tmp_path)), train_dataset=_data(), processing_class=_tokenizer(),
                   peft_config=peft.LoraConfig(r=2, target_modules=["c_attn"]), optimizers=(opt, None),
                   callbacks=[ZeroCallback()])
    opt.close()
