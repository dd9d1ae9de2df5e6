"""LoRA on a tied embedding (``tie_word_embeddings=True``): ``export_merged`` writes what was
trained -- the merged embedding and the base output head, untied -- with a config.json that
says so (issue 43, section 2; Note [tied weights in a merged export]); PEFT's
``merge_and_unload`` keeps the tie and merges the delta into both."""
from __future__ import annotations

import json
import os

import pytest
import torch

import zeroshard
from tests.support import lora_worker as w

pytest.importorskip("peft")


def tied_lora(seed: int = 1) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM
    config = w.llama_config()
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    base = LlamaForCausalLM(config)
    assert base.lm_head.weight is base.model.embed_tokens.weight
    torch.manual_seed(seed)
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                           target_modules=["embed_tokens", "q_proj"]))


@pytest.mark.parametrize("stage", [1, 3])
def test_lora_on_a_tied_embedding_exports_untied_and_says_so(tmp_path, stage):
    from transformers import LlamaForCausalLM
    model = tied_lora()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=stage)
    for step in range(3):
        ids = w.tokens(step)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    trained = zeroshard.full_state_dict(model)
    out = str(tmp_path / "merged")
    zeroshard.export_merged(model, out, max_shard_size="200KB")
    opt.close()
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["tie_word_embeddings"] is False
    ref = tied_lora(seed=7)
    ref.load_state_dict(trained)
    ids = w.tokens(9)
    with torch.no_grad():
        want = ref(input_ids=ids).logits
    got = LlamaForCausalLM.from_pretrained(out)
    assert got.lm_head.weight is not got.model.embed_tokens.weight
    with torch.no_grad():
        assert (got(input_ids=ids).logits - want).abs().max() < 1e-5  # (the adapter model's own function)
    base_weight = trained["base_model.model.model.embed_tokens.base_layer.weight"]
    assert torch.equal(got.lm_head.weight, base_weight)  # (the head read the base weight in training)
    peft_merged = ref.merge_and_unload()  # PEFT keeps the tie: the delta reaches the head too
    assert peft_merged.lm_head.weight is peft_merged.model.embed_tokens.weight
    assert torch.equal(got.model.embed_tokens.weight, peft_merged.model.embed_tokens.weight)
    assert not torch.equal(got.lm_head.weight, peft_merged.lm_head.weight)
