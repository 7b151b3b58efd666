"""posextend.tables.nn.LearnedPositionalEmbedding, TokenAndPositionEmbedding and posextend.scoring.analysis."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import posextend
from posextend.scoring import analysis
from posextend.cli import app
from posextend.tables.nn import LearnedPositionalEmbedding, TokenAndPositionEmbedding

D, MAX = 16, 37


@pytest.fixture
def pe():
    torch.manual_seed(0)
    return LearnedPositionalEmbedding(D, MAX)


def test_init_is_normal_with_init_std():
    torch.manual_seed(0)
    w = LearnedPositionalEmbedding(64, 4000, init_std=0.05).weight
    assert w.shape == (4000, 64) and abs(w.std().item() - 0.05) < 0.001 and abs(w.mean().item()) < 0.001


def test_unbatched_and_batched_give_the_same_rows(pe):
    x = torch.randn(3, 10, D)
    batched = pe(x, offset=5)
    for i in range(3):
        assert torch.equal(pe(x[i], offset=5), batched[i])
    assert torch.equal(batched, x + pe.weight[5:15])


def test_offset_and_position_ids_agree_with_a_reference_lookup(pe):
    x = torch.randn(2, 8, D)
    ids = torch.arange(20, 28)
    assert torch.equal(pe(x, position_ids=ids), pe(x, offset=20))
    ragged = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [36, 0, 5, 5, 9, 1, 2, 3]])
    assert torch.equal(pe(x, position_ids=ragged), x + pe.weight[ragged])


def test_slicing_path_is_used_without_position_ids(pe, monkeypatch):
    import torch.nn.functional as F

    calls = []
    real = F.embedding
    monkeypatch.setattr(F, "embedding", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(2, 8, D)
    pe(x, offset=3)
    assert calls == []
    pe(x, position_ids=torch.arange(8))
    assert calls == [1]


def test_dtype_and_dropout(pe):
    x = torch.randn(4, 6, D, dtype=torch.bfloat16)
    assert pe(x).dtype == torch.bfloat16
    drop = LearnedPositionalEmbedding(D, MAX, dropout=0.5)
    drop.train()
    out = drop(torch.ones(20, MAX, D))
    assert ((out == 0).float().mean() - 0.5).abs() < 0.05
    drop.eval()
    assert torch.equal(drop(torch.ones(5, D)), torch.ones(5, D) + drop.weight[:5])


@pytest.mark.parametrize(
    "call, exc, message",
    [
        (lambda pe: pe(torch.randn(D)), ValueError, "x must be 2-D (L, D) or 3-D (N, L, D), got 1-D shape (16,)"),
        (lambda pe: pe(torch.randn(1, 2, 3, D)), ValueError, "got 4-D shape (1, 2, 3, 16)"),
        (lambda pe: pe(torch.randn(4, 15)), ValueError, "x's last dimension is 15, expected d_model=16"),
        (lambda pe: pe(torch.ones(4, D, dtype=torch.long)), TypeError, "x must be a floating-point tensor, got torch.int64"),
        (lambda pe: pe(torch.randn(4, D), offset=-1), ValueError, "offset must be a non-negative integer, got -1"),
        (lambda pe: pe(torch.randn(10, D), offset=30), ValueError, "positions 30..39 exceed max_len=37 (offset 30 + length 10)"),
        (lambda pe: pe(torch.randn(38, D)), ValueError, "positions 0..37 exceed max_len=37"),
        (lambda pe: pe(torch.randn(3, D), position_ids=torch.tensor([0, 37, 1])), ValueError, "position id 37 is out of range [0, 37)"),
        (lambda pe: pe(torch.randn(3, D), position_ids=torch.tensor([0, -1, 1])), ValueError, "position id -1 is out of range [0, 37)"),
        (lambda pe: pe(torch.randn(3, D), position_ids=torch.tensor([0.0, 1.0, 2.0])), TypeError, "position_ids must be an integer tensor, got torch.float32"),
        (lambda pe: pe(torch.randn(3, D), position_ids=torch.arange(4)), ValueError, "position_ids must have shape (3,) or (N, 3), got (4,)"),
        (lambda pe: pe(torch.randn(3, D), position_ids=torch.zeros(2, 3, dtype=torch.long)), ValueError, "need a batched x"),
        (lambda pe: pe(torch.randn(4, 3, D), position_ids=torch.zeros(2, 3, dtype=torch.long)), ValueError, "position_ids batch 2 does not match x's batch 4"),
        (lambda pe: LearnedPositionalEmbedding(0, 5), ValueError, "d_model must be a positive integer, got 0"),
        (lambda pe: LearnedPositionalEmbedding(4, -2), ValueError, "max_len must be a positive integer, got -2"),
    ],
)
def test_every_error_path(pe, call, exc, message):
    with pytest.raises(exc) as info:
        call(pe)
    assert message in str(info.value)


@pytest.mark.parametrize("strategy", [n for n, s in posextend.available_strategies().items() if 1 in s.ranks])
def test_extend_uses_the_registry(pe, strategy):
    longer = pe.extend(100, strategy, seed=1)
    assert isinstance(longer, LearnedPositionalEmbedding) and longer.max_len == 100
    assert torch.equal(longer.weight.detach(), posextend.resize_table(pe.weight, 100, strategy, seed=1))
    longer(torch.randn(100, D))
    if strategy == "tile":
        assert torch.equal(longer.weight[MAX:2 * MAX], pe.weight)


@pytest.mark.parametrize("style", ["gpt", "bert"])
def test_token_and_position_embedding(style):
    torch.manual_seed(0)
    kwargs = {"type_vocab_size": 2, "layer_norm": True} if style == "bert" else {}
    block = TokenAndPositionEmbedding(100, D, MAX, padding_idx=0, **kwargs).eval()
    ids = torch.randint(1, 100, (2, 10))
    types = torch.randint(0, 2, (2, 10)) if style == "bert" else None
    out = block(ids, token_type_ids=types)
    expected = block.tokens(ids) + block.positions.weight[:10]
    if style == "bert":
        expected = block.norm(expected + block.token_types(types))
    torch.testing.assert_close(out, expected)
    assert torch.equal(block.tokens.weight[0], torch.zeros(D))
    block.extend(50)
    assert block(torch.randint(1, 100, (1, 50))).shape == (1, 50, D)
    if style == "gpt":
        with pytest.raises(ValueError, match="type_vocab_size=0"):
            block(ids, token_type_ids=torch.zeros_like(ids))


# ------------------------------------------------------------------------ diagnostics


def test_rank_two_table_reports_two_components():
    torch.manual_seed(0)
    table = torch.randn(50, 2) @ torch.randn(2, 32)
    assert analysis.components_for(table, 0.90) <= 2
    assert analysis.components_for(table, 0.99) == 2
    assert (analysis.singular_values(table)[2:] < 1e-4).all()


def test_identical_rows_have_similarity_one():
    table = torch.randn(1, 8).repeat(20, 1)
    sim = analysis.cosine_similarity_matrix(table)
    torch.testing.assert_close(sim, torch.ones(20, 20))
    torch.testing.assert_close(analysis.similarity_by_distance(table), torch.ones(20))


def test_orthogonal_rows_and_norms():
    table = torch.eye(6) * torch.arange(1.0, 7.0)[:, None]
    by_distance = analysis.similarity_by_distance(table)
    assert by_distance[0] == 1 and (by_distance[1:] == 0).all()
    torch.testing.assert_close(analysis.row_norms(table), torch.arange(1.0, 7.0))


def test_tile_shows_block_structure(pe):
    tiled = analysis.table_of(pe.extend(3 * MAX, "tile"))
    sim = analysis.similarity_by_distance(tiled)
    assert torch.allclose(sim[MAX], torch.tensor(1.0)) and torch.allclose(sim[2 * MAX], torch.tensor(1.0))


def test_table_of_a_model_strips_reserved_rows():
    import transformers

    from tiny import FAMILIES

    model = FAMILIES["opt"].bare.from_config(FAMILIES["opt"].config())
    table = analysis.table_of(model)
    assert table.shape[0] == 37 and torch.equal(table, model.decoder.embed_positions.weight[2:].detach())
    assert isinstance(model, transformers.PreTrainedModel)


def test_inspect_plot_and_compare(tiny, tmp_path):
    dst = tmp_path / "ext"
    posextend.resize_checkpoint(tiny["gpt2"], dst, 111, "tile")
    out = tmp_path / "diag"
    r = CliRunner().invoke(app, ["inspect", str(dst), "--plot", str(out), "--compare", str(tiny["gpt2"])])
    assert r.exit_code == 0, r.output
    assert "components for 90% variance" in r.output
    data = json.loads((out / "analysis.json").read_text())
    assert data["ext"]["length"] == 111 and data["gpt2"]["length"] == 37
    assert data["ext"]["similarity_by_distance"][37] == pytest.approx(1.0, abs=1e-5)  # tiled copy
    for name in ("similarity.png", "similarity_by_distance.png", "spectrum.png", "norms.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_matplotlib_gives_a_clear_message(monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(posextend.PosExtendError, match=r"pip install 'posextend\[plot\]'"):
        analysis.plot({"t": torch.randn(5, 4)}, tmp_path)
