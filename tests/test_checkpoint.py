"""File-to-file surgery on tiny GPT-2 and BERT checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors import safe_open

import posextend
from conftest import load_clean, tree_digest
from tiny import FAMILIES, POSITIONS

NEW = 100  # not a multiple of 37


def _tensors(path):
    with safe_open(path / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


@pytest.mark.parametrize("name", ["gpt2", "gpt2-bare", "bert", "bert-bare", "gpt2-legacy"])
@pytest.mark.parametrize("strategy", ["tile", "interpolate", "random"])
def test_resize_checkpoint_round_trip(tiny, tmp_path, name, strategy):
    src = tiny[name]
    before = tree_digest(src)
    dst = tmp_path / "out"
    report = posextend.resize_checkpoint(src, dst, NEW, strategy, seed=5)
    assert tree_digest(src) == before, "the source must not change"
    assert (report.old_length, report.new_length, report.reserved) == (POSITIONS, NEW, 0)

    old, _ = _tensors(src)
    new, meta = _tensors(dst)
    (table,) = report.tables
    assert new[table].shape == (NEW, 16)
    expected = posextend.resize_table(old[table], NEW, strategy, seed=5)
    assert torch.equal(new[table], expected)
    assert set(new) == set(old) - set(report.dropped)
    for key in set(new) - {table} - set(report.buffers):
        assert torch.equal(old[key], new[key]) and old[key].dtype == new[key].dtype, key

    # provenance in the safetensors metadata and the model card
    assert meta["format"] == "pt"
    assert (meta["posextend.strategy"], meta["posextend.old_length"], meta["posextend.new_length"]) == (
        strategy, str(POSITIONS), str(NEW))
    assert meta["posextend.seed"] == "5" and meta["posextend.source"] == str(src.resolve())
    card = (dst / "README.md").read_text()
    assert f"{POSITIONS} → {NEW}" in card and f"`{strategy}`" in card

    cfg = json.loads((dst / "config.json").read_text())
    family = FAMILIES[name.split("-")[0]]
    key = "n_positions" if family.model_type == "gpt2" else "max_position_embeddings"
    assert cfg[key] == NEW
    if "n_ctx" in json.loads((src / "config.json").read_text()):
        assert cfg["n_ctx"] == NEW
    assert json.loads((dst / "tokenizer_config.json").read_text())["model_max_length"] == NEW
    assert transformers.AutoTokenizer.from_pretrained(dst).model_max_length == NEW
    assert (dst / "generation_config.json").exists() == (src / "generation_config.json").exists()

    cls = family.headed if "bare" not in name else family.bare
    model = load_clean(dst, cls)
    with torch.no_grad():
        out = model(input_ids=torch.randint(0, 1000, (2, NEW)))
    assert out[0].shape[:2] == (2, NEW)


def test_legacy_gpt2_masks_are_rebuilt_exactly(tiny, tmp_path):
    dst = tmp_path / "out"
    report = posextend.resize_checkpoint(tiny["gpt2-legacy"], dst, NEW, "tile")
    assert report.buffers == ["transformer.h.0.attn.bias", "transformer.h.1.attn.bias"]
    old, _ = _tensors(tiny["gpt2-legacy"])
    new, _ = _tensors(dst)
    for i in range(2):
        mask = new[f"transformer.h.{i}.attn.bias"]
        assert mask.dtype == torch.bool
        assert torch.equal(mask, torch.tril(torch.ones(NEW, NEW, dtype=torch.bool)).view(1, 1, NEW, NEW))
        # weights with 'bias' in their name are not masks
        assert torch.equal(new[f"transformer.h.{i}.attn.c_attn.bias"], old[f"transformer.h.{i}.attn.c_attn.bias"])
        assert f"transformer.h.{i}.attn.masked_bias" in old and f"transformer.h.{i}.attn.masked_bias" not in new
    assert report.dropped == ["transformer.h.0.attn.masked_bias", "transformer.h.1.attn.masked_bias"]


def test_bert_position_ids_buffer_follows_the_length(minilm, tmp_path):
    dst = tmp_path / "out"
    posextend.resize_checkpoint(minilm, dst, 700, "tile")
    new, _ = _tensors(dst)
    assert torch.equal(new["embeddings.position_ids"], torch.arange(700).view(1, 700))


def test_shrink_is_explicit(tiny, tmp_path):
    with pytest.raises(posextend.InvalidLengthError, match="pass allow_shrink=True"):
        posextend.resize_checkpoint(tiny["bert"], tmp_path / "out", 20)
    assert not (tmp_path / "out").exists()
    posextend.resize_checkpoint(tiny["bert"], tmp_path / "out", 20, allow_shrink=True)
    old, _ = _tensors(tiny["bert"])
    new, _ = _tensors(tmp_path / "out")
    name = "bert.embeddings.position_embeddings.weight"
    assert torch.equal(new[name], old[name][:20])
    load_clean(tmp_path / "out", transformers.BertForMaskedLM)


def test_overwrite_replaces_and_inspect_reports(tiny, tmp_path):
    dst = tmp_path / "out"
    posextend.resize_checkpoint(tiny["gpt2"], dst, 50)
    posextend.resize_checkpoint(tiny["gpt2"], dst, 80, overwrite=True)
    info = posextend.inspect_checkpoint(dst)
    assert (info.usable, info.reserved, info.tables[0].rows, info.tokenizer_max_length) == (80, 0, 80, 80)
    assert [p.name for p in tmp_path.iterdir()] == ["out"], "no temporary directories left behind"


def test_interrupted_write_leaves_nothing(tiny, tmp_path, monkeypatch):
    from posextend.resize import writer

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(writer, "_copy_other_files", boom)
    with pytest.raises(KeyboardInterrupt):
        posextend.resize_checkpoint(tiny["gpt2"], tmp_path / "out", 50)
    assert list(tmp_path.iterdir()) == []


def test_stale_temp_dir_of_a_dead_run_is_removed(tiny, tmp_path):
    stale = tmp_path / ".out.posextend-999999999-abc"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    posextend.resize_checkpoint(tiny["gpt2"], tmp_path / "out", 50)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_copied_bytes_keep_their_offset_within_a_page(gpt, tmp_path):
    """The header is padded so that the first copied tensor sits at the offset within a 4 KiB page it has in its
    source (the kernel's copy then moves whole pages); the data still starts 8-byte aligned, and the file reads
    back the source's tensors exactly."""
    from safetensors.torch import load_file

    from posextend.files.tensorfile import PAGE

    posextend.resize_checkpoint(gpt, tmp_path / "out", 64, "tile")
    (src_start, src), (out_start, out) = (_data_start_and_header(p / "model.safetensors")
                                          for p in (gpt, tmp_path / "out"))
    first = min((name for name in out if name != "__metadata__"), key=lambda n: out[n]["data_offsets"][0])
    assert first in src and out[first]["shape"] == src[first]["shape"]  # a copied tensor comes first here
    at_source = src_start + src[first]["data_offsets"][0]
    at_output = out_start + out[first]["data_offsets"][0]
    assert at_output % PAGE == at_source % PAGE and out_start % 8 == 0
    before, after = load_file(gpt / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before if "wpe" not in k)


def _data_start_and_header(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return 8 + n, json.loads(f.read(n))
