"""The Hugging Face Trainer's optimizer from ``TrainingArguments`` (``optimizer_from_args``), and
what the Trainer callback says when a trainer wrapped the model after the optimizer was built
(TRL's ``SFTTrainer(peft_config=...)`` does: it calls ``get_peft_model`` itself). One process."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

import zeroshard  # noqa: E402
from zeroshard.integrations.transformers import ZeroCallback, optimizer_from_args  # noqa: E402


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def _args(tmp_path, **kw) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, learning_rate=3e-3,
                             adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6, **kw)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_optimizer_from_args_is_the_trainers_optimizer(tmp_path, weight_decay):
    args = _args(tmp_path, weight_decay=weight_decay)
    ref_model, model = _model(), _model()
    ref = Trainer(model=ref_model, args=args).create_optimizer()
    opt = optimizer_from_args(model, args, stage=1)
    names = {id(p): n for n, p in model.named_parameters()}
    ref_names = {id(p): n for n, p in ref_model.named_parameters()}
    for g, r in zip(opt.param_groups, ref.param_groups, strict=True):
        for key in ("lr", "betas", "eps", "weight_decay"):
            assert g[key] == r[key], (key, g[key], r[key])
        assert [names[id(p)] for p in g["params"]] == [ref_names[id(p)] for p in r["params"]]
    assert [g["weight_decay"] for g in opt.param_groups] == [weight_decay, 0.0]
    # ... and it trains as the Trainer's torch.optim.AdamW does
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    for m, o in ((ref_model, ref), (model, opt)):
        for _ in range(3):
            m(input_ids=ids, labels=ids).loss.backward()
            o.step()
            o.zero_grad()
    full = zeroshard.full_state_dict(model)
    for n, p in ref_model.named_parameters():
        assert torch.allclose(full[n], p.detach(), rtol=1e-5, atol=1e-6), n
    opt.close()


def test_a_trainer_that_wraps_the_model_after_the_optimizer_names_the_fix(tmp_path):
    peft = pytest.importorskip("peft")
    base = _model()
    opt = zeroshard.ZeroOptimizer(base, torch.optim.AdamW, lr=1e-3, stage=0)
    wrapped = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["c_attn"]))  # (what peft_config= does)
    with pytest.raises(ValueError, match=r"get_peft_model\(model, peft_config\).*ZeroOptimizer\(model"):
        Trainer(model=wrapped, args=_args(tmp_path), optimizers=(opt, None), callbacks=[ZeroCallback()])
    opt.close()
