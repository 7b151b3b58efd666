"""In-memory extend_model on tiny GPT-2 and BERT models."""

from __future__ import annotations

import pytest
import torch

import posextend
from conftest import load_clean
from tiny import FAMILIES, POSITIONS


@pytest.mark.parametrize("family", ["gpt2", "bert"])
@pytest.mark.parametrize("headed", [True, False])
@pytest.mark.parametrize("strategy", ["tile", "interpolate", "random"])
def test_extend_model_then_save_and_load(family, headed, strategy, tmp_path):
    fam = FAMILIES[family]
    torch.manual_seed(0)
    model = (fam.headed if headed else fam.bare).from_config(fam.config()).eval()
    table_name = next(n for n in dict(model.named_parameters()) if n.endswith(("wpe.weight", "position_embeddings.weight")))
    old_table = dict(model.named_parameters())[table_name].detach().clone()
    returned = posextend.extend_model(model, 90, strategy, seed=1)
    assert returned is model
    table = dict(model.named_parameters())[table_name]
    assert table.shape == (90, 16) and table.requires_grad
    assert torch.equal(table.detach(), posextend.resize_table(old_table, 90, strategy, seed=1))
    for name, buf in model.named_buffers():
        if name.endswith(("position_ids", "token_type_ids")):
            assert buf.shape[-1] == 90
    with torch.no_grad():
        out = model(input_ids=torch.randint(0, 1000, (1, 90)))
    assert out[0].shape[1] == 90
    model.save_pretrained(tmp_path)
    reloaded = load_clean(tmp_path, type(model))
    assert torch.equal(dict(reloaded.named_parameters())[table_name], table.detach())


def test_extend_model_keeps_dtype_device_and_frozen_state():
    fam = FAMILIES["bert"]
    model = fam.bare.from_config(fam.config()).to(torch.bfloat16)
    model.embeddings.position_embeddings.weight.requires_grad_(False)
    posextend.extend_model(model, 64, "tile")
    w = model.embeddings.position_embeddings.weight
    assert (w.dtype, w.device.type, w.requires_grad) == (torch.bfloat16, "cpu", False)
    assert model.config.max_position_embeddings == 64
    assert model.embeddings.position_embeddings.num_embeddings == 64


def test_extend_model_refuses_shrink_unless_asked():
    fam = FAMILIES["gpt2"]
    model = fam.bare.from_config(fam.config())
    with pytest.raises(posextend.InvalidLengthError, match=f"below the current {POSITIONS}"):
        posextend.extend_model(model, 10)
    posextend.extend_model(model, 10, allow_shrink=True)
    assert model.wpe.weight.shape == (10, 16) and model.config.n_positions == 10


def test_extend_model_refuses_rotary_models():
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2)
    model = transformers.LlamaModel(cfg)
    with pytest.raises(posextend.NotLearnedPositionsError, match="rotary"):
        posextend.extend_model(model, 128)
