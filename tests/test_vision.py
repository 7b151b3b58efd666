"""Image-patch grids (ViT and relatives) and Long-CLIP's kps: tiny twins from configs.

A model resized on disk to a new image size must compute what the original computes at that
size with transformers' own run-time ``interpolate_pos_encoding`` (DINOv2 interpolates on its own).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from conftest import load_clean, tree_digest
from safetensors import safe_open
from test_strategies import long_clip_reference
from typer.testing import CliRunner

import posextend
from posextend.cli import app
from posextend.families.catalogue import GRID_SPECS
from posextend.errors import InvalidLengthError, NotLearnedPositionsError, StrategyError

IMAGE, PATCH = 40, 8  # a 5x5 grid of patches
_TOWER = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48, image_size=IMAGE,
              patch_size=PATCH)
# model type: (model class, config overrides, runs interpolate_pos_encoding on request, non-square allowed, prefix)
VISION = {
    "vit": (transformers.ViTModel, {}, True, True, 1),
    "vit_msn": (transformers.ViTMSNModel, {}, True, True, 1),
    "deit": (transformers.DeiTModel, {}, True, True, 2),
    "dinov2": (transformers.Dinov2Model, {}, False, False, 1),
    "dinov2_with_registers": (transformers.Dinov2WithRegistersModel, {"num_register_tokens": 2}, False, False, 1),
    "vit_mae": (transformers.ViTMAEModel, {"mask_ratio": 0.0}, True, True, 1),  # patches shuffled, none dropped
    "dpt": (transformers.DPTModel, {}, False, False, 1),  # resamples (bilinear) on every forward
    "clip_vision_model": (transformers.CLIPVisionModel, {}, True, False, 1),
    "siglip_vision_model": (transformers.SiglipVisionModel, {}, True, False, 0),
}
PROCESSOR = {"do_resize": True, "size": {"shortest_edge": 48}, "crop_size": {"height": IMAGE, "width": IMAGE}}


def _config(model_type: str) -> transformers.PretrainedConfig:
    return transformers.AutoConfig.for_model(model_type, **_TOWER, **VISION[model_type][1])


@pytest.fixture(scope="session")
def vision(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vision")
    out = {}
    for model_type, (cls, *_) in VISION.items():
        torch.manual_seed(0)
        model = cls(_config(model_type))
        with torch.no_grad():  # some families initialise their table to zeros: make every row distinct
            for name, p in model.named_parameters():
                if "position_embedding" in name:
                    p.copy_(torch.randn_like(p))
        model.save_pretrained(root / model_type)
        (root / model_type / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
        out[model_type] = root / model_type
    return out


def _table(path: Path, name: str) -> torch.Tensor:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return f.get_tensor(name)


def _outputs(model, pixels, interpolate: bool) -> torch.Tensor:
    kwargs = {"interpolate_pos_encoding": True} if interpolate else {}
    torch.manual_seed(0)  # ViT-MAE draws the order of its patches
    with torch.no_grad():
        return model(pixel_values=pixels, **kwargs).last_hidden_state


SIZES = {"up": (56, 56), "down": (24, 24), "non-square": (56, 40)}


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("model_type", list(VISION))
def test_resized_file_equals_run_time_interpolation(vision, tmp_path, model_type, size):
    cls, _, flag, non_square, prefix = VISION[model_type]
    h, w = SIZES[size]
    src = vision[model_type]
    before = tree_digest(src)
    if not non_square and h != w:
        with pytest.raises(InvalidLengthError, match="square images only"):
            posextend.resize_checkpoint(src, tmp_path / "out", image_size=(h, w))
        assert not (tmp_path / "out").exists()
        return
    # shrinking: transformers' run-time path has no antialias (but DINOv2 with registers' has); our
    # default when shrinking (antialias) is timm-like
    params = {"antialias": GRID_SPECS[model_type].grid.antialias} if size == "down" else {}
    report = posextend.resize_checkpoint(src, tmp_path / "out", image_size=(h, w), allow_shrink=size == "down", **params)
    assert report.verified and report.strategy == (GRID_SPECS[model_type].grid.strategy or "bicubic")
    assert report.new_grid == [h // PATCH, w // PATCH]
    assert tree_digest(src) == before
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["image_size"] == (h if h == w else [h, w])
    processor = json.loads((tmp_path / "out" / "preprocessor_config.json").read_text())
    assert processor["crop_size"] == {"height": h, "width": w}
    assert processor["size"] == ({"shortest_edge": round(48 * h / IMAGE)} if h == w else {"height": h, "width": w})

    original, resized = load_clean(src, cls), load_clean(tmp_path / "out", cls)
    table = report.tables[0]
    old, new = _table(src, table), _table(tmp_path / "out", table)
    rows = prefix + (h // PATCH) * (w // PATCH)
    assert new.shape[-2] == rows and new.shape[-1] == old.shape[-1] and new.dim() == old.dim()
    assert torch.equal(new.reshape(rows, -1)[:prefix], old.reshape(old.shape[-2], -1)[:prefix])  # prefix rows bit-exact
    pixels = torch.randn(2, 3, h, w, generator=torch.Generator().manual_seed(1))
    expected = _outputs(original, pixels, flag)  # DINOv2 interpolates whenever the size differs
    got = _outputs(resized, pixels, False)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_mae_pretraining_resizes_its_decoder_grid_too(tmp_path):
    """ViTMAEForPreTraining holds two grids of the same patches (encoder, decoder), of different
    widths: both follow the image size, each resampled as a 2-D grid, in the file and in memory."""
    torch.manual_seed(0)
    model = transformers.ViTMAEForPreTraining(transformers.ViTMAEConfig(**_TOWER, mask_ratio=0.5))
    model.save_pretrained(tmp_path / "src")
    report = posextend.resize_checkpoint(tmp_path / "src", tmp_path / "out", image_size=64)
    assert report.tables == ["vit.embeddings.position_embeddings", "decoder.decoder_pos_embed"] and report.verified
    for name in report.tables:
        old, new = _table(tmp_path / "src", name), _table(tmp_path / "out", name)
        assert new.shape == (1, 1 + 8 * 8, old.shape[-1]) and torch.equal(new[:, :1], old[:, :1])
        expected = torch.nn.functional.interpolate(old[0, 1:].reshape(1, 5, 5, -1).permute(0, 3, 1, 2), size=(8, 8),
                                                   mode="bicubic", align_corners=False)
        torch.testing.assert_close(new[0, 1:], expected.permute(0, 2, 3, 1).reshape(64, -1), rtol=0, atol=1e-6)
    resized = load_clean(tmp_path / "out", transformers.ViTMAEForPreTraining)
    in_memory = posextend.extend_model(model, image_size=64)
    pixels = torch.randn(1, 3, 64, 64)
    outputs = []
    for m in (resized, in_memory):
        torch.manual_seed(0)
        with torch.no_grad():
            out = m(pixel_values=pixels)
        assert out.logits.shape == (1, 64, PATCH * PATCH * 3) and torch.isfinite(out.loss)
        outputs.append(out.logits)
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)


@pytest.mark.parametrize("model_type", ["yolos", "siglip2_vision_model"])
def test_grids_resampled_on_every_forward_are_refused_with_the_reason(tmp_path, model_type):
    overrides = {"num_detection_tokens": 3, "image_size": [IMAGE, IMAGE]} if model_type == "yolos" else {"num_patches": 16}
    config = transformers.AutoConfig.for_model(model_type, **{**_TOWER, **overrides})
    transformers.AutoModel.from_config(config).save_pretrained(tmp_path / "src")
    with pytest.raises(posextend.PosExtendError, match="on every forward; .* instead"):
        posextend.resize_checkpoint(tmp_path / "src", tmp_path / "out", image_size=56)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("model_type", ["vit", "deit", "dinov2", "clip_vision_model", "siglip_vision_model"])
def test_extend_model_in_memory_equals_the_file(vision, tmp_path, model_type):
    cls = VISION[model_type][0]
    posextend.resize_checkpoint(vision[model_type], tmp_path / "file", image_size=56)
    model = posextend.extend_model(load_clean(vision[model_type], cls), image_size=56)
    assert model.config.image_size == 56
    pixels = torch.randn(1, 3, 56, 56)
    torch.testing.assert_close(_outputs(model, pixels, False), _outputs(load_clean(tmp_path / "file", cls), pixels, False),
                               rtol=0, atol=0)
    model.save_pretrained(tmp_path / "saved")
    load_clean(tmp_path / "saved", cls)


def test_grid_refusals(vision, tmp_path):
    with pytest.raises(StrategyError, match="'tile' resizes a 1-D table of positions; this table is a 2-D grid .* bicubic"):
        posextend.resize_checkpoint(vision["vit"], tmp_path / "a", strategy="tile", image_size=56)
    with pytest.raises(InvalidLengthError, match="multiple of the patch size 8x8"):
        posextend.resize_checkpoint(vision["vit"], tmp_path / "a", image_size=50)
    with pytest.raises(InvalidLengthError, match="smaller than the current 5x5"):
        posextend.resize_checkpoint(vision["vit"], tmp_path / "a", image_size=24)
    assert not (tmp_path / "a").exists()
    swin = tmp_path / "swin"
    transformers.SwinModel(transformers.SwinConfig(embed_dim=16, depths=[1, 1], num_heads=[1, 1])).save_pretrained(swin)
    with pytest.raises(NotLearnedPositionsError, match="relative position biases"):
        posextend.resize_checkpoint(swin, tmp_path / "b", image_size=448)


def test_nearest_and_bilinear_on_a_file(vision, tmp_path):
    old = _table(vision["vit"], "embeddings.position_embeddings")[0, 1:].reshape(5, 5, -1)
    posextend.resize_checkpoint(vision["vit"], tmp_path / "n", image_size=80, strategy="nearest")
    new = _table(tmp_path / "n", "embeddings.position_embeddings")[0, 1:].reshape(10, 10, -1)
    assert torch.equal(new[::2, ::2], old) and torch.equal(new[1::2, 1::2], old)
    report = posextend.resize_checkpoint(vision["vit"], tmp_path / "b", image_size=56, strategy="bilinear")
    assert report.strategy == "bilinear" and report.verified


# ----------------------------------------------------------------------------- CLIP: text and vision


@pytest.fixture(scope="session")
def clip(tmp_path_factory) -> Path:
    config = transformers.CLIPConfig(
        text_config=dict(vocab_size=1000, hidden_size=16, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=77),
        vision_config=dict(_TOWER), projection_dim=12,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("clip") / "clip"
    transformers.CLIPModel(config).save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 77}))
    return path


TEXT = "text_model.embeddings.position_embedding.weight"
VISION_TABLE = "vision_model.embeddings.position_embedding.weight"


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_clip_text_kps_is_long_clip_and_vision_bytes_stay(clip, tmp_path):
    report = posextend.resize_checkpoint(clip, tmp_path / "long", 248, "kps", seed=0)
    before, after = _tensors(clip), _tensors(tmp_path / "long")
    torch.testing.assert_close(after[TEXT], long_clip_reference(before[TEXT]), rtol=0, atol=1e-7)
    assert report.new_image_size is None
    assert all(torch.equal(after[k], before[k]) for k in before if k.startswith("vision_model."))
    config = json.loads((tmp_path / "long" / "config.json").read_text())
    assert config["text_config"]["max_position_embeddings"] == 248 and config["vision_config"]["image_size"] == IMAGE
    assert json.loads((tmp_path / "long" / "tokenizer_config.json").read_text())["model_max_length"] == 248
    assert json.loads((tmp_path / "long" / "preprocessor_config.json").read_text()) == PROCESSOR
    model = load_clean(tmp_path / "long", transformers.CLIPModel)
    with torch.no_grad():
        assert model.get_text_features(input_ids=torch.randint(5, 900, (2, 248))).pooler_output.shape[-1] == 12


def test_clip_vision_alone_then_both_in_one_call(clip, tmp_path):
    report = posextend.resize_checkpoint(clip, tmp_path / "hi", image_size=56)
    before, after = _tensors(clip), _tensors(tmp_path / "hi")
    assert report.tables == [VISION_TABLE] and report.verified and report.new_grid == [7, 7]
    assert all(torch.equal(after[k], before[k]) for k in before if k.startswith("text_model."))
    assert json.loads((tmp_path / "hi" / "tokenizer_config.json").read_text())["model_max_length"] == 77
    original, resized = load_clean(clip, transformers.CLIPModel), load_clean(tmp_path / "hi", transformers.CLIPModel)
    pixels = torch.randn(2, 3, 56, 56)
    with torch.no_grad():
        expected = original.get_image_features(pixel_values=pixels, interpolate_pos_encoding=True).pooler_output
        got = resized.get_image_features(pixel_values=pixels).pooler_output
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)

    both = posextend.resize_checkpoint(clip, tmp_path / "both", 248, "kps", image_size=56)
    assert both.strategies == {"text": "kps", "vision": "bicubic"}
    written = _tensors(tmp_path / "both")
    assert torch.equal(written[VISION_TABLE], after[VISION_TABLE])
    torch.testing.assert_close(written[TEXT], long_clip_reference(before[TEXT]), rtol=0, atol=1e-7)
    model = load_clean(tmp_path / "both", transformers.CLIPModel)
    with torch.no_grad():
        out = model(input_ids=torch.randint(5, 900, (1, 248)), pixel_values=torch.randn(1, 3, 56, 56))
    assert out.logits_per_image.shape == (1, 1)
    in_memory = posextend.extend_model(load_clean(clip, transformers.CLIPModel), 248, "kps", image_size=56)
    assert torch.equal(in_memory.vision_model.embeddings.position_embedding.weight, written[VISION_TABLE])
    assert in_memory.config.vision_config.image_size == 56 and in_memory.config.text_config.max_position_embeddings == 248


# ----------------------------------------------------------------------------- command line


def test_cli_image_size_and_inspect(vision, tmp_path):
    runner = CliRunner()
    r = runner.invoke(app, ["resize-model", str(vision["vit"]), str(tmp_path / "out"), "--image-size", "56x40"])
    assert r.exit_code == 0, r.output
    assert "40x40 → 56x40 px, patches 5x5 → 7x5 with bicubic" in r.output
    r = runner.invoke(app, ["inspect", str(tmp_path / "out")])
    assert r.exit_code == 0 and "image grid: 7x5 patches of 8x8 px, prefix tokens: 1" in r.output, r.output
    info = posextend.inspect_checkpoint(tmp_path / "out")
    assert info.groups[0].grid == [7, 5] and info.groups[0].patch_size == [8, 8] and info.reserved == 1
    r = runner.invoke(app, ["resize-model", str(vision["vit"]), str(tmp_path / "bad"), "--image-size", "big"])
    assert r.exit_code == 1 and "--image-size takes pixels" in r.output
    r = runner.invoke(app, ["resize-model", str(vision["vit"]), str(tmp_path / "bad")])
    assert r.exit_code == 1 and "Give --length" in r.output


def test_inspect_plot_shows_the_grid_similarity(vision, tmp_path):
    pytest.importorskip("matplotlib")
    posextend.resize_checkpoint(vision["vit"], tmp_path / "big", image_size=56)
    r = CliRunner().invoke(app, ["inspect", str(tmp_path / "big"), "--plot", str(tmp_path / "plots"),
                                 "--compare", str(vision["vit"])])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "plots" / "grid_similarity.png").stat().st_size > 1000
    from posextend.scoring.analysis import grid_similarity

    from posextend.resize.inspection import read_position_table

    grid = read_position_table(tmp_path / "big", grid=True)
    assert grid.shape[:2] == (7, 7)
    sim = grid_similarity(grid, [(3, 3)])
    assert sim.shape == (1, 7, 7) and abs(float(sim[0, 3, 3]) - 1) < 1e-5
