"""MGP-STR (scene-text recognition, 32x128 images of 4-px patches, its logits one tensor per head): its
grid is observed on a twin and resized through the CLI to a taller and wider image; the written model
loads cleanly and recognises text at the new size, and every other tensor keeps its bytes."""

from __future__ import annotations

import json

import torch
import transformers
from conftest import load_clean
from safetensors import safe_open
from typer.testing import CliRunner

from posextend.families import configs, twin
from posextend.cli import app


def _tensors(path):
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_mgp_str_at_a_larger_non_square_image_through_the_cli(tmp_path):
    config = configs.shrink(transformers.MgpstrConfig().to_dict())
    config["architectures"] = ["MgpstrForSceneTextRecognition"]
    src, dst = tmp_path / "src", tmp_path / "dst"
    model = twin.build(config, cls=transformers.MgpstrForSceneTextRecognition)
    model.save_pretrained(src)
    (src / "preprocessor_config.json").write_text(json.dumps({"size": {"height": 32, "width": 128}}))
    r = CliRunner().invoke(app, ["resize-model", str(src), str(dst), "--image-size", "48x160"])
    assert r.exit_code == 0, r.output
    out = load_clean(dst, transformers.MgpstrForSceneTextRecognition)
    assert list(out.config.image_size) == [48, 160]
    table = "mgp_str.embeddings.pos_embed"
    before, after = _tensors(src), _tensors(dst)
    assert after[table].shape == (1, 1 + (48 // 4) * (160 // 4), config["hidden_size"])
    assert torch.equal(after[table][:, 0], before[table][:, 0])  # the class token's row
    assert all(torch.equal(after[k], before[k]) for k in before if k != table)
    with torch.no_grad():
        logits = out(pixel_values=torch.randn(1, 3, 48, 160)).logits
    assert all(torch.isfinite(x).all() for x in logits)
    assert json.loads((dst / "preprocessor_config.json").read_text())["size"] == {"height": 48, "width": 160}
