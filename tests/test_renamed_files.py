"""Files whose names transformers renames on loading (and back on saving), through the family's own
conversion mapping: Qianfan-OCR's vision tower saves ``…position_embedding`` for the module's
``…position_embeddings``, Step3p7's ``vision_model.positional_embedding`` for ``…embeddings.position_embedding.weight``.
The table is found under the file's name, resized, written under that name, and the output loads cleanly
and runs at the new image size."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import load_clean
from safetensors import safe_open
from typer.testing import CliRunner

from posextend.families import configs, twin
from posextend.cli import app

# model type: the table's name in the file (renamed by save_pretrained), where the vision tower sits
RENAMED = {"qianfan_ocr": ("vision_tower.embeddings.position_embedding", "vision_tower"),
           "step3p7": ("vision_model.positional_embedding", "vision_model")}
IMAGE, PATCH = 56, 14


def _tensors(path):
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("model_type", list(RENAMED))
def test_a_table_under_a_renamed_name_is_resized_in_place(model_type, tmp_path):
    config = configs.shrink(transformers.AutoConfig.for_model(model_type).to_dict())
    config["vision_config"].update(image_size=IMAGE, patch_size=PATCH)
    cls = twin.model_class(config)
    src, dst = tmp_path / "src", tmp_path / "dst"
    twin.build(config, cls=cls).save_pretrained(src)
    table, tower = RENAMED[model_type]
    before = _tensors(src)
    assert table in before  # save_pretrained wrote the renamed name
    r = CliRunner().invoke(app, ["resize-model", str(src), str(dst), "--image-size", str(2 * IMAGE)])
    assert r.exit_code == 0, r.output
    after = _tensors(dst)
    assert sorted(after) == sorted(before)  # every name as in the source file
    cells = (2 * IMAGE // PATCH) ** 2
    assert after[table].shape[-2] - before[table].shape[-2] == cells - (IMAGE // PATCH) ** 2
    assert all(torch.equal(after[k], before[k]) for k in before if k != table)
    model = load_clean(dst, cls)
    assert model.config.vision_config.image_size in (2 * IMAGE, [2 * IMAGE, 2 * IMAGE])
    with torch.no_grad():
        out = getattr(model, tower)(pixel_values=torch.randn(1, 3, 2 * IMAGE, 2 * IMAGE))
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    assert torch.isfinite(hidden).all()
