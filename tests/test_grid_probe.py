"""Image grids observed on twins (posextend.families.grid_probe): families without a written grid spec.

Each family's tiny twin (widths shrunk, a 5x5 grid of 8-px patches) is observed, resized on disk to a
larger, a smaller and (where the family handles it) a non-square image, and checked: the written model
computes what the source computes with transformers' own run-time ``interpolate_pos_encoding`` where the
family has one (else it loads and runs at the new size), every other tensor is byte-identical, and the
image processor config follows.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
import transformers
from conftest import load_clean
from PIL import Image
from safetensors import safe_open
from typer.testing import CliRunner

import posextend
from posextend.families import configs, twin, twin_runs
from posextend.cli import app
from posextend.errors import InvalidLengthError
from posextend.families.catalogue import VISION_TOWERS
from posextend.families.grid_fields import image_fields
from posextend.families.grid_probe import observe_grids
from posextend.families.lookup import all_specs, spec_for

IMAGE, PATCH = 40, 8
PROCESSOR = {"do_resize": True, "size": {"height": IMAGE, "width": IMAGE}}
# model type: prefix rows of its grid
FAMILIES = {
    "owlvit": 1, "owlv2": 1, "blip": 1, "blip-2": 1, "instructblip": 1, "chinese_clip": 1, "altclip": 1, "xclip": 1,
    "groupvit": 0, "git": 1, "flava": 1, "aimv2": 0, "metaclip_2": 1, "clipseg": 1, "ijepa": 0, "siglip": 0,
    "owlvit_vision_model": 1, "owlv2_vision_model": 1, "blip_vision_model": 1, "blip_2_vision_model": 1,
    "instructblip_vision_model": 1, "chinese_clip_vision_model": 1, "altclip_vision_model": 1,
    "xclip_vision_model": 1, "groupvit_vision_model": 0, "git_vision_model": 1, "flava_image_model": 1,
    "aimv2_vision_model": 0, "metaclip_2_vision_model": 1, "clipseg_vision_model": 1,
}
TOWERS = ("vision_model", "image_encoder", "image_model")  # where a composite keeps its image tower


def _class(model_type: str) -> type:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    name = MODEL_MAPPING_NAMES.get(model_type) or CONFIG_MAPPING_NAMES[model_type].removesuffix("Config") + "Model"
    return getattr(transformers, name if isinstance(name, str) else name[0])


def tiny_config(model_type: str, cls: type, image: int = IMAGE, patch: int = PATCH) -> dict:
    """The default config, widths and layers shrunk, every image tower at ``image`` px of ``patch`` px."""
    config = transformers.AutoConfig.for_model(model_type).to_dict()
    config.update(model_type=model_type, architectures=[cls.__name__])
    config = configs.shrink(config)
    for image_key, patch_key in image_fields(config):
        config = configs.set_path(configs.set_path(config, image_key, image), patch_key, patch)
    return config


def save_twin(path: Path, config: dict, cls: type) -> None:
    model = twin.build(config, cls=cls)
    with torch.no_grad():  # some families start their grid at zeros: make every row distinct
        for name, p in model.named_parameters():
            if "position_embedding" in name or "pos_embed" in name:
                p.copy_(torch.randn_like(p))
    model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, tuple[Path, type]]:
    root = tmp_path_factory.mktemp("grid_probe")
    out = {}
    for model_type in FAMILIES:
        cls = _class(model_type)
        save_twin(root / model_type, tiny_config(model_type, cls), cls)
        out[model_type] = root / model_type, cls
    return out


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _tower(model):
    """The image tower; its embeddings where only they take ``interpolate_pos_encoding`` (GroupViT)."""
    tower = next((getattr(model, t) for t in TOWERS if hasattr(model, t)), model)
    return tower if "interpolate_pos_encoding" in inspect.signature(tower.forward).parameters else tower.embeddings


def _output(model, pixels, **kwargs) -> torch.Tensor:
    torch.manual_seed(0)
    with torch.no_grad():
        out = _tower(model)(pixel_values=pixels, **kwargs)
    return out if isinstance(out, torch.Tensor) else out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


SIZES = {"up": (56, 56), "down": (24, 24), "non-square": (56, 40)}


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_probed_grid_equals_run_time_interpolation(families, tmp_path, model_type, size):
    src, cls = families[model_type]
    config = json.loads((src / "config.json").read_text())
    spec = observe_grids(config, cls)[0]
    assert spec.note == "probed" and spec.reserved_rows(config) == FAMILIES[model_type]
    assert spec.grid.reference in ("run-time", "load-and-run")
    assert spec_for(config, rank=2).tables == spec.tables  # the lookup every door uses finds it
    h, w = SIZES[size]
    if spec.grid.square and h != w:
        with pytest.raises(InvalidLengthError, match="square images only"):
            posextend.resize_checkpoint(src, tmp_path / "out", image_size=(h, w))
        return
    params = {"antialias": spec.grid.antialias} if size == "down" else {}
    report = posextend.resize_checkpoint(src, tmp_path / "out", image_size=(h, w), allow_shrink=size == "down",
                                         **params)
    covered = "spec" if model_type in VISION_TOWERS else "probed"  # a written tower wins
    assert report.verified and report.covered_by == covered and report.new_grid == [h // PATCH, w // PATCH]
    before, after = _tensors(src), _tensors(tmp_path / "out")
    rows = FAMILIES[model_type] + (h // PATCH) * (w // PATCH)
    for name in report.tables:
        assert after[name].shape[-2] == rows
        assert torch.equal(after[name].reshape(rows, -1)[:FAMILIES[model_type]],
                           before[name].reshape(before[name].shape[-2], -1)[:FAMILIES[model_type]])
    assert {n for n in before if n not in after} == set()
    changed = set(report.tables) | set(report.buffers)
    assert all(torch.equal(after[n], before[n]) for n in before if n not in changed)
    processor = json.loads((tmp_path / "out" / "preprocessor_config.json").read_text())
    assert processor["size"] == {"height": h, "width": w}
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert configs.get_path(written, spec.grid.image_key) == (h if h == w else [h, w])

    original, resized = load_clean(src, cls), load_clean(tmp_path / "out", cls)
    batch = next((v for _, sub in configs.sub_configs(config) if isinstance(v := sub.get("num_frames"), int)), 2)  # X-CLIP
    pixels = torch.randn(batch, twin_runs.num_channels(config), h, w, generator=torch.Generator().manual_seed(1))
    got = _output(resized, pixels)
    assert torch.isfinite(got).all()
    if spec.grid.reference == "run-time":
        expected = _output(original, pixels, interpolate_pos_encoding=True)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_probe_reproduces_the_written_clip_and_siglip_towers():
    for model_type, cls in (("clip", transformers.CLIPModel), ("siglip", transformers.SiglipModel)):
        config = tiny_config(model_type, cls)
        probed, written = observe_grids(config, cls)[0], VISION_TOWERS[model_type]
        assert (probed.tables, probed.reserved, probed.length_keys, probed.group) == (
            written.tables, written.reserved, written.length_keys, written.group)
        assert (probed.grid.square, probed.grid.antialias, probed.grid.strategy or "bicubic") == (True, False, "bicubic")
        assert [b.kind for b in probed.buffers] == [b.kind for b in written.buffers] == ["arange"]
        name = "vision_model.embeddings.position_ids"
        assert probed.buffers[0].matches(name) and written.buffers[0].matches(name)


def test_families_without_image_fields_are_not_probed(monkeypatch):
    import posextend.families.grid_probe as gp

    monkeypatch.setattr(gp, "_cached", lambda *a: pytest.fail("probed a config without image fields"))
    assert observe_grids(transformers.BertConfig().to_dict()) == ()


def test_bare_and_headed_files_match(tmp_path):
    """A headed detection checkpoint and the bare base model's file resize the same grid."""
    config = tiny_config("owlvit", transformers.OwlViTForObjectDetection)
    save_twin(tmp_path / "headed", config, transformers.OwlViTForObjectDetection)
    twin.build(config, cls=transformers.OwlViTModel).save_pretrained(tmp_path / "bare")
    for layout in ("headed", "bare"):
        report = posextend.resize_checkpoint(tmp_path / layout, tmp_path / f"{layout}-out", image_size=56)
        assert report.verified
        assert report.tables == [("owlvit." if layout == "headed" else "") + "vision_model.embeddings.position_embedding.weight"]


