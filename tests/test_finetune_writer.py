"""The fine-tune's output is written by resize-model's checkpoint writer into the source's own files and
layout: bare names stay bare, shards stay shards, tensors training left alone keep their bytes, a
fresh head is added under the names transformers loads, a sentence-transformers Dense layer that
trained is saved by its own module."""

from __future__ import annotations

import dataclasses
import filecmp
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from conftest import load_clean
from safetensors import safe_open
from tiny import FAMILIES, build

import posextend
from posextend.files.reader import SAFE_INDEX, CheckpointReader
from posextend.files.tensorfile import read_header
from posextend.files.checkpoint import Checkpoint
from posextend.training.saving import file_names


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    with CheckpointReader(directory) as reader:
        return {name: reader.get(name) for name in reader.entries}


def test_a_bare_file_keeps_its_names_and_gains_only_the_fresh_head(corpus, tmp_path):
    """A bare BERT under a headed ``architectures`` (as sentence-transformers and hub uploads leave them),
    masked fine-tune with a fresh head, new rows only: every name stays bare, the head is added, and
    every tensor but the table keeps its bytes."""
    fam = dataclasses.replace(FAMILIES["bert"], overrides={**FAMILIES["bert"].overrides, "max_position_embeddings": 32},
                              usable=32)
    src = build(fam, tmp_path / "src", headed=False)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "architectures": ["BertForMaskedLM"]}))
    report = posextend.finetune(src, tmp_path / "out", [corpus], objective="masked", init_head=True, length=64,
                                train="new-rows", steps=2, batch_size=2, eval_sequences=2, seed=0)
    before, after = _tensors(src), _tensors(tmp_path / "out")
    table = "embeddings.position_embeddings.weight"
    head = sorted(set(after) - set(before))
    assert head and all(name.startswith("cls.") for name in head) and set(before) <= set(after)
    assert after[table].shape == (64, 16) and torch.equal(after[table][:32], before[table])
    assert not torch.equal(after[table][32:], torch.cat([before[table]] * 2)[32:])  # the new rows trained
    assert all(torch.equal(after[n], before[n]) for n in before if n not in (table, "embeddings.position_ids"))
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written == {**config, "architectures": ["BertForMaskedLM"], "max_position_embeddings": 64}
    tuned, info = transformers.BertForMaskedLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]  # the head loads
    assert info["unexpected_keys"] == {"pooler.dense.weight", "pooler.dense.bias"}  # the source's pooler, kept
    _, info = transformers.BertModel.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]  # the model as it was, at the new length
    assert torch.equal(tuned.cls.predictions.transform.dense.weight, after["cls.predictions.transform.dense.weight"])
    meta = Checkpoint.of(tmp_path / "out").provenance
    assert (meta["posextend.old_length"], meta["posextend.new_length"]) == ("32", "64")
    assert json.loads(meta["posextend.finetune"])["steps"] == report.steps == 2


def test_a_sharded_checkpoint_keeps_its_shards_and_its_recorded_original(gpt, corpus, tmp_path):
    """Training the positions of a sharded GPT-2 rewrites the shard holding the table and copies the
    others; a second fine-tune of the output keeps the original its index records."""
    src = tmp_path / "src"
    transformers.AutoModelForCausalLM.from_pretrained(gpt).save_pretrained(src, max_shard_size="20KB")
    for path in gpt.iterdir():
        if not (src / path.name).exists() and path.suffix != ".safetensors":
            shutil.copy2(path, src / path.name)  # the tokenizer's files
    shards = sorted(p.name for p in src.glob("*.safetensors"))
    assert len(shards) > 2
    out = tmp_path / "out"
    posextend.finetune(src, out, [corpus], length=64, train="positions", steps=2, batch_size=2, eval_sequences=2, seed=0)
    assert sorted(p.name for p in out.glob("*.safetensors")) == shards
    index = json.loads((out / SAFE_INDEX).read_text())
    table_shard = index["weight_map"]["transformer.wpe.weight"]
    assert index["weight_map"] == json.loads((src / SAFE_INDEX).read_text())["weight_map"]
    assert [s for s in shards if not filecmp.cmp(src / s, out / s, shallow=False)] == [table_shard]
    assert read_header(out / table_shard)[1]["posextend.source"] == str(src)
    assert filecmp.cmp(src / "tokenizer.json", out / "tokenizer.json", shallow=False)
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 64
    load_clean(out, transformers.AutoModelForCausalLM)

    again = tmp_path / "again"
    posextend.finetune(out, again, [corpus], train="all", steps=1, batch_size=2, eval_sequences=2, seed=0)
    first, meta = (json.loads((d / SAFE_INDEX).read_text())["metadata"] for d in (out, again))
    assert (meta["posextend.source"], meta["posextend.old_length"]) == (str(src), "32")
    assert meta["posextend.strategy"] == first["posextend.strategy"] and "posextend.strategy" in first
    assert json.loads(meta["posextend.finetune"])["train"] == "all"
    assert all(not filecmp.cmp(out / s, again / s, shallow=False) for s in shards)  # every weight trained
    assert "## Fine-tune" in (again / "README.md").read_text()


