"""Families without a written spec, observed on twins (posextend.families.probe), and the guards around them.

Every checkpoint here is a tiny twin built from the family's own config (random init, tiny
widths, every length field kept): MPNet as a sentence-transformers folder, XLM-RoBERTa-XL,
I-BERT, CLIP, LED, Whisper, ESM, DeBERTa. Then damaged sources, failed verification, the
in-memory door and the CLI.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from conftest import load_clean, tree_digest
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import posextend
from posextend.families import configs, twin, twin_runs
from posextend.cli import app
from posextend.errors import (
    CorruptCheckpointError,
    NotLearnedPositionsError,
    UnsupportedArchitectureError,
    VerificationError,
)

USABLE, NEW = 37, 100  # 37 usable positions, resized to 100 (not a multiple of 37)
runner = CliRunner()


def cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def twin_config(model_type: str, **overrides) -> dict:
    cfg = transformers.AutoConfig.for_model(model_type, **overrides).to_dict()
    cfg["model_type"] = model_type
    return configs.shrink(cfg)


def save_twin(path: Path, model_type: str, cls: type, *, after_shrink: dict | None = None, **overrides) -> Path:
    cfg = twin_config(model_type, **overrides)
    cfg.update(after_shrink or {})
    twin.build(cfg, cls=cls).save_pretrained(path)
    return path


def tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path / "model.safetensors", "pt") as f:
        return {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118 (safe_open is no dict)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    def raw(t: torch.Tensor) -> bytes:
        return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())

    return a.dtype == b.dtype and a.shape == b.shape and raw(a) == raw(b)


def config_of(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def no_temps_beside(dst: Path) -> bool:
    return not list(dst.parent.glob(f".{dst.name}.posextend-*"))


# --------------------------------------------------------------------- 1. MPNet as sentence-transformers

ST_WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog"]  # one BERT token each


def _text(tokens: int) -> str:
    """A text of exactly ``tokens`` BERT tokens, [CLS] and [SEP] included."""
    return " ".join(ST_WORDS[i % len(ST_WORDS)] for i in range(tokens - 2))


@pytest.fixture(scope="module")
def mpnet_st(tmp_path_factory, minilm) -> Path:
    """An all-mpnet-base-v2-like folder: MPNetModel (pad 1, 2 reserved rows, counted by the config),
    BERT tokenizer, mean pooling, normalize, max_seq_length 20."""
    src = tmp_path_factory.mktemp("mpnet") / "st"
    # a real BERT vocabulary: every id it produces must exist in the model (widths stay tiny)
    save_twin(src, "mpnet", transformers.MPNetModel, after_shrink={"vocab_size": 30522},
              max_position_embeddings=USABLE + 2, pad_token_id=1)
    for name in ("vocab.txt", "tokenizer.json", "special_tokens_map.json", "modules.json",
                 "config_sentence_transformers.json"):
        shutil.copy(minilm / name, src / name)
    tok_cfg = json.loads((minilm / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "model_max_length": USABLE}))
    (src / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 20, "do_lower_case": False}))
    (src / "1_Pooling").mkdir()
    pooling = json.loads((minilm / "1_Pooling" / "config.json").read_text())
    (src / "1_Pooling" / "config.json").write_text(json.dumps({**pooling, "word_embedding_dimension": configs.TINY_WIDTH}))
    (src / "2_Normalize").mkdir()
    assert [m["type"].rsplit(".", 1)[1] for m in json.loads((src / "modules.json").read_text())] == [
        "Transformer", "Pooling", "Normalize"]
    return src


def test_mpnet_sentence_transformer_resized(mpnet_st, tmp_path):
    from sentence_transformers import SentenceTransformer

    before = tree_digest(mpnet_st)
    info = posextend.inspect_checkpoint(mpnet_st)
    assert (info.covered_by, info.usable, info.reserved, info.st_max_seq_length) == ("probed", USABLE, 2, 20)
    dst = tmp_path / "out"
    report = posextend.resize_checkpoint(mpnet_st, dst, NEW, "tile", seed=0)
    assert tree_digest(mpnet_st) == before
    assert report.covered_by == "probed"
    assert report.verified is True
    assert report.st_max_seq_length == NEW
    assert (report.old_length, report.new_length, report.reserved) == (USABLE, NEW, 2)

    assert config_of(dst)["max_position_embeddings"] == NEW + 2
    name = "embeddings.position_embeddings.weight"
    old, new = tensors(mpnet_st)[name], tensors(dst)[name]
    assert new.shape == (NEW + 2, configs.TINY_WIDTH)
    assert same_bytes(new[:2], old[:2]), "reserved rows 0-1 must be bit-exact"
    assert torch.equal(new[2:], old[2:][torch.arange(NEW) % USABLE])
    assert json.loads((dst / "sentence_bert_config.json").read_text()) == {"max_seq_length": NEW, "do_lower_case": False}
    assert transformers.AutoTokenizer.from_pretrained(dst).model_max_length == NEW
    load_clean(dst, transformers.MPNetModel)

    source, resized = SentenceTransformer(str(mpnet_st), device="cpu"), SentenceTransformer(str(dst), device="cpu")
    assert [type(m).__name__ for m in resized] == [type(m).__name__ for m in source] == [
        "Transformer", "Pooling", "Normalize"]
    assert source.max_seq_length == 20
    assert resized.max_seq_length == NEW
    long = _text(NEW)
    assert resized.tokenize([long])["input_ids"].shape == (1, NEW)
    assert resized.tokenize([long + " and more words"])["input_ids"].shape == (1, NEW)  # truncated at NEW
    assert source.tokenize([long])["input_ids"].shape == (1, 20)
    e_long = resized.encode([long], convert_to_tensor=True)
    e_first20 = source.encode([long], convert_to_tensor=True)  # the source reads its first 20 tokens only
    assert e_long.shape == e_first20.shape == (1, configs.TINY_WIDTH) and torch.isfinite(e_long).all()
    assert not torch.allclose(e_long, e_first20, atol=1e-4)
    short = "A short sentence about a fox."
    assert torch.equal(resized.encode([short], convert_to_tensor=True), source.encode([short], convert_to_tensor=True))


def test_mpnet_sentence_transformer_cli_st_max_seq_length(mpnet_st, tmp_path):
    from sentence_transformers import SentenceTransformer

    dst = tmp_path / "out"
    r = cli("resize-model", mpnet_st, dst, "--length", NEW, "--st-max-seq-length", 64)
    assert r.exit_code == 0, r.output
    assert "sentence-transformers max_seq_length: 64" in r.output
    assert "verified" in r.output and "observed on a twin" in r.output
    assert json.loads((dst / "sentence_bert_config.json").read_text())["max_seq_length"] == 64
    assert posextend.inspect_checkpoint(dst).st_max_seq_length == 64
    assert config_of(dst)["max_position_embeddings"] == NEW + 2
    model = SentenceTransformer(str(dst), device="cpu")
    assert model.max_seq_length == 64
    assert model.tokenize([_text(NEW)])["input_ids"].shape == (1, 64)


def test_st_max_seq_length_above_the_new_length_is_refused(mpnet_st, tmp_path):
    with pytest.raises(posextend.InvalidLengthError, match="max_seq_length"):
        posextend.resize_checkpoint(mpnet_st, tmp_path / "out", NEW, st_max_seq_length=NEW + 1)
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------- 2. XLM-RoBERTa-XL


def test_xlm_roberta_xl_twin(tmp_path):
    src = save_twin(tmp_path / "src", "xlm-roberta-xl", transformers.XLMRobertaXLForMaskedLM,
                    max_position_embeddings=USABLE + 2, pad_token_id=1)
    info = posextend.inspect_checkpoint(src)
    assert info.covered_by == "probed"
    assert info.groups[0].reserved == 2 and info.groups[0].usable == USABLE
    dst = tmp_path / "out"
    report = posextend.resize_checkpoint(src, dst, NEW, "tile", seed=0)
    assert report.verified and report.reserved == 2
    assert config_of(dst)["max_position_embeddings"] == NEW + 2
    model = load_clean(dst, transformers.XLMRobertaXLForMaskedLM)
    assert model.roberta.embeddings.position_embeddings.weight.shape[0] == NEW + 2
    ids = torch.randint(3, 500, (2, NEW))
    assert not (ids == 1).any()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (2, NEW, model.config.vocab_size) and torch.isfinite(logits).all()


# --------------------------------------------------------------------- 3. I-BERT's companion buffer


def test_ibert_weight_integer_follows_the_table(tmp_path):
    src = save_twin(tmp_path / "src", "ibert", transformers.IBertForMaskedLM,
                    max_position_embeddings=USABLE + 2, pad_token_id=1)
    base = "ibert.embeddings.position_embeddings."
    info = posextend.inspect_checkpoint(src)
    assert [t.name for t in info.groups[0].tables] == [base + "weight", base + "weight_integer"]
    dst = tmp_path / "out"
    report = posextend.resize_checkpoint(src, dst, NEW, "tile", seed=0)
    assert set(report.tables) == {base + "weight", base + "weight_integer"} and report.verified
    old, new = tensors(src), tensors(dst)
    pick = torch.cat([torch.arange(2), 2 + torch.arange(NEW) % USABLE])
    for name in ("weight", "weight_integer"):
        assert new[base + name].shape == (NEW + 2, configs.TINY_WIDTH), name
        assert torch.equal(new[base + name], old[base + name][pick]), name
    model = load_clean(dst, transformers.IBertForMaskedLM)
    emb = model.ibert.embeddings.position_embeddings
    assert emb.weight.shape == emb.weight_integer.shape == (NEW + 2, configs.TINY_WIDTH)
    with torch.no_grad():
        assert model(input_ids=torch.randint(3, 500, (1, NEW))).logits.shape[1] == NEW


def test_ibert_in_memory_companion(tmp_path):
    model = twin.build(twin_config("ibert", max_position_embeddings=USABLE + 2, pad_token_id=1),
                       cls=transformers.IBertForMaskedLM)
    # the in-memory door handles I-BERT's companion buffer as the file path does
    posextend.extend_model(model, NEW)
    emb = model.ibert.embeddings.position_embeddings
    assert emb.weight.shape == emb.weight_integer.shape == (NEW + 2, configs.TINY_WIDTH)
    assert model.config.max_position_embeddings == NEW + 2
    with torch.no_grad():
        assert model(input_ids=torch.randint(3, 500, (1, NEW))).logits.shape[1] == NEW
    model.save_pretrained(tmp_path)
    load_clean(tmp_path, transformers.IBertForMaskedLM)


# --------------------------------------------------------------------- 4. CLIP's text tower


@pytest.fixture(scope="module")
def clip_twin(tmp_path_factory) -> Path:
    return save_twin(tmp_path_factory.mktemp("clip") / "src", "clip", transformers.CLIPModel)


def test_clip_text_table_only(clip_twin, tmp_path):
    info = posextend.inspect_checkpoint(clip_twin)
    assert info.covered_by == "probed"
    assert [g.group for g in info.groups] == ["text", "vision"]  # the image grid is a group of its own
    assert info.groups[0].usable == 77 and info.groups[0].reserved == 0
    assert info.groups[0].config_lengths == {"text_config.max_position_embeddings": 77}
    dst = tmp_path / "out"
    report = posextend.resize_checkpoint(clip_twin, dst, 248, "tile", seed=0)
    assert report.verified and report.tables == ["text_model.embeddings.position_embedding.weight"]
    cfg = config_of(dst)
    assert cfg["text_config"]["max_position_embeddings"] == 248
    assert cfg["vision_config"] == config_of(clip_twin)["vision_config"]

    old, new = tensors(clip_twin), tensors(dst)
    vision = [n for n in old if n.startswith("vision_model.")]
    assert "vision_model.embeddings.position_embedding.weight" in vision
    for name in vision:
        assert same_bytes(new[name], old[name]), name
    changed = set(report.tables) | set(report.buffers)
    for name in set(old) - changed:
        assert same_bytes(new[name], old[name]), name
    table = new["text_model.embeddings.position_embedding.weight"]
    assert table.shape[0] == 248
    assert torch.equal(table, old["text_model.embeddings.position_embedding.weight"][torch.arange(248) % 77])

    model = load_clean(dst, transformers.CLIPModel)
    ids = torch.randint(1, 400, (1, 248))
    with torch.no_grad():
        feats = model.get_text_features(input_ids=ids)
    feats = feats if isinstance(feats, torch.Tensor) else feats.pooler_output
    assert feats.shape == (1, model.config.projection_dim) and torch.isfinite(feats).all()


# --------------------------------------------------------------------- 5. LED: two lengths

LED = {"max_encoder_position_embeddings": 64, "max_decoder_position_embeddings": 32, "attention_window": [8, 8],
           "encoder_layers": 2, "decoder_layers": 2}


@pytest.fixture(scope="module")
def led_twin(tmp_path_factory) -> Path:
    return save_twin(tmp_path_factory.mktemp("led") / "src", "led", transformers.LEDForConditionalGeneration, **LED)


def test_led_needs_a_table_name(led_twin, tmp_path):
    info = posextend.inspect_checkpoint(led_twin)
    groups = {g.group: g for g in info.groups}
    assert set(groups) == {"encoder", "decoder"} and len(info.groups) == 2
    assert groups["encoder"].usable == 64 and groups["decoder"].usable == 32
    assert [t.name for t in groups["decoder"].tables] == ["led.decoder.embed_positions.weight"]
    with pytest.raises(UnsupportedArchitectureError) as exc:
        posextend.resize_checkpoint(led_twin, tmp_path / "out", 128)
    assert "encoder" in str(exc.value) and "decoder" in str(exc.value)
    assert not (tmp_path / "out").exists()
    with pytest.raises(UnsupportedArchitectureError, match="no table 'text'"):
        posextend.resize_checkpoint(led_twin, tmp_path / "out", 128, table="text")


def test_led_decoder_only(led_twin, tmp_path):
    dst = tmp_path / "out"
    report = posextend.resize_checkpoint(led_twin, dst, 60, "tile", seed=0, table="decoder")
    assert report.verified and report.tables == ["led.decoder.embed_positions.weight"]
    cfg = config_of(dst)
    assert (cfg["max_decoder_position_embeddings"], cfg["max_encoder_position_embeddings"]) == (60, 64)
    old, new = tensors(led_twin), tensors(dst)
    assert same_bytes(new["led.encoder.embed_positions.weight"], old["led.encoder.embed_positions.weight"])
    assert new["led.decoder.embed_positions.weight"].shape[0] == 60
    for name in set(old) - {"led.decoder.embed_positions.weight"}:
        assert same_bytes(new[name], old[name]), name
    model = load_clean(dst, transformers.LEDForConditionalGeneration)
    with torch.no_grad():
        out = model(input_ids=torch.randint(3, 400, (1, 64)), decoder_input_ids=torch.randint(3, 400, (1, 60)))
    assert out.logits.shape[:2] == (1, 60)
    after = {g.group: g.usable for g in posextend.inspect_checkpoint(dst).groups}
    assert after == {"encoder": 64, "decoder": 60}


# --------------------------------------------------------------------- 6. Whisper


def test_whisper_decoder_group_only(tmp_path):
    src = save_twin(tmp_path / "src", "whisper", transformers.WhisperForConditionalGeneration,
                    max_target_positions=40, max_source_positions=50)
    info = posextend.inspect_checkpoint(src)
    assert [(g.group, g.usable, g.config_lengths) for g in info.groups] == [
        ("decoder", 40, {"max_target_positions": 40})]
    dst = tmp_path / "out"
    report = posextend.resize_checkpoint(src, dst, NEW, "tile", seed=0)
    assert report.tables == ["model.decoder.embed_positions.weight"] and report.verified
    cfg = config_of(dst)
    assert (cfg["max_target_positions"], cfg["max_source_positions"]) == (NEW, 50)
    old, new = tensors(src), tensors(dst)
    assert same_bytes(new["model.encoder.embed_positions.weight"], old["model.encoder.embed_positions.weight"])
    model = load_clean(dst, transformers.WhisperForConditionalGeneration)
    assert model.model.decoder.embed_positions.weight.shape[0] == NEW
    hidden = torch.zeros(1, 50, model.config.d_model)
    with torch.no_grad():
        out = model.model.decoder(input_ids=torch.randint(3, 400, (1, NEW)), encoder_hidden_states=hidden)
    assert out.last_hidden_state.shape[:2] == (1, NEW)


# --------------------------------------------------------------------- 7. ESM

ESM = {"vocab_size": 33, "pad_token_id": 1, "mask_token_id": 32, "max_position_embeddings": USABLE + 2}


@pytest.mark.parametrize("rope_theta", [None, 10000.0], ids=["plain", "stray-rope_theta"])
def test_esm_absolute_is_resized(tmp_path, rope_theta):
    src = save_twin(tmp_path / "src", "esm", transformers.EsmForMaskedLM, position_embedding_type="absolute", **ESM)
    if rope_theta is not None:  # ESM-1b-style: a rope field next to position_embedding_type=absolute
        (src / "config.json").write_text(json.dumps({**config_of(src), "rope_theta": rope_theta}))
    info = posextend.inspect_checkpoint(src)
    assert (info.covered_by, info.usable, info.reserved) == ("probed", USABLE, 2)
    dst = tmp_path / "out"
    report = posextend.resize_checkpoint(src, dst, NEW, "tile", seed=0)
    assert report.verified
    assert config_of(dst)["max_position_embeddings"] == NEW + 2
    model = load_clean(dst, transformers.EsmForMaskedLM)
    ids = torch.randint(4, 30, (1, NEW))
    with torch.no_grad():
        assert model(input_ids=ids).logits.shape == (1, NEW, 33)


def test_esm_rotary_is_refused(tmp_path):
    src = save_twin(tmp_path / "src", "esm", transformers.EsmForMaskedLM, position_embedding_type="rotary",
                    **{**ESM, "max_position_embeddings": 1026})
    with pytest.raises(NotLearnedPositionsError, match="rotary"):
        posextend.resize_checkpoint(src, tmp_path / "out", 2048)
    with pytest.raises(NotLearnedPositionsError, match="rotary"):
        posextend.inspect_checkpoint(src)
    model = load_clean(src, transformers.EsmForMaskedLM)
    with pytest.raises(NotLearnedPositionsError):
        posextend.extend_model(model, 2048)
    assert not (tmp_path / "out").exists() and no_temps_beside(tmp_path / "out")


# --------------------------------------------------------------------- 8. DeBERTa


def test_deberta_without_absolute_positions_is_refused(tmp_path):
    src = save_twin(tmp_path / "src", "deberta", transformers.DebertaForMaskedLM, position_biased_input=False,
                    relative_attention=True, max_position_embeddings=USABLE)
    with pytest.raises(NotLearnedPositionsError, match="position_biased_input"):
        posextend.resize_checkpoint(src, tmp_path / "out", NEW)
    assert not (tmp_path / "out").exists()
    with pytest.raises(NotLearnedPositionsError, match="position_biased_input"):
        posextend.extend_model(load_clean(src, transformers.DebertaForMaskedLM), NEW)


@pytest.mark.parametrize("relative", [False, True], ids=["absolute-only", "with-relative-attention"])
def test_deberta_with_absolute_positions(tmp_path, relative):
    src = save_twin(tmp_path / "src", "deberta", transformers.DebertaForMaskedLM, position_biased_input=True,
                    relative_attention=relative, max_relative_positions=-1, max_position_embeddings=USABLE)
    dst = tmp_path / "out"
    try:
        report = posextend.resize_checkpoint(src, dst, NEW, "tile", seed=0)
    except NotLearnedPositionsError:
        pytest.fail("position_biased_input=True has a learned table: it must not be refused as not learned")
    except UnsupportedArchitectureError as exc:
        # max_relative_positions=-1: the relative embeddings follow max_position_embeddings too
        assert relative, f"absolute-only DeBERTa refused: {exc}"
        assert "rel_embeddings" in str(exc)
        assert not dst.exists() and no_temps_beside(dst)
        return
    assert report.verified and report.covered_by == "probed"
    assert config_of(dst)["max_position_embeddings"] == NEW
    model = load_clean(dst, transformers.DebertaForMaskedLM)
    assert model.deberta.embeddings.position_embeddings.weight.shape[0] == NEW
    with torch.no_grad():
        assert model(input_ids=torch.randint(3, 500, (1, NEW))).logits.shape[1] == NEW


# ------------------------------------------------------ behaviour at the old lengths, and memory == disk

# (model type, class, config overrides): probed families whose length field sizes a learned table
BEHAVIOUR = {
    "mpnet": ("mpnet", transformers.MPNetForMaskedLM, {"max_position_embeddings": USABLE + 2, "pad_token_id": 1}),
    "xlm-roberta-xl": ("xlm-roberta-xl", transformers.XLMRobertaXLForMaskedLM,
                       {"max_position_embeddings": USABLE + 2, "pad_token_id": 1}),
    "esm": ("esm", transformers.EsmForMaskedLM, dict(position_embedding_type="absolute", **ESM)),
    "deberta": ("deberta", transformers.DebertaForMaskedLM,
                {"position_biased_input": True, "relative_attention": False, "max_position_embeddings": USABLE}),
}
# absolute table + bucketed relative attention: max_relative_positions=-1 means "max_position_embeddings",
# so the length field also sets the buckets' scale, which no tensor shape shows
DEBERTA_BUCKETS = ("deberta-v2", transformers.DebertaV2ForMaskedLM,
                   {"position_biased_input": True, "relative_attention": True, "max_relative_positions": -1,
                    "position_buckets": 8, "pos_att_type": ["p2c", "c2p"], "max_position_embeddings": USABLE})


def test_a_field_that_also_changes_behaviour_is_refused_in_memory_too():
    model_type, cls, overrides = DEBERTA_BUCKETS
    model = twin.build(twin_config(model_type, **overrides), cls=cls)
    before = _logits(model, 30)
    with pytest.raises(UnsupportedArchitectureError, match="changes the model's outputs on short inputs"):
        posextend.extend_model(model, NEW, "tile", seed=0)
    assert model.deberta.embeddings.position_embeddings.weight.shape[0] == USABLE
    assert torch.equal(_logits(model, 30), before)


def _logits(model, length: int, seed: int = 0) -> torch.Tensor:
    vocab = model.config.vocab_size
    ids = torch.randint(4, min(vocab, 500) - 1, (1, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("case", list(BEHAVIOUR))
def test_tile_keeps_outputs_at_old_lengths_bit_identical(tmp_path, case):
    """tile keeps every old row: a resized checkpoint must compute exactly what the source did on
    inputs the source could already take."""
    model_type, cls, overrides = BEHAVIOUR[case]
    src = save_twin(tmp_path / "src", model_type, cls, **overrides)
    report = posextend.resize_checkpoint(src, tmp_path / "out", NEW, "tile", seed=0)
    assert report.verified and report.covered_by == "probed"
    before, after = _logits(load_clean(src, cls), 30), _logits(load_clean(tmp_path / "out", cls), 30)
    assert torch.equal(before, after), (
        f"{case}: outputs on 30 tokens changed after a tile resize (max diff {(before - after).abs().max():.3g})"
    )


@pytest.mark.parametrize("case", list(BEHAVIOUR))
def test_extended_in_memory_equals_its_reload(tmp_path, case):
    """What extend_model leaves in memory is what save_pretrained -> from_pretrained gives back."""
    model_type, cls, overrides = BEHAVIOUR[case]
    model = twin.build(twin_config(model_type, **overrides), cls=cls)
    posextend.extend_model(model, NEW, "tile", seed=0)
    in_memory = _logits(model, NEW)
    assert in_memory.shape[:2] == (1, NEW) and torch.isfinite(in_memory).all()
    model.save_pretrained(tmp_path)
    reloaded = _logits(load_clean(tmp_path, cls), NEW)
    assert torch.equal(in_memory, reloaded), (
        f"{case}: the extended model and its reload differ (max diff {(in_memory - reloaded).abs().max():.3g})"
    )


def test_deberta_v2_relative_buckets_keep_their_scale(tmp_path):
    """max_relative_positions=-1 makes DeBERTa-v2 bucket relative distances on a log scale up to
    max_position_embeddings: resizing the absolute table must not move those buckets (pin the old
    value in the written config), or it must refuse the model."""
    model_type, cls, overrides = DEBERTA_BUCKETS
    src = save_twin(tmp_path / "src", model_type, cls, **overrides)
    assert load_clean(src, cls).deberta.encoder.max_relative_positions == USABLE
    dst = tmp_path / "out"
    try:
        posextend.resize_checkpoint(src, dst, NEW, "tile", seed=0)
    except UnsupportedArchitectureError as exc:
        assert "max_relative_positions" in str(exc) or "relative" in str(exc)
        assert not dst.exists()
        return
    resized = load_clean(dst, cls)
    assert resized.deberta.embeddings.position_embeddings.weight.shape[0] == NEW
    assert resized.deberta.encoder.max_relative_positions == USABLE, (
        "the written config moves DeBERTa-v2's relative-position buckets (max_relative_positions=-1 now "
        f"means {resized.deberta.encoder.max_relative_positions})"
    )
    model = twin.build(twin_config(model_type, **overrides), cls=cls)
    posextend.extend_model(model, NEW)
    model.save_pretrained(tmp_path / "memory")
    assert load_clean(tmp_path / "memory", cls).deberta.encoder.max_relative_positions == \
        model.deberta.encoder.max_relative_positions == USABLE


def test_clip_in_memory(tmp_path):
    model = twin.build(twin_config("clip"), cls=transformers.CLIPModel)
    vision_before = {n: p.detach().clone() for n, p in model.vision_model.named_parameters()}
    old = model.text_model.embeddings.position_embedding.weight.detach().clone()
    posextend.extend_model(model, 248, "tile", seed=0)
    emb = model.text_model.embeddings
    assert emb.position_embedding.weight.shape == (248, old.shape[1])
    assert torch.equal(emb.position_embedding.weight, old[torch.arange(248) % 77])
    assert emb.position_ids.shape == (1, 248) and torch.equal(emb.position_ids[0], torch.arange(248))
    assert model.config.text_config.max_position_embeddings == model.text_model.config.max_position_embeddings == 248
    assert model.config.vision_config.image_size == 224
    for name, param in model.vision_model.named_parameters():
        assert torch.equal(param, vision_before[name]), name
    ids = torch.randint(1, 400, (1, 248))

    def features(m):
        with torch.no_grad():
            f = m.get_text_features(input_ids=ids)
        return f if isinstance(f, torch.Tensor) else f.pooler_output

    feats = features(model)
    assert feats.shape == (1, model.config.projection_dim) and torch.isfinite(feats).all()
    model.save_pretrained(tmp_path)
    torch.testing.assert_close(features(load_clean(tmp_path, transformers.CLIPModel)), feats)


def test_led_in_memory_needs_a_table_name(tmp_path):
    model = twin.build(twin_config("led", **LED), cls=transformers.LEDForConditionalGeneration)
    with pytest.raises(UnsupportedArchitectureError) as exc:
        posextend.extend_model(model, 60)
    assert "encoder" in str(exc.value) and "decoder" in str(exc.value)
    assert model.led.decoder.embed_positions.weight.shape[0] == 32  # untouched
    encoder = model.led.encoder.embed_positions.weight.detach().clone()
    posextend.extend_model(model, 60, table="decoder")
    assert model.led.decoder.embed_positions.weight.shape[0] == 60
    assert torch.equal(model.led.encoder.embed_positions.weight, encoder)
    assert (model.config.max_decoder_position_embeddings, model.config.max_encoder_position_embeddings) == (60, 64)
    with torch.no_grad():
        out = model(input_ids=torch.randint(3, 400, (1, 64)), decoder_input_ids=torch.randint(3, 400, (1, 60)))
    assert out.logits.shape[:2] == (1, 60)
    model.save_pretrained(tmp_path)
    load_clean(tmp_path, transformers.LEDForConditionalGeneration)


# --------------------------------------------------------------------- 9. damaged sources

STRATEGIES = ["tile", "interpolate", "random"]


def _damaged_copy(src: Path, dst: Path, dtype: torch.dtype, value: float = float("nan")) -> Path:
    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    state = {n: t.to(dtype) if t.is_floating_point() else t for n, t in state.items()}
    name = next(n for n in state if n.endswith("wpe.weight"))
    state[name][5, 3] = value
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_damaged_source_is_refused(tiny, tmp_path, strategy, dtype):
    src = _damaged_copy(tiny["gpt2"], tmp_path / "src", dtype)
    before = tree_digest(src)
    dst = tmp_path / "out"
    with pytest.raises(CorruptCheckpointError, match="damaged"):
        posextend.resize_checkpoint(src, dst, NEW, strategy, seed=0)
    assert not dst.exists() and no_temps_beside(dst)
    assert tree_digest(src) == before
    r = cli("resize-model", src, dst, "--length", NEW, "-s", strategy, "--seed", 0)
    assert r.exit_code == 1 and "damaged" in r.output and not dst.exists()


def test_half_precision_damage_is_found_from_the_bits_without_torch(tiny, tmp_path):
    """tile on a safetensors file never needs torch, nor numpy: the NaN check reads the exponent bits."""
    import subprocess
    import sys

    bad = {dt: _damaged_copy(tiny["gpt2"], tmp_path / str(dt).rsplit(".", 1)[1], dt) for dt in (torch.bfloat16, torch.float16)}
    code = (
        "import sys, json, posextend\n"
        "out = []\n"
        f"for src in {[str(p) for p in bad.values()]!r}:\n"
        "    try:\n"
        "        posextend.resize_checkpoint(src, src + '-out', 100, 'tile', seed=0)\n"
        "        out.append('written')\n"
        "    except posextend.CorruptCheckpointError as exc:\n"
        "        out.append(str(exc))\n"
        "print(json.dumps([out, 'torch' in sys.modules or 'numpy' in sys.modules]))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    messages, imported_arrays = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(messages) == 2 and all("damaged" in m and "1 NaN/Inf" in m for m in messages), messages
    assert imported_arrays is False
    assert not any(Path(f"{p}-out").exists() for p in bad.values())


def test_inf_in_a_table_is_refused_too(tiny, tmp_path):
    src = _damaged_copy(tiny["gpt2"], tmp_path / "src", torch.float16, float("inf"))
    with pytest.raises(CorruptCheckpointError, match="damaged"):
        posextend.resize_checkpoint(src, tmp_path / "out", NEW)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_damaged_model_in_memory_is_refused_and_untouched(tiny, strategy):
    model = load_clean(tiny["gpt2"], transformers.AutoModelForCausalLM)
    with torch.no_grad():
        model.transformer.wpe.weight[5, 3] = float("nan")
    before = model.transformer.wpe.weight.detach().clone()
    with pytest.raises(CorruptCheckpointError, match="damaged"):
        posextend.extend_model(model, NEW, strategy, seed=0)
    assert model.transformer.wpe.weight.shape == before.shape
    assert model.config.n_positions == USABLE


def test_damaged_second_table_in_memory_leaves_the_model_untouched(tmp_path):
    """BART keeps two tables: a NaN in the decoder's must not leave the encoder's already resized."""
    from tiny import FAMILIES, build

    path = build(FAMILIES["bart"], tmp_path / "bart")
    model = load_clean(path, FAMILIES["bart"].headed)
    with torch.no_grad():
        model.model.decoder.embed_positions.weight[7, 1] = float("nan")
    encoder_before = model.model.encoder.embed_positions.weight.detach().clone()
    with pytest.raises(CorruptCheckpointError, match="damaged"):
        posextend.extend_model(model, NEW)
    assert model.config.max_position_embeddings == USABLE
    assert model.model.encoder.embed_positions.weight.shape == encoder_before.shape, (
        "extend_model resized the encoder table before refusing the damaged decoder table"
    )
    assert torch.equal(model.model.encoder.embed_positions.weight, encoder_before)


# --------------------------------------------------------------------- 10. verification failure


def test_verification_failure_leaves_nothing(tiny, tmp_path, monkeypatch):
    import posextend.families.probe

    def fail(*args, **kwargs):
        raise VerificationError("a twin of the written config disagrees (test)")

    monkeypatch.setattr(posextend.families.probe, "verify", fail)
    dst = tmp_path / "out"
    before = tree_digest(tiny["bert"])
    with pytest.raises(VerificationError, match="disagrees"):
        posextend.resize_checkpoint(tiny["bert"], dst, NEW, verify=True)
    assert not dst.exists()
    assert no_temps_beside(dst), list(tmp_path.iterdir())
    assert tree_digest(tiny["bert"]) == before
    r = cli("resize-model", tiny["bert"], dst, "--length", NEW, "--verify")
    assert r.exit_code == 1 and "disagrees" in r.output
    assert not dst.exists() and no_temps_beside(dst)
    # without --verify a spec family is not checked on a twin: written as before
    report = posextend.resize_checkpoint(tiny["bert"], dst, NEW)
    assert report.verified is False and dst.is_dir()


def test_verification_catches_wrong_rows(tiny, tmp_path, monkeypatch):
    """The real verify, fed a twin that looks up the wrong rows, refuses the output."""
    real = twin_runs.tiny_lookups

    def shifted(config, cls, tables, length, **kwargs):
        used, small = real(config, cls, tables, length, **kwargs)
        return {n: rows + 1 for n, rows in used.items()}, small

    monkeypatch.setattr(twin_runs, "tiny_lookups", shifted)
    dst = tmp_path / "out"
    with pytest.raises(VerificationError, match="looks up"):
        posextend.resize_checkpoint(tiny["bert"], dst, NEW, verify=True)
    assert not dst.exists() and no_temps_beside(dst)


def test_verification_catches_a_twin_that_fails(tiny, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("index out of range in self")

    monkeypatch.setattr(twin_runs, "tiny_lookups", broken)
    dst = tmp_path / "out"
    with pytest.raises(VerificationError, match="fails at its full length"):
        posextend.resize_checkpoint(tiny["bert"], dst, NEW, verify=True)
    assert not dst.exists() and no_temps_beside(dst)


def test_verify_true_on_a_spec_family_passes(tiny, tmp_path):
    report = posextend.resize_checkpoint(tiny["bert"], tmp_path / "out", NEW, verify=True)
    assert report.verified is True and report.covered_by == "spec"
    no = posextend.resize_checkpoint(tiny["bert"], tmp_path / "out2", NEW, verify=False)
    assert no.verified is False


def test_probed_family_without_verify(mpnet_st, tmp_path):
    report = posextend.resize_checkpoint(mpnet_st, tmp_path / "out", NEW, verify=False)
    assert report.covered_by == "probed" and report.verified is False
    load_clean(tmp_path / "out", transformers.MPNetModel)


# --------------------------------------------------------------------- 11. in memory, probed family


def test_extend_model_in_memory_probed_mpnet():
    from posextend.scoring.analysis import table_of

    model = twin.build(twin_config("mpnet", max_position_embeddings=USABLE + 2, pad_token_id=1),
                       cls=transformers.MPNetForMaskedLM)
    assert "mpnet" not in posextend.SPECS
    old = model.mpnet.embeddings.position_embeddings.weight.detach().clone()
    assert table_of(model).shape == (USABLE, configs.TINY_WIDTH)
    posextend.extend_model(model, NEW, "tile", seed=0)
    emb = model.mpnet.embeddings.position_embeddings
    assert emb.weight.shape == (NEW + 2, configs.TINY_WIDTH) and emb.num_embeddings == NEW + 2 and emb.padding_idx == 1
    assert torch.equal(emb.weight[:2], old[:2])
    assert torch.equal(emb.weight[2:], old[2:][torch.arange(NEW) % USABLE])
    assert model.config.max_position_embeddings == NEW + 2
    ids = torch.randint(3, 500, (2, NEW))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (2, NEW, model.config.vocab_size) and torch.isfinite(logits).all()
    table = table_of(model)
    assert table.shape == (NEW, configs.TINY_WIDTH)
    assert torch.equal(table, emb.weight[2:].detach())


# --------------------------------------------------------------------- 12. CLI


def test_cli_inspect_probed_clip(clip_twin):
    r = cli("inspect", clip_twin)
    assert r.exit_code == 0, r.output
    assert "observed on a twin" in r.output
    assert "text_model.embeddings.position_embedding.weight" in r.output
    assert "text_config.max_position_embeddings=77" in r.output
    info = json.loads(cli("inspect", clip_twin, "--json").output)
    assert info["covered_by"] == "probed" and [g["group"] for g in info["groups"]] == ["text", "vision"]


def test_cli_inspect_led_lists_both_groups(led_twin):
    r = cli("inspect", led_twin)
    assert r.exit_code == 0, r.output
    assert "encoder: usable positions: 64" in r.output and "decoder: usable positions: 32" in r.output


def test_cli_resize_with_table_and_verify(tiny, led_twin, tmp_path):
    r = cli("resize-model", tiny["bert"], tmp_path / "bert", "--length", NEW, "--verify")
    assert r.exit_code == 0, r.output
    assert "verified" in r.output
    r = cli("resize-model", tiny["bert"], tmp_path / "bert2", "--length", NEW)
    assert r.exit_code == 0 and "verified" not in r.output
    r = cli("resize-model", led_twin, tmp_path / "led", "--length", 60, "--table", "decoder")
    assert r.exit_code == 0, r.output
    assert "verified" in r.output and "led.decoder.embed_positions.weight" in r.output
    r = cli("resize-model", led_twin, tmp_path / "led2", "--length", 128)
    assert r.exit_code == 1 and "encoder" in r.output and "decoder" in r.output
    assert not (tmp_path / "led2").exists()


def test_cli_inspect_plot_on_a_two_length_model(led_twin, tmp_path):
    """inspect has no --table: its diagnostics must not ask for one on a model with two lengths."""
    r = cli("inspect", led_twin, "--plot", tmp_path / "plots")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "plots" / "analysis.json").is_file()


def test_shrink_keeps_a_vocabulary_part_below_the_vocabulary():
    """A field that counts rows within the vocabulary (Inkling-2's ``unpadded_vocab_size``, transformers 5.24)
    keeps its distance below the shrunk ``vocab_size``; a vocabulary of its own (RoCBert's shapes) is left."""
    config = {"model_type": "x", "vocab_size": 100_000, "unpadded_vocab_size": 99_900, "shape_vocab_size": 24858}
    out = configs.shrink(config)
    assert out["vocab_size"] == configs.TINY_VOCAB and out["shape_vocab_size"] == 24858
    assert out["vocab_size"] - out["unpadded_vocab_size"] == 100
    assert configs.shrink({**config, "unpadded_vocab_size": 1000})["unpadded_vocab_size"] == 1  # a gap wider than the twin
    assert configs.shrink({**config, "unpadded_vocab_size": 100})["unpadded_vocab_size"] == 100  # already fits