def test_refusals_name_the_reason():
    """Hiera's table grows with the image, but not as prefix rows + the patch grid (its stride is not its patch)."""
    hiera = transformers.HieraConfig().to_dict() | {"model_type": "hiera", "architectures": ["HieraModel"]}
    with pytest.raises(posextend.PosExtendError, match="position_embeddings .* no learned table of prefix rows"):
        observe_grids(configs.shrink(hiera))
    owl = tiny_config("owlvit", transformers.OwlViTModel)
    assert [s.group for s in all_specs(owl)] == ["text", "vision"]


def test_vlm_counts_follow_the_grid():
    config = tiny_config("llava", transformers.LlavaForConditionalGeneration)
    config["image_seq_length"] = 25  # 5x5 patches (LLaVA drops the class token)
    spec = spec_for(config, rank=2)
    assert spec.grid.counts == (("image_seq_length", 0),)
    assert spec.config_updates(config, (56, 56)) == {"vision_config.image_size": 56, "image_seq_length": 49}


# ----------------------------------------------------------------------------- real sizes, CLI, own processors


def _real(tmp_path: Path, model_type: str, cls: type, image: int, patch: int) -> Path:
    config = tiny_config(model_type, cls, image, patch)
    save_twin(tmp_path / model_type, config, cls)
    return tmp_path / model_type


