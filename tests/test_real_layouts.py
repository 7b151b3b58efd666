"""Checkpoints as users hold them: a folder built to the real all-mpnet-base-v2's shape, and the
messages a file under other names gets.

all-mpnet-base-v2 (sentence-transformers) keeps ``"architectures": ["MPNetForMaskedLM"]`` in its
config while its weights are the bare ``MPNetModel``'s (``embeddings.*``, ``encoder.*``,
``pooler.*``, plus a stored ``embeddings.position_ids``), 514 rows with ``pad_token_id`` 1, next to
``modules.json``, ``1_Pooling/``, a Normalize module, ``sentence_bert_config.json`` with
``max_seq_length`` 384 and stray ``desktop.ini`` files. The twin here has its fields and layout with
small widths; its tokenizer is MiniLM's real WordPiece (ids below MPNet's 30,527).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file
from typer.testing import CliRunner

import posextend
from conftest import tree_digest
from posextend.cli import app

NEW = 2048
SHORT = ["Positions past the table's end are the problem.", "A short sentence embeds as it did before."]


def _all_mpnet_config() -> dict:
    return {
        "_name_or_path": "microsoft/mpnet-base", "architectures": ["MPNetForMaskedLM"],
        "attention_probs_dropout_prob": 0.1, "bos_token_id": 0, "eos_token_id": 2, "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1, "hidden_size": 48, "initializer_range": 0.02, "intermediate_size": 96,
        "layer_norm_eps": 1e-05, "max_position_embeddings": 514, "model_type": "mpnet", "num_attention_heads": 2,
        "num_hidden_layers": 2, "pad_token_id": 1, "relative_attention_num_buckets": 32,
        "transformers_version": "4.11.2", "vocab_size": 30527,
    }


@pytest.fixture(scope="module")
def all_mpnet(tmp_path_factory, minilm) -> Path:
    """A sentence-transformers folder shaped like the real all-mpnet-base-v2 (bare weights, headed config)."""
    root = tmp_path_factory.mktemp("all-mpnet") / "all-mpnet-base-v2"
    root.mkdir()
    config = _all_mpnet_config()
    (root / "config.json").write_text(json.dumps(config, indent=2))
    torch.manual_seed(0)
    model = transformers.MPNetModel(transformers.MPNetConfig(**config))
    state = {n: t.contiguous() for n, t in model.state_dict().items()}
    state["embeddings.position_ids"] = torch.arange(514).unsqueeze(0)  # stored by the transformers that saved it
    assert "encoder.relative_attention_bias.weight" in state and "mpnet.embeddings.word_embeddings.weight" not in state
    save_file(state, root / "model.safetensors", metadata={"format": "pt"})
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(minilm / name, root / name)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (root / "modules.json").write_text(json.dumps(modules, indent=2))
    (root / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 384, "do_lower_case": False}))
    (root / "config_sentence_transformers.json").write_text(json.dumps({"__version__": {"sentence_transformers": "2.0.0"}}))
    (root / "1_Pooling").mkdir()
    (root / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 48, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}))
    for folder in (root, root / "1_Pooling"):
        (folder / "desktop.ini").write_text("[.ShellClassInfo]\r\nIconResource=C:\\Windows\\System32\\SHELL32.dll,4\r\n")
    return root


@pytest.fixture(scope="module")
def resized(all_mpnet, tmp_path_factory) -> tuple[Path, object]:
    before = tree_digest(all_mpnet)
    dst = tmp_path_factory.mktemp("out") / "mpnet-2k"
    result = CliRunner().invoke(app, ["resize-model", str(all_mpnet), str(dst), "--length", str(NEW), "--seed", "0"])
    assert result.exit_code == 0, result.output
    assert tree_digest(all_mpnet) == before
    return dst, result


def test_inspect_names_the_bare_layout(all_mpnet):
    info = posextend.inspect_checkpoint(all_mpnet)
    assert (info.usable, info.reserved, info.layout) == (512, 2, "bare")
    assert info.tables[0].name == "embeddings.position_embeddings.weight" and info.st_max_seq_length == 384
    result = CliRunner().invoke(app, ["inspect", str(all_mpnet)])
    assert result.exit_code == 0 and "bare" in result.output, result.output


def test_all_mpnet_shape_resizes_and_sentence_transformers_reads_every_token(all_mpnet, resized):
    from sentence_transformers import SentenceTransformer

    dst, result = resized
    config = json.loads((dst / "config.json").read_text())
    assert config["max_position_embeddings"] == NEW + 2 and config["architectures"] == ["MPNetForMaskedLM"]
    assert (dst / "desktop.ini").is_file() and (dst / "1_Pooling" / "desktop.ini").is_file()
    model, info = transformers.MPNetModel.from_pretrained(dst, output_loading_info=True)
    assert not any(info.values()), info
    assert model.embeddings.position_embeddings.weight.shape == (NEW + 2, 48)

    st = SentenceTransformer(str(dst), device="cpu")
    assert st.max_seq_length == NEW
    long_text = " ".join(["the quick brown fox jumps over the lazy dog"] * 250)
    assert st.tokenize([long_text])["input_ids"].shape[1] == NEW  # every position is read, none truncated
    long = st.encode([long_text], convert_to_tensor=True)
    assert long.shape == (1, 48) and torch.isfinite(long).all()

    source = SentenceTransformer(str(all_mpnet), device="cpu")
    assert source.max_seq_length == 384
    assert torch.equal(source.encode(SHORT, convert_to_tensor=True), st.encode(SHORT, convert_to_tensor=True))


def test_a_file_under_other_names_is_refused_with_the_nearest_names(all_mpnet, tmp_path):
    from safetensors.torch import load_file

    src = tmp_path / "renamed"
    shutil.copytree(all_mpnet, src)
    state = load_file(src / "model.safetensors")
    save_file({f"encoder_model.{n}": t for n, t in state.items()}, src / "model.safetensors")
    with pytest.raises(posextend.CorruptCheckpointError) as err:
        posextend.resize_checkpoint(src, tmp_path / "dst", NEW)
    message = str(err.value)
    assert "'embeddings.position_embeddings.weight' or 'mpnet.embeddings.position_embeddings.weight'" in message
    assert "'encoder_model.embeddings.position_embeddings.weight'" in message and "model_type" not in message
    assert not (tmp_path / "dst").exists()


def test_weights_of_another_family_say_the_config_may_be_wrong(all_mpnet, tiny, tmp_path):
    src = tmp_path / "mixed"
    shutil.copytree(all_mpnet, src)
    shutil.copy(tiny["gpt2"] / "model.safetensors", src / "model.safetensors")
    with pytest.raises(posextend.CorruptCheckpointError, match="do not look like a mpnet model; check config.json's model_type"):
        posextend.inspect_checkpoint(src)


def test_in_memory_door_finds_the_probed_table_headed_and_bare(all_mpnet):
    """extend_model on the bare class and on the headed class of the same weights: one spec, one table."""
    bare = transformers.MPNetModel.from_pretrained(all_mpnet)
    headed = transformers.MPNetForMaskedLM.from_pretrained(all_mpnet)
    old = bare.embeddings.position_embeddings.weight.detach().clone()
    for model, table in ((bare, "embeddings"), (headed, "mpnet.embeddings")):
        posextend.extend_model(model, 1024, "tile")
        weight = model.get_submodule(table).position_embeddings.weight
        assert weight.shape == (1026, 48) and model.config.max_position_embeddings == 1026
        assert torch.equal(weight[:514], old) and torch.equal(weight[514:1026], old[2:514])
    ids = torch.randint(5, 1000, (1, 1024))
    with torch.no_grad():
        assert torch.equal(bare(ids).last_hidden_state, headed.mpnet(ids).last_hidden_state)
