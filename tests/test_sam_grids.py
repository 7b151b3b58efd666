"""SAM-style ViTs at a new image size: ``pos_embed [1, H, W, D]`` resized as its grid, the global-attention
layers' ``rel_pos_h`` / ``rel_pos_w`` resized linearly as SAM resamples them at run time, the windowed
layers' tables and every other tensor copied, the prompt encoder's sizes and the processor following.

Tiny twins (64 px, patch 16: a 4x4 grid; layers 1 and 3 global, 0 and 2 in windows of 2) saved with
``save_pretrained``, resized through the CLI, loaded with a real ``from_pretrained``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from conftest import load_clean
from safetensors import safe_open
from typer.testing import CliRunner

import posextend
from posextend.families import configs
from posextend.cli import app
from posextend.families.grid_probe import observe_grids
from posextend.tables.relative import resize_relative
from posextend.tables.strategies import resize_grid

GLOBAL, WINDOWED = (1, 3), (0, 2)
VISION = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, image_size=64, patch_size=16,
              window_size=2, global_attn_indexes=list(GLOBAL), mlp_dim=48, output_channels=16, num_pos_feats=8)


def _sam_config() -> transformers.SamConfig:
    return transformers.SamConfig(
        vision_config=VISION,
        prompt_encoder_config=dict(hidden_size=16, image_size=64, image_embedding_size=4, patch_size=16,
                                   mask_input_channels=4),
        mask_decoder_config=dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, mlp_dim=32,
                                 iou_head_hidden_dim=16),
    )


def _save(model: torch.nn.Module, path: Path) -> Path:
    """``model`` with distinct random position tables (SAM starts them at zeros) and weights that count (its
    layers start near zero), saved with its processor."""
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for name, param in model.named_parameters():
            if "rel_pos" in name or "pos_embed" in name:
                param.copy_(torch.randn(param.shape, generator=gen))
            elif param.dim() > 1:
                param.copy_(torch.randn(param.shape, generator=gen) * param[0].numel() ** -0.5)
    model.save_pretrained(path)
    transformers.SamImageProcessor(size={"longest_edge": 64}, pad_size={"height": 64, "width": 64},
                                   mask_size={"longest_edge": 16}, mask_pad_size={"height": 16, "width": 16},
                                   ).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def sam(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    return _save(transformers.SamModel(_sam_config()).eval(), tmp_path_factory.mktemp("sam") / "src")


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _resize(src: Path, dst: Path, size: int, *extra: str) -> None:
    r = CliRunner().invoke(app, ["resize-model", str(src), str(dst), "--image-size", str(size), *extra])
    assert r.exit_code == 0, r.output
    assert "pos_embed" in r.output and "rel_pos_h" in r.output


def _point_output(model: transformers.SamModel, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The vision encoder's last layer's states (O(1); a tiny twin's neck and masks are ~1e-13 and ~1e-6) and the
    masks for one point prompt."""
    pixels = torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(1))
    points = torch.tensor([[[[size * 0.3, size * 0.6]]]])
    with torch.no_grad():
        out = model(pixel_values=pixels, input_points=points)
        states = model.vision_encoder(pixel_values=pixels, output_hidden_states=True).hidden_states[-1]
    assert torch.isfinite(out.pred_masks).all() and torch.isfinite(out.iou_scores).all()
    assert states.abs().mean() > 0.1
    return states, out.pred_masks