def test_a_legacy_bin_checkpoint_is_written_as_safetensors(gpt, corpus, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(gpt, src)
    state = _tensors(src)
    (src / "model.safetensors").unlink()
    torch.save(state, src / "pytorch_model.bin")
    posextend.finetune(src, tmp_path / "out", [corpus], length=48, train="positions", steps=1, batch_size=2,
                       eval_sequences=2, seed=0)
    after = _tensors(tmp_path / "out")
    assert not (tmp_path / "out" / "pytorch_model.bin").exists() and set(after) == set(state)
    assert after["transformer.wpe.weight"].shape == (48, 16)
    assert all(torch.equal(after[n], state[n]) for n in state if n != "transformer.wpe.weight")
    load_clean(tmp_path / "out", transformers.AutoModelForCausalLM)


def test_a_dense_module_that_trained_is_saved_by_its_own_module(minilm, corpus, tmp_path):
    """The real all-MiniLM-L6-v2 with a Dense layer after pooling, every parameter trained: the Dense
    weights written are the trained ones, the old position_ids buffer follows the new length."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Dense

    src = tmp_path / "src"
    shutil.copytree(minilm, src)  # its file still holds the position_ids buffer
    torch.manual_seed(0)
    (src / "3_Dense").mkdir()
    Dense(384, 32).save(str(src / "3_Dense"))
    modules = json.loads((src / "modules.json").read_text())
    (src / "modules.json").write_text(json.dumps(modules + [
        {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}]))
    model = SentenceTransformer(str(src), device="cpu")
    dense_dir = src / "3_Dense"
    assert "embeddings.position_ids" in _tensors(src)
    posextend.finetune(src, tmp_path / "out", [corpus], length=576, train="all", steps=1, batch_size=2,
                       eval_sequences=2, seed=0)
    tuned = SentenceTransformer(str(tmp_path / "out"), device="cpu")
    assert [type(m).__name__ for m in tuned] == [type(m).__name__ for m in model] and tuned.max_seq_length == 576
    assert not torch.equal(tuned[-1].linear.weight, model[-1].linear.weight)  # trained, and written
    with safe_open(str(tmp_path / "out" / dense_dir.name / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("linear.weight"), tuned[-1].linear.weight)
    after = _tensors(tmp_path / "out")
    assert torch.equal(after["embeddings.position_ids"], torch.arange(576).unsqueeze(0))
    assert set(after) == set(_tensors(src))


def test_a_tensor_transformers_converts_on_loading_is_refused_before_training(gpt, tmp_path):
    """A file tensor under the model's own name whose value the model does not hold (converted on
    loading) has no place for its trained value: refused at once, with the reason."""
    src = tmp_path / "src"
    shutil.copytree(gpt, src)
    model = transformers.AutoModelForCausalLM.from_pretrained(src)
    state = _tensors(src)
    state["transformer.h.0.mlp.c_fc.weight"] = state["transformer.h.0.mlp.c_fc.weight"].flip(0).contiguous()
    from safetensors.torch import save_file

    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    with CheckpointReader(src) as reader, pytest.raises(posextend.TrainingError, match="converts it on loading"):
        file_names(model, model, reader, json.loads((src / "config.json").read_text()))
    with CheckpointReader(gpt) as reader:
        found = file_names(model, model, reader, {})  # the file as saved: every tensor found, the tied head too
    assert set(found.names.values()) == set(reader.entries) and not found.added


def test_a_headed_file_under_a_sentence_transformer_keeps_its_prefix(bert, corpus, tmp_path):
    """A sentence-transformers folder whose Transformer file was saved from the headed class (``bert.``
    names and the masked-LM head): the base model loads without the prefix, and the output keeps it,
    the head's bytes too; the pooler the model initialised is added under the prefix."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Pooling, Transformer

    src = tmp_path / "src"
    SentenceTransformer(modules=[Transformer(str(bert)), Pooling(16)], device="cpu").save(str(src))
    shutil.copy2(bert / "model.safetensors", src / "model.safetensors")  # the headed file, as uploaded
    before = _tensors(src)
    assert any(n.startswith("bert.") for n in before) and any(n.startswith("cls.") for n in before)
    with pytest.raises(posextend.TrainingError, match="32 positions cannot read"):  # too short for the anchor's passages
        posextend.finetune(src, tmp_path / "out", [corpus], length=64, train="positions", steps=2)
    posextend.finetune(src, tmp_path / "out", [corpus], length=64, train="positions", steps=2, batch_size=2,
                       eval_sequences=2, seed=0, anchor=0)
    after = _tensors(tmp_path / "out")
    table = "bert.embeddings.position_embeddings.weight"
    assert after[table].shape == (64, 16)
    # the base class's pooler, which the headed file lacks (initialised on loading), is added under the file's prefix
    assert set(after) - set(before) == {"bert.pooler.dense.weight", "bert.pooler.dense.bias"} and set(before) <= set(after)
    assert all(torch.equal(after[n], before[n]) for n in before if n not in (table, "bert.embeddings.position_ids"))
    tuned = SentenceTransformer(str(tmp_path / "out"), device="cpu")
    assert torch.equal(tuned[0].auto_model.embeddings.position_embeddings.weight, after[table])


def test_a_disk_that_fills_while_the_fine_tune_is_written_is_one_error_and_no_output(gpt, corpus, tmp_path, monkeypatch):
    import posextend.resize.writer as writer

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer, "write_safetensors", full)
    with pytest.raises(posextend.DestinationError, match="no space left"):
        posextend.finetune(gpt, tmp_path / "out", [corpus], length=48, train="positions", steps=1, batch_size=2,
                           eval_sequences=2, seed=0)
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]