def test_owlvit_at_960_through_the_cli(tmp_path):
    src = _real(tmp_path, "owlvit", transformers.OwlViTForObjectDetection, 768, 32)
    transformers.OwlViTImageProcessor(size={"height": 768, "width": 768},
                                      crop_size={"height": 768, "width": 768}).save_pretrained(src)
    r = CliRunner().invoke(app, ["resize-model", str(src), str(tmp_path / "out"), "--image-size", "960"])
    assert r.exit_code == 0, r.output
    processor = transformers.OwlViTImageProcessor.from_pretrained(tmp_path / "out")
    image = Image.fromarray((torch.rand(700, 1000, 3) * 255).to(torch.uint8).numpy())
    pixels = processor(images=image, return_tensors="pt").pixel_values
    assert pixels.shape[-2:] == (960, 960)
    ids = torch.tensor([[5, 6, 7]])
    model = load_clean(tmp_path / "out", transformers.OwlViTForObjectDetection)
    source = load_clean(src, transformers.OwlViTForObjectDetection)
    with torch.no_grad():
        out = model(input_ids=ids, pixel_values=pixels)
        ref = source(input_ids=ids, pixel_values=pixels, interpolate_pos_encoding=True)
    assert out.pred_boxes.shape == (1, 30 * 30, 4)
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=1e-4)
    torch.testing.assert_close(out.pred_boxes, ref.pred_boxes, rtol=0, atol=1e-5)


def test_blip_at_768_through_the_cli(tmp_path):
    src = _real(tmp_path, "blip", transformers.BlipForConditionalGeneration, 384, 16)
    transformers.BlipImageProcessor(size={"height": 384, "width": 384}).save_pretrained(src)
    r = CliRunner().invoke(app, ["resize-model", str(src), str(tmp_path / "out"), "--image-size", "768"])
    assert r.exit_code == 0, r.output
    processor = transformers.BlipImageProcessor.from_pretrained(tmp_path / "out")
    image = Image.fromarray((torch.rand(500, 900, 3) * 255).to(torch.uint8).numpy())
    pixels = processor(images=image, return_tensors="pt").pixel_values
    assert pixels.shape[-2:] == (768, 768)
    ids = torch.tensor([[5, 6, 7]])
    model = load_clean(tmp_path / "out", transformers.BlipForConditionalGeneration)
    source = load_clean(src, transformers.BlipForConditionalGeneration)
    with torch.no_grad():
        out = model(input_ids=ids, pixel_values=pixels)
        ref = source(input_ids=ids, pixel_values=pixels, interpolate_pos_encoding=True)
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("model_type,cls", [("owlvit", transformers.OwlViTForObjectDetection),
                                            ("blip", transformers.BlipModel), ("groupvit", transformers.GroupViTModel)])
