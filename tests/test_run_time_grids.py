"""Families that adapt one learned image grid to each image on every forward (Qwen3-VL's
``fast_pos_embed_interpolate``, GLM-4V's per-image ``grid_sample``, Kimi, PaddleOCR-VL, MiniCPM-V ...):
observed on tiny twins fed patch sequences with their grid at two sizes, refused with what to do; their
text (or tower) attention is rotary, which the refusal says too. Models whose grid is resizable keep it."""

from __future__ import annotations

import pytest
import torch
import transformers
from typer.testing import CliRunner

import posextend
from posextend.families import configs, twin, twin_runs
from posextend.cli import app
from posextend.families.grid_probe import observe_grids
from posextend.families.lookup import all_specs, spec_for


def _config(model_type: str) -> tuple[dict, type]:
    """The type's default config, widths and layers shrunk, and its model class."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    name = MODEL_MAPPING_NAMES.get(model_type) or CONFIG_MAPPING_NAMES[model_type].removesuffix("Config") + "Model"
    cls = getattr(transformers, name if isinstance(name, str) else name[0])
    config = transformers.AutoConfig.for_model(model_type).to_dict()
    config.update(model_type=model_type, architectures=[cls.__name__])
    return configs.shrink(config), cls


@pytest.mark.parametrize("model_type", ["qwen3_vl_vision", "glm4v", "qwen3_vl", "paddleocr_vl_vision"])
def test_a_grid_adapted_to_each_image_is_refused_through_the_cli(tmp_path, model_type):
    """A tower that takes patch sequences with their grid (``grid_thw``), alone or inside a VLM whose language
    model is rotary: refused as a run-time grid, saying both facts and what to do; nothing written."""
    config, cls = _config(model_type)
    src = tmp_path / "src"
    twin.build(config, cls=cls).save_pretrained(src)
    r = CliRunner().invoke(app, ["resize-model", str(src), str(tmp_path / "out"), "--image-size", "896"])
    assert r.exit_code == 1, r.output
    text = " ".join(r.output.split())
    assert "rotary embeddings (RoPE)" in text and "ran on images of 12x12 and 24x24 patches" in text
    assert "adapts the grid to each image on every forward" in text and "feed it larger images instead" in text
    assert "--" not in text and not (tmp_path / "out").exists()


def test_the_refusal_is_a_run_time_grid_error_naming_the_table():
    config, cls = _config("qwen3_vl_vision")
    with pytest.raises(posextend.RunTimeGridError, match=r"with one table pos_embed\.weight \[2304, 64\]"):
        all_specs(config, cls=cls)
    with pytest.raises(posextend.RunTimeGridError):
        spec_for(config, cls=cls, rank=2)


def test_run_patches_feeds_a_patch_sequence_with_its_grid():
    """Qwen3-VL's tower takes ``[patches, c * t * p * p]`` and ``grid_thw``: the first layout runs, at each grid."""
    config, cls = _config("qwen3_vl_vision")
    model = twin.build(config, cls=cls)
    out, where = twin_runs.run_patches(model, ["pos_embed.weight"], (12, 12))
    assert where == ("", "flat") and out.shape[0] == 144
    again, _ = twin_runs.run_patches(model, ["pos_embed.weight"], (24, 24), where)
    assert again.shape[0] == 576 and torch.isfinite(again).all()


def test_a_table_the_forward_does_not_use_is_no_run_time_grid(monkeypatch):
    """The observation needs the table to matter: with its lookup cut off, the twin shows nothing to refuse as
    adapted, and the family's default refusal stands (no patch grid is taken for an adapted one)."""
    import posextend.families.grid_probe as gp
    import posextend.families.run_time_grids as rtg

    config, cls = _config("qwen3_vl_vision")
    calls = []
    monkeypatch.setattr(rtg, "_used_at_both", lambda *a: calls.append(a[1]))
    gp._cached.cache_clear()
    try:
        assert observe_grids(config, cls) == ()
    finally:
        gp._cached.cache_clear()
    assert calls == ["pos_embed.weight"]


def test_a_tower_without_rotary_positions_is_refused_without_naming_them():
    """MiniCPM-V's tower (SigLIP, nearest-bucket positions per image) takes its patches side by side with
    ``target_sizes``: a run-time grid, and nothing rotary to mention."""
    config, cls = _config("minicpmv4_7_vision")
    with pytest.raises(posextend.RunTimeGridError) as caught:
        all_specs(config, cls=cls)
    text = str(caught.value)
    assert "rotary" not in text and "embeddings.position_embedding.weight" in text


def test_rotary_language_models_build_no_twin(monkeypatch):
    """A rotary model without a patch size is refused as before, without a twin."""
    import posextend.families.grid_probe as gp

    monkeypatch.setattr(gp, "_cached", lambda *a: pytest.fail("observed a model without a patch size"))
    config = transformers.LlamaConfig().to_dict() | {"model_type": "llama"}
    with pytest.raises(posextend.NotLearnedPositionsError, match="rope_scaling"):
        all_specs(config)


def test_idefics_says_why_neither_its_text_nor_its_grid_is_resized():
    """IDEFICS: a rotary LM beside a CLIP-like tower whose run-time interpolation (DINO's scale factor with
    +0.1) no resampling reproduces: refused, saying both."""
    config, cls = _config("idefics")
    with pytest.raises(posextend.NotLearnedPositionsError) as caught:
        all_specs(config, cls=cls)
    text = str(caught.value)
    assert "rotary embeddings (RoPE)" in text and "interpolate_pos_encoding" in text
    assert not isinstance(caught.value, posextend.RunTimeGridError)


def test_a_resizable_grid_beside_rotary_positions_is_kept():
    """LLaVA (its LM's config is rotary, the top level is not) keeps its probed, resizable CLIP grid."""
    config, _ = _config("llava")
    spec = spec_for(config, rank=2)
    assert spec.grid is not None and spec.grid.reference in ("run-time", "load-and-run")


def test_a_table_another_field_sizes_is_named_in_the_refusal():
    """Molmo2's tower states ``num_position_embeddings`` beside ``image_size``: the refusal names the field that
    sizes its table, not only that the image size does not."""
    config, cls = _config("molmo2_vision")
    with pytest.raises(posextend.PosExtendError, match="positional_embedding .* follows num_position_embeddings instead"):
        all_specs(config, cls=cls)


def test_configs_with_infinite_floats_build_as_transformers_reads_them():
    """transformers saves ``inf`` as ``{"__float__": "Infinity"}`` (NemotronH's ``time_step_limit``)."""
    config = transformers.AutoConfig.for_model("nemotron_h").to_dict() | {"model_type": "nemotron_h"}
    config["time_step_limit"] = [0.0, {"__float__": "Infinity"}]
    assert twin.config_object(config).time_step_limit[1] == float("inf")


def test_a_video_model_is_refused_as_such():
    """TimeSformer's grid sits beside its frames (pixel_values of [batch, frames, channels, H, W]): refused as a
    video model, not as a twin that fails to run."""
    config, cls = _config("timesformer")
    with pytest.raises(posextend.PosExtendError, match="a video model .*num_frames=8.* 3-D video grids"):
        all_specs(config, cls=cls)