@pytest.mark.parametrize("size,extra", [(96, ()), (128, ()), (32, ("--shrink",))])
def test_sam_at_a_new_size_through_the_cli(sam, tmp_path, size, extra):
    _resize(sam, tmp_path / "out", size, *extra)
    side = size // 16
    model = load_clean(tmp_path / "out", transformers.SamModel)  # no missing, unexpected or mismatched key
    masks = _point_output(model, size)[1]
    assert masks.shape[-2:] == (4 * side, 4 * side)  # low-res masks at a quarter of the image
    old, new = _tensors(sam), _tensors(tmp_path / "out")
    assert set(old) == set(new)
    assert new["vision_encoder.pos_embed"].shape == (1, side, side, 32)
    expected = resize_grid(old["vision_encoder.pos_embed"], (4, 4), (side, side), "bicubic")
    assert torch.equal(new["vision_encoder.pos_embed"], expected)
    changed = {"vision_encoder.pos_embed"}
    for layer in GLOBAL:
        for axis in "hw":
            name = f"vision_encoder.layers.{layer}.attn.rel_pos_{axis}"
            assert new[name].shape == (2 * side - 1, 16)
            assert torch.equal(new[name], resize_relative(old[name], 2 * side - 1))
            changed.add(name)
    for layer in WINDOWED:  # windows of 2 patches at any image size: copied as they are
        for axis in "hw":
            name = f"vision_encoder.layers.{layer}.attn.rel_pos_{axis}"
            assert new[name].shape == (3, 16)
    for name in set(old) - changed:
        assert old[name].dtype == new[name].dtype, name
        assert torch.equal(old[name].view(torch.uint8), new[name].view(torch.uint8)), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["vision_config"]["image_size"] == size
    assert config["prompt_encoder_config"]["image_size"] == size
    assert config["prompt_encoder_config"]["image_embedding_size"] == side
    processor = json.loads((tmp_path / "out" / "preprocessor_config.json").read_text())
    assert processor["size"] == {"longest_edge": size} and processor["pad_size"] == {"height": size, "width": size}
    assert processor["mask_pad_size"] == {"height": size // 4, "width": size // 4}


@pytest.mark.parametrize("size,extra", [(96, ()), (32, ("--shrink",))])
def test_resized_rel_pos_computes_what_sam_resamples_at_run_time(sam, tmp_path, size, extra):
    """The written model against itself holding the source's rel_pos tables as they are (SAM's get_rel_pos then
    resamples them linearly on every forward): the same masks."""
    _resize(sam, tmp_path / "out", size, *extra)
    model = load_clean(tmp_path / "out", transformers.SamModel)
    got = _point_output(model, size)
    source = _tensors(sam)
    for layer in GLOBAL:
        attn = model.vision_encoder.layers[layer].attn
        assert attn.rel_pos_h.shape[0] != source[f"vision_encoder.layers.{layer}.attn.rel_pos_h"].shape[0]
        attn.rel_pos_h = torch.nn.Parameter(source[f"vision_encoder.layers.{layer}.attn.rel_pos_h"])
        attn.rel_pos_w = torch.nn.Parameter(source[f"vision_encoder.layers.{layer}.attn.rel_pos_w"])
    want = _point_output(model, size)
    assert (got[0] - want[0]).abs().max() <= 1e-5
    for layer in GLOBAL:  # and the tables matter: without them the states move
        model.vision_encoder.layers[layer].attn.rel_pos_h = torch.nn.Parameter(torch.zeros(2 * size // 16 - 1, 16))
    assert (_point_output(model, size)[0] - want[0]).abs().max() > 1e-2
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-9)


def test_resize_relative_is_sams_run_time_resampling():
    attn = transformers.models.sam.modeling_sam.SamVisionAttention(transformers.SamVisionConfig(**VISION), 0)
    table = torch.randn(7, 16, generator=torch.Generator().manual_seed(3))
    for side in (2, 3, 6, 11):
        resized = resize_relative(table, 2 * side - 1)
        assert resized.shape == (2 * side - 1, 16)
        assert torch.equal(attn.get_rel_pos(side, side, resized), attn.get_rel_pos(side, side, table))
    assert resize_relative(table.half(), 11).dtype == torch.float16


def test_four_d_grid_keeps_its_layout():
    table = torch.randn(1, 4, 5, 8, generator=torch.Generator().manual_seed(4))
    out = resize_grid(table, (4, 5), (6, 7), "bicubic")
    assert out.shape == (1, 6, 7, 8)
    assert torch.equal(out[0], resize_grid(table[0].reshape(20, 8), (4, 5), (6, 7), "bicubic").reshape(6, 7, 8))
    with pytest.raises(Exception, match="reserved rows"):
        resize_grid(table, (5, 4), (6, 7), "bicubic")  # the grid on disk is 4x5, not 5x4


def test_sam_vision_model_through_the_cli(tmp_path):
    torch.manual_seed(0)
    src = _save(transformers.SamVisionModel(transformers.SamVisionConfig(**VISION)).eval(), tmp_path / "src")
    _resize(src, tmp_path / "out", 96)
    model = load_clean(tmp_path / "out", transformers.SamVisionModel)
    with torch.no_grad():
        out = model(pixel_values=torch.randn(1, 3, 96, 96))
    assert out.last_hidden_state.shape[-2:] == (6, 6)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["image_size"] == 96


def test_observed_spec_names_the_global_layers_only():
    config = transformers.SamConfig().to_dict()  # ViT-B: 12 layers, global 2, 5, 8, 11, windows of 14
    (spec,) = observe_grids(config, transformers.SamModel)
    assert spec.tables == ("vision_encoder.pos_embed",) and spec.grid.square
    names = [f"vision_encoder.layers.{i}.attn.rel_pos_{a}" for i in (2, 5, 8, 11) for a in "hw"]
    assert spec.grid.relative == tuple(names)
    assert dict(spec.grid.follow) == {"prompt_encoder_config.image_size": "image",
                                      "prompt_encoder_config.image_embedding_size": "side"}
    assert spec.grid.reference == "load-and-run; relative tables: run-time"


def test_shrink_keeps_a_global_and_a_windowed_layer():
    small = configs.shrink(transformers.SamConfig().to_dict())["vision_config"]
    assert small["num_hidden_layers"] == configs.TINY_LAYERS
    assert small["global_attn_indexes"] == [configs.TINY_LAYERS - 1]
    every = configs.shrink({**transformers.SamVisionConfig().to_dict(), "global_attn_indexes": list(range(12))})
    assert every["global_attn_indexes"] == list(range(configs.TINY_LAYERS))


def test_non_square_sizes_are_refused(sam, tmp_path):
    r = CliRunner().invoke(app, ["resize-model", str(sam), str(tmp_path / "out"), "--image-size", "96x64"])
    assert r.exit_code != 0 and "square" in r.output
    assert not (tmp_path / "out").exists()


def test_sam_vision_model_in_memory_equals_the_resized_file(tmp_path):
    torch.manual_seed(0)
    src = _save(transformers.SamVisionModel(transformers.SamVisionConfig(**VISION)).eval(), tmp_path / "src")
    _resize(src, tmp_path / "out", 96)
    written = load_clean(tmp_path / "out", transformers.SamVisionModel)
    model = posextend.extend_model(load_clean(src, transformers.SamVisionModel), image_size=96)
    pixels = torch.randn(1, 3, 96, 96, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(model(pixel_values=pixels).last_hidden_state, written(pixel_values=pixels).last_hidden_state)


def test_sam_in_memory_is_refused_with_what_to_do(sam):
    model = load_clean(sam, transformers.SamModel)
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(posextend.PosExtendError, match="resize the saved checkpoint"):
        posextend.extend_model(model, image_size=96)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert model.config.vision_config.image_size == 64