def test_extend_model_in_memory_equals_run_time(model_type, cls):
    """In memory too: OWL-ViT's box_bias (a buffer computed from the config) follows the grid."""
    config = tiny_config(model_type, cls)
    model, source = twin.build(config, cls=cls), twin.build(config, cls=cls)
    posextend.extend_model(model, image_size=56)
    pixels = torch.randn(1, 3, 56, 56)
    with torch.no_grad():
        if model_type == "owlvit":
            ids = torch.tensor([[5, 6, 7]])
            got, ref = model(input_ids=ids, pixel_values=pixels), source(input_ids=ids, pixel_values=pixels,
                                                                          interpolate_pos_encoding=True)
            torch.testing.assert_close(got.pred_boxes, ref.pred_boxes, rtol=0, atol=1e-5)
            torch.testing.assert_close(got.logits, ref.logits, rtol=0, atol=1e-4)
            return
    torch.testing.assert_close(_output(model, pixels), _output(source, pixels, interpolate_pos_encoding=True),
                               rtol=0, atol=1e-5)


def test_paligemma_image_token_counts_follow_in_config_and_processor(tmp_path):
    """PaliGemma reads its image-token count from the image processor (``image_seq_length``) and the
    config (``text_config.num_image_tokens``): both follow the grid, or its processor would fail."""
    cls = transformers.PaliGemmaForConditionalGeneration
    config = tiny_config("paligemma", cls)
    config["text_config"]["num_image_tokens"] = 25  # 5x5 patches, no class token
    src = tmp_path / "src"
    save_twin(src, config, cls)
    processor = {**json.loads((src / "preprocessor_config.json").read_text()), "image_seq_length": 25}
    (src / "preprocessor_config.json").write_text(json.dumps(processor))
    (src / "processor_config.json").write_text(json.dumps({"image_seq_length": 25, "processor_class": "PaliGemmaProcessor"}))
    posextend.resize_checkpoint(src, tmp_path / "out", image_size=56)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["vision_config"]["image_size"], written["text_config"]["num_image_tokens"]) == (56, 49)
    for name in ("preprocessor_config.json", "processor_config.json"):
        assert json.loads((tmp_path / "out" / name).read_text())["image_seq_length"] == 49, name
    assert json.loads((tmp_path / "out" / "preprocessor_config.json").read_text())["size"] == {"height": 56, "width": 56}
    model = load_clean(tmp_path / "out", cls)
    with torch.no_grad():
        features = model.get_image_features(pixel_values=torch.randn(1, 3, 56, 56))
    features = features if isinstance(features, torch.Tensor) else features.pooler_output
    assert features.shape[1] == 49


@pytest.mark.parametrize("model_type", ["sam3_vision_model", "radio"])
def test_a_grid_used_at_any_image_size_is_refused_as_adapted_per_image(tmp_path, model_type):
    """SAM 3's ViT and RADIO keep one learned grid that no image-size field sizes and adapt it to every
    image: observed (a twin runs at two sizes with that table, and uses it), refused with what to do."""
    cls = _class(model_type)
    config = transformers.AutoConfig.for_model(model_type).to_dict()
    config.update(model_type=model_type, architectures=[cls.__name__])
    config = configs.shrink(config)
    with pytest.raises(posextend.RunTimeGridError, match=r"ran on (\d+)x\1 and \d+x\d+ images with one table \S*position_embedding"):
        spec_for(config, rank=2)
    src = tmp_path / "src"
    save_twin(src, config, cls)
    r = CliRunner().invoke(app, ["resize-model", str(src), str(tmp_path / "out"), "--image-size", "1120"])
    assert r.exit_code == 1 and "adapts the grid to each image on every forward" in r.output
    assert "feed it larger images instead" in r.output and not (tmp_path / "out").exists()


def test_a_grid_the_image_size_sizes_is_not_taken_for_an_adapted_one():
    """SAM's ViT sizes its [1, H, W, D] grid by image_size and runs at that size only: a grid to resize (its
    image size sizes it), never one adapted per image, although its twin would also run at another size."""
    sam = configs.shrink(transformers.SamVisionConfig().to_dict() | {"model_type": "sam_vision_model",
                                                                  "architectures": ["SamVisionModel"]})
    (spec,) = observe_grids(sam)
    assert spec.tables == ("vision_encoder.pos_embed",) and spec.grid.image_key == "image_size"
