"""The ``image-text`` objective (Long-CLIP's recipe for dual encoders) on tiny twins built from configs: through the
command line with a length, an image size or both; the written checkpoint at its new sizes; ``kps``'s first rows kept
and frozen; the baseline and the verdict recomputed by hand; bad image data; LoRA; every dual encoder it trains."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file
from typer.testing import CliRunner

import posextend
from posextend.cli import app
from posextend.tables.strategies import kps_keep
from posextend.training.objectives import default_objective, objectives_help
from posextend.training.objectives.captions import first_sentence
from posextend.training.objectives.dual_encoder import pca
from posextend.training.objectives.image_text import FAMILIES

pytest.importorskip("datasets")
DIGITS = "zero one two three four five six seven eight nine".split()
PLACES = ["top left", "top right", "bottom left", "bottom right"]
WORDS = sorted({w for p in PLACES for w in p.split()} | set(DIGITS) | {"a", ":", "."})
OLD, NEW, IMAGE, BIGGER = 24, 40, 16, 24
TEXT = "text_model.embeddings.position_embedding.weight"
KEPT = kps_keep(OLD)  # the rows kps keeps exact (and the run frozen) by default: 6 of 24
runner = CliRunner()


def tokenizer(length: int, words: list[str] = WORDS) -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer of the captions' ``words``: <s> 0, <pad> 1, <unk> 2 … </s> last (CLIP pools at its EOS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {w: i for i, w in enumerate(["<s>", "<pad>", "<unk>", *words, "</s>"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", len(vocab) - 1)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                                unk_token="<unk>", cls_token="<s>", sep_token="</s>", model_max_length=length)


def text_ids(vocab: int) -> dict:
    return dict(vocab_size=vocab + 3, bos_token_id=0, pad_token_id=1, eos_token_id=vocab - 1)


def save(model: torch.nn.Module, path: Path, length: int, image_processor=None) -> Path:
    """The checkpoint as hub uploads hold it: weights, tokenizer files and a preprocessor_config.json."""
    model.save_pretrained(path)
    tokenizer(length).save_pretrained(path)
    (image_processor or transformers.CLIPImageProcessor(size={"shortest_edge": IMAGE},
                                                        crop_size={"height": IMAGE, "width": IMAGE})).save_pretrained(path)
    return path


def tiny_clip(path: Path, length: int = OLD) -> Path:
    vocab = len(tokenizer(length))
    tower = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2)
    config = transformers.CLIPConfig(text_config=dict(max_position_embeddings=length, **tower, **text_ids(vocab)),
                                     vision_config=dict(image_size=IMAGE, patch_size=4, **tower), projection_dim=8)
    torch.manual_seed(0)
    return save(transformers.CLIPModel(config), path, length)


def pairs(path: Path, n: int = 48, seed: int = 0, short_every: int = 4) -> Path:
    """Images of coloured quarters and captions naming them ("top left: a seven. …", 26 tokens; every
    ``short_every``-th one names two quarters: 14 tokens), with a metadata.jsonl."""
    import PIL.Image

    rng = random.Random(seed)
    path.mkdir(parents=True)
    rows = []
    for i in range(n):
        digits = [rng.randrange(10) for _ in PLACES]
        cells = 2 if i % short_every == 0 else 4
        image = np.zeros((IMAGE, IMAGE, 3), np.uint8)
        for k, d in enumerate(digits[:cells]):
            image[(k // 2) * 8:(k // 2) * 8 + 8, (k % 2) * 8:(k % 2) * 8 + 8] = (25 * d, 255 - 25 * d, 77 * d % 255)
        PIL.Image.fromarray(image).save(path / f"{i}.png")
        rows.append({"file_name": f"{i}.png", "text": " ".join(f"{p}: a {DIGITS[d]}." for p, d in zip(PLACES[:cells], digits))})
    (path / "metadata.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> Path:
    return tiny_clip(tmp_path_factory.mktemp("clip") / "clip")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pairs")
    return {"train": pairs(root / "train"), "held": pairs(root / "held", 24, seed=1)}


def finetune_cli(src: Path, dst: Path, data: dict[str, Path], *args) -> str:
    r = runner.invoke(app, ["finetune", str(src), str(dst), "--data", str(data["train"]), "--eval-data",
                            str(data["held"]), "--steps", "2", *map(str, args)])
    assert r.exit_code == 0, r.output
    return r.output


# ----------------------------------------------------------------------------- the objective and its place


def test_it_is_the_default_for_dual_encoders_and_listed(clip):
    assert default_objective(clip) == "image-text"
    assert "image-text: Dual encoders" in objectives_help()
    r = runner.invoke(app, ["finetune", "--help"])
    assert r.exit_code == 0 and "image-text" in r.output


def test_first_sentence_and_pca():
    assert first_sentence("top left: a one. top right: a two.") == "top left: a one."
    assert first_sentence("no full stop") == "no full stop"
    x = torch.randn(12, 6, dtype=torch.float64)
    assert torch.allclose(pca(x, 6), x, atol=1e-5)  # every component: the features themselves
    reduced = pca(x, 2) - x.mean(0)
    assert torch.linalg.matrix_rank(reduced, atol=1e-5) == 2


def test_kept_rows_get_no_gradient_and_a_model_is_read_in_eval_mode_then_as_it_was():
    from posextend.scoring.by_position import evaluating
    from posextend.training.adapters import keep_rows

    table = torch.nn.Parameter(torch.arange(12.0).reshape(6, 2))
    kept = keep_rows(table, 4)
    (table * torch.arange(1.0, 7.0)[:, None]).sum().backward()
    assert torch.equal(kept, torch.arange(8.0).reshape(4, 2)) and torch.equal(table.grad[:4], torch.zeros(4, 2))
    assert torch.equal(table.grad[4:], torch.tensor([[5.0, 5.0], [6.0, 6.0]]))  # the rows after keep learn
    model = torch.nn.Dropout(0.5).train()
    with pytest.raises(RuntimeError), evaluating(model):
        assert not model.training
        raise RuntimeError("a reading that fails")
    assert model.training  # back in training mode, even after an error


# ----------------------------------------------------------------------------- through the command line


def test_length_only(clip, data, tmp_path):
    out = finetune_cli(clip, tmp_path / "long", data, "--length", NEW)
    assert f"Text positions 0-{KEPT - 1} kept frozen" in out and "R@1" in out
    model = transformers.CLIPModel.from_pretrained(tmp_path / "long")
    assert model.config.text_config.max_position_embeddings == NEW and model.config.vision_config.image_size == IMAGE
    processor = transformers.AutoProcessor.from_pretrained(tmp_path / "long")
    assert processor.tokenizer.model_max_length == NEW
    assert (json.loads((tmp_path / "long" / "preprocessor_config.json").read_text())
            == json.loads((clip / "preprocessor_config.json").read_text()))
    with torch.no_grad():
        ids = processor.tokenizer(["top left: a one. " * 9], truncation=True, return_tensors="pt")
        assert ids["input_ids"].shape[1] == NEW
        assert model.get_text_features(**ids).pooler_output.shape == (1, 8)
    before, after = load_file(clip / "model.safetensors"), load_file(tmp_path / "long" / "model.safetensors")
    assert torch.equal(after[TEXT][:KEPT], before[TEXT][:KEPT])  # kps keeps them; the hook keeps them frozen
    card = (tmp_path / "long" / "README.md").read_text()
    assert "- Verdict: " in card and "R@1" in card
    written = json.loads((tmp_path / "long" / "posextend_eval.json").read_text())
    assert written["verdict"]["baseline"]["higher"] and written["after"]["metric"] == "R@1"


def test_image_size_only(clip, data, tmp_path):
    finetune_cli(clip, tmp_path / "big", data, "--image-size", BIGGER, "--strategy", "nearest")
    with safe_open(tmp_path / "big" / "model.safetensors", "pt") as f:
        assert f.metadata()["posextend.strategy"] == "nearest"  # a grid strategy named: kept
    model = transformers.CLIPModel.from_pretrained(tmp_path / "big")
    assert model.config.vision_config.image_size == BIGGER and model.config.text_config.max_position_embeddings == OLD
    processor = transformers.AutoProcessor.from_pretrained(tmp_path / "big")
    pixels = processor.image_processor([np.zeros((40, 50, 3), np.uint8)], return_tensors="pt")["pixel_values"]
    assert pixels.shape[-2:] == (BIGGER, BIGGER) and processor.tokenizer.model_max_length == OLD
    with torch.no_grad():
        assert model.get_image_features(pixel_values=pixels).pooler_output.shape == (1, 8)


def test_image_size_only_without_naming_a_strategy(clip, data, tmp_path):
    """The objective's text strategy (kps) does not apply: the grid grows by its own default, as resize-model's."""
    finetune_cli(clip, tmp_path / "big", data, "--image-size", BIGGER)
    posextend.resize_checkpoint(clip, tmp_path / "resized", image_size=BIGGER)
    grid = "vision_model.embeddings.position_embedding.weight"
    trained, resized = (load_file(tmp_path / d / "model.safetensors")[grid] for d in ("big", "resized"))
    assert trained.shape == resized.shape and json.loads((tmp_path / "big" / "config.json").read_text())[
        "vision_config"]["image_size"] == BIGGER
    recorded = []
    for d in ("big", "resized"):
        with safe_open(tmp_path / d / "model.safetensors", "pt") as f:
            recorded.append(f.metadata().get("posextend.strategy"))
    assert recorded[0] == recorded[1] != "kps"  # the provenance names the strategy the grid grew by



def test_a_text_strategy_named_for_an_image_only_run_is_refused(clip, data, tmp_path):
    r = runner.invoke(app, ["finetune", str(clip), str(tmp_path / "big"), "--data", str(data["train"]), "--image-size",
                            BIGGER, "--strategy", "kps", "--steps", "1"])
    assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1, r.output
    assert "Strategy 'kps' resizes positions, but this run resizes only image grids: name one that does" in r.output
    assert not (tmp_path / "big").exists()


def test_kps_fits_a_16_row_text_table_with_nothing_but_the_length(data, tmp_path):
    """OWL-ViT's and small CLIPs' 16 text positions: the default kps keeps 4 of them (20 of 77, scaled)."""
    src = tiny_clip(tmp_path / "src", 16)
    out = finetune_cli(src, tmp_path / "out", data, "--length", 48)
    assert "Text positions 0-3 kept frozen" in out
    before, after = load_file(src / "model.safetensors")[TEXT], load_file(tmp_path / "out" / "model.safetensors")[TEXT]
    assert after.shape[0] == 48 and torch.equal(after[:4], before[:4]) and not torch.equal(after[4:16], before[4:])
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        assert f.metadata()["posextend.strategy"] == "kps"


def test_a_strategy_parameter_reaches_the_resize(clip, data, tmp_path):
    report = posextend.finetune(clip, tmp_path / "out", [data["train"]], eval_data=[str(data["held"])], length=NEW,
                                steps=1, params={"keep": 10})
    before, after = load_file(clip / "model.safetensors")[TEXT], load_file(tmp_path / "out" / "model.safetensors")[TEXT]
    assert torch.equal(after[:10], before[:10]) and not torch.equal(after[10:OLD], before[10:])
    assert any(n.startswith("Text positions 0-9 kept frozen") for n in report.notes), report.notes
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        assert json.loads(f.metadata()["posextend.params"]) == {"keep": 10}

def test_a_held_out_set_with_few_first_sentences_is_named(clip, data, tmp_path, monkeypatch):
    """Among a few first sentences a short-caption loss can hide: the notes say so, and ask for more held-out
    pairs; from FEW_SHORTS on they do not."""
    from posextend.training.objectives import image_text

    warning = "so few that a loss on short captions can hide"
    for few, named in ((image_text.FEW_SHORTS, True), (1, False)):
        monkeypatch.setattr(image_text, "FEW_SHORTS", few)
        report = posextend.finetune(clip, tmp_path / "out", [data["train"]], eval_data=[str(data["held"])],
                                    length=NEW, steps=1, overwrite=True)
        line = next(n for n in report.notes if n.startswith("Held-out pairs:"))
        assert (warning in line) is named and ("give more held-out pairs" in line) is named, line


def test_length_and_image_size_in_one_run(clip, data, tmp_path):
    finetune_cli(clip, tmp_path / "both", data, "--length", NEW, "--image-size", BIGGER)
    model = transformers.CLIPModel.from_pretrained(tmp_path / "both")
    assert (model.config.text_config.max_position_embeddings, model.config.vision_config.image_size) == (NEW, BIGGER)
    preprocessor = json.loads((tmp_path / "both" / "preprocessor_config.json").read_text())
    assert preprocessor["crop_size"] == {"height": BIGGER, "width": BIGGER} and preprocessor["size"]["shortest_edge"] == BIGGER
    processor = transformers.AutoProcessor.from_pretrained(tmp_path / "both")
    with torch.no_grad():
        out = model(**processor(text=["top left: a one."], images=[np.zeros((30, 30, 3), np.uint8)], return_tensors="pt"))
    assert out.logits_per_image.shape == (1, 1)


def test_lora(clip, data, tmp_path):
    out = finetune_cli(clip, tmp_path / "lora", data, "--length", NEW, "--train", "lora")
    assert "lora" in out
    before, after = load_file(clip / "model.safetensors"), load_file(tmp_path / "lora" / "model.safetensors")
    assert after[TEXT].shape[0] == NEW and torch.equal(after[TEXT][:KEPT], before[TEXT][:KEPT])
    assert not torch.equal(after[TEXT][KEPT:OLD], before[TEXT][KEPT:])
    model, info = transformers.CLIPModel.from_pretrained(tmp_path / "lora", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


# ----------------------------------------------------------------------------- kps, frozen, and the verdict by hand


def test_kps_rows_stay_exact_at_load_and_after_training(clip, data, tmp_path):
    source = load_file(clip / "model.safetensors")[TEXT]
    report = posextend.finetune(clip, tmp_path / "out", [data["train"]], eval_data=[str(data["held"])], length=NEW,
                                steps=4, lr=1e-2)
    trained = load_file(tmp_path / "out" / "model.safetensors")[TEXT]
    assert report.strategy == "kps" and torch.equal(trained[:KEPT], source[:KEPT])
    resized = tmp_path / "kps"
    posextend.resize_checkpoint(clip, resized, NEW, "kps")
    untrained = load_file(resized / "model.safetensors")[TEXT]
    assert torch.equal(untrained[:KEPT], source[:KEPT])  # at load: the first rows are the source's
    assert not torch.equal(trained[KEPT:], untrained[KEPT:])  # the rest trained
    other = posextend.finetune(clip, tmp_path / "interp", [data["train"]], eval_data=[str(data["held"])], length=NEW,
                               steps=2, strategy="interpolate", lr=1e-2)
    assert not any("kept frozen" in n for n in other.notes)


def _features(model, processor, texts, images, length):
    tok = processor.tokenizer
    ids = tok(texts, truncation=True, max_length=length, padding=True, return_tensors="pt")
    pixels = processor.image_processor(images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        t = model.get_text_features(**ids).pooler_output
        i = model.get_image_features(pixel_values=pixels).pooler_output
    return torch.nn.functional.normalize(t, dim=-1), torch.nn.functional.normalize(i, dim=-1)


def _r1(text, image):
    sim = text @ image.T
    t2i = (sim.argmax(1) == torch.arange(len(text))).float().mean()
    i2t = (sim.argmax(0) == torch.arange(len(text))).float().mean()
    return float(t2i), float(i2t)


def test_baseline_and_verdict_recomputed_by_hand(clip, data, tmp_path):
    report = posextend.finetune(clip, tmp_path / "out", [data["train"]], eval_data=[str(data["held"])], length=NEW,
                                steps=3)
    rows = [json.loads(line) for line in (data["held"] / "metadata.jsonl").read_text().splitlines()]
    import PIL.Image

    images = [PIL.Image.open(data["held"] / r["file_name"]).convert("RGB") for r in rows]
    processor = transformers.AutoProcessor.from_pretrained(clip)
    long = [i for i, r in enumerate(rows) if len(processor.tokenizer(r["text"])["input_ids"]) > OLD]
    source = transformers.CLIPModel.from_pretrained(clip).eval()
    text, image = _features(source, processor, [rows[i]["text"] for i in long], [images[i] for i in long], OLD)
    cut = _r1(text, image)
    # chunk-and-average: whole sentences, at most the old length with <s> and </s>: three quarters (18 + 2 tokens), one
    chunks = [[". ".join(r["text"].split(". ")[:3]) + ".", r["text"].split(". ")[3]] for r in (rows[i] for i in long)]
    flat, _ = _features(source, processor, [c for pair in chunks for c in pair], [images[long[0]]], OLD)
    averaged = torch.nn.functional.normalize(flat.view(len(long), 2, -1).mean(1), dim=-1)
    chunked = _r1(averaged, image)
    best = max((cut, chunked), key=lambda r: sum(r))
    verdict = report.verdict
    assert verdict.baseline.far == pytest.approx(sum(best) / 2, abs=1e-6)
    assert verdict.baseline.parts == pytest.approx({"text→image": best[0], "image→text": best[1]}, abs=1e-6)
    assert ("chunks" in verdict.baseline_name) == (best == chunked and best != cut)
    # the original range: each caption's first sentence, among the images whose first sentences differ (one each)
    firsts = {}
    for i, r in enumerate(rows):
        firsts.setdefault(first_sentence(r["text"]), i)
    assert 1 < len(firsts) < len(rows)  # the held-out pairs share first sentences
    kept = sorted(firsts.values())
    text, image = _features(source, processor, [first_sentence(rows[i]["text"]) for i in kept],
                            [images[i] for i in kept], OLD)
    assert verdict.baseline.original == pytest.approx(sum(_r1(text, image)) / 2, abs=1e-6)
    trained = transformers.CLIPModel.from_pretrained(tmp_path / "out").eval()
    text, image = _features(trained, processor, [rows[i]["text"] for i in long], [images[i] for i in long], NEW)
    assert verdict.reading.far == pytest.approx(sum(_r1(text, image)) / 2, abs=1e-6)
    assert verdict.worth_it == (verdict.far_wins and verdict.context_loses_to is None and verdict.original_holds)


class ShortReader(torch.nn.Module):
    """A dual encoder that reads the top-left quarter alone, perfectly: a caption's digit there (its 6th token: "<s> top
    left : a seven") and an image's (from that quarter's red, 25 per digit), one-hot; digits in ``lost`` it reads as
    zero (a model that lost part of its short-caption skill)."""

    def __init__(self, processor, lost=()):
        super().__init__()
        self.config = transformers.PretrainedConfig(model_type="clip")
        self.ids, self.lost = processor.tokenizer.convert_tokens_to_ids(DIGITS), set(lost)
        self.mean, self.std = processor.image_processor.image_mean[0], processor.image_processor.image_std[0]

    def get_text_features(self, input_ids, attention_mask=None):
        digits = [self.ids.index(int(i)) for i in input_ids[:, 5]]
        return torch.nn.functional.one_hot(torch.tensor([0 if d in self.lost else d for d in digits]), 10).float()

    def get_image_features(self, pixel_values):
        red = (pixel_values[:, 0, 0, 0] * self.std + self.mean) * 255 / 25
        return torch.nn.functional.one_hot(red.round().long(), 10).float()


def test_the_original_range_reads_distinct_first_sentences_and_sees_a_short_caption_loss(clip, data):
    """Held-out pairs that share first sentences: the original range reads one image for each distinct first sentence
    (more than one candidate), where a perfect short-caption reader reads 1.0 and one that lost half its digits less."""
    from types import SimpleNamespace

    from posextend.data.images import read_images
    from posextend.training.objectives.image_text import Held, ImageText
    from posextend.training.sizes import Axis, Sizes

    objective, processor = ImageText(), transformers.AutoProcessor.from_pretrained(clip)
    held = objective.samples(processor, read_images([data["held"]], need="text"), NEW)
    run = SimpleNamespace(eval_samples=held, sizes=Sizes(Axis(OLD, NEW)), processor=processor, state=Held(),
                          accelerator=SimpleNamespace(device=torch.device("cpu")))
    texts = [held[i]["text"] for i in range(len(held))]
    distinct = {first_sentence(t) for t in texts}
    assert 1 < len(distinct) < len(held)  # shared: images with one first sentence cannot be told apart by it
    perfect = objective.read(run, ShortReader(processor), None, "whole")
    lost = objective.read(run, ShortReader(processor, lost=range(5, 10)), None, "whole")
    assert perfect.original == 1.0 and lost.original < 0.8  # half its digits lost: about half its R@1


# ----------------------------------------------------------------------------- bad data: one line, nothing written


def _bad(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    if name == "no-captions":
        pairs(tmp_path / "src", 8)
        for f in (tmp_path / "src").glob("*.png"):
            f.rename(folder / f.name)
        (folder / "metadata.jsonl").write_text("".join(json.dumps({"file_name": f"{i}.png", "label": "x"}) + "\n"
                                                       for i in range(8)))
    elif name == "not-images":
        for i in range(6):
            (folder / f"{i}.png").write_text("not an image")
        (folder / "metadata.jsonl").write_text("".join(json.dumps({"file_name": f"{i}.png", "text": "top left: a one."})
                                                       + "\n" for i in range(6)))
    return folder


@pytest.mark.parametrize("name, says", [("no-captions", "has no captions"), ("not-images", "cannot be used"),
                                        ("empty", "holds no images")])
def test_bad_image_data_gives_one_line_and_writes_nothing(clip, tmp_path, name, says):
    bad = _bad(tmp_path, name)
    r = runner.invoke(app, ["finetune", str(clip), str(tmp_path / "out"), "--data", str(bad), "--length", NEW])
    assert r.exit_code == 1 and says in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1, r.output
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.state").exists()


# ----------------------------------------------------------------------------- every dual encoder it trains

VISION = dict(image_size=IMAGE, patch_size=4, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2)
TOWER = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2)
NO_GRID = {"siglip2": "NaFlex: its grid follows each image", "align": "EfficientNet: no position grid"}
SHORT = {"owlvit": 16, "owlv2": 16}  # their text tables hold 16 positions: kps (the default) keeps 4


def dual_encoder(model_type: str, length: int) -> transformers.PretrainedConfig:
    """A tiny config of ``model_type`` whose text tower reads the tests' tokenizer and whose features match."""
    vocab = len(tokenizer(length))
    text = {**TOWER, **text_ids(vocab), "max_position_embeddings": length}
    auto = transformers.AutoConfig.for_model
    if model_type in ("siglip", "siglip2"):
        vision = {**VISION, "num_patches": 16} if model_type == "siglip2" else VISION
        return auto(model_type, text_config={**text, "projection_size": 16}, vision_config=vision)
    if model_type == "vision-text-dual-encoder":
        return transformers.VisionTextDualEncoderConfig.from_vision_text_configs(
            transformers.ViTConfig(**VISION), transformers.BertConfig(**text), projection_dim=8)
    vision = {
        "align": dict(image_size=64, hidden_dim=32, width_coefficient=0.1, depth_coefficient=0.1),
        "groupvit": dict(hidden_size=16, intermediate_size=24, depths=[1, 1], num_group_tokens=[4, 0], num_output_groups=[4, 4],
                         num_attention_heads=2, image_size=IMAGE, patch_size=4),
    }.get(model_type, VISION)
    text.update({"altclip": {"max_position_embeddings": length + 2, "project_dim": 8},  # RoBERTa's reserved rows
                 "blip": {"encoder_hidden_size": 16, "sep_token_id": vocab - 1}}.get(model_type, {}))
    extra = {"groupvit": {"projection_intermediate_dim": 16}, "align": {"projection_dim": 32}}.get(model_type, {})
    return auto(model_type, text_config=text, vision_config=vision, **{"projection_dim": 8, **extra})


def image_processor(model_type: str):
    if model_type == "siglip":
        return transformers.SiglipImageProcessor(size={"height": IMAGE, "width": IMAGE})
    if model_type == "siglip2":
        return transformers.Siglip2ImageProcessor(max_num_patches=16, patch_size=4)
    side = 64 if model_type == "align" else IMAGE
    return transformers.CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})


def test_every_census_dual_encoder_is_known_here():
    """The families the objective trains are the census's verified dual encoders with image and text features, less
    those named here with why."""
    census = json.loads((Path(posextend.__file__).parent / "families" / "census.json").read_text())
    verified = {e["model_type"] for e in census if e["outcome"] == "verified"}
    left = {"xclip": "video features, no image features", "clap": "audio", "flava": "token features, no pooled ones",
            "blip-2": "no pooled text features", "bridgetower": "no text or image features"}
    assert set(FAMILIES) <= verified and not set(FAMILIES) & set(left) and set(left) <= verified


@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_dual_encoder_through_the_command_line(model_type, data, tmp_path):
    old = SHORT.get(model_type, OLD)
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(dual_encoder(model_type, old))
    src = save(model, tmp_path / "src", old, image_processor(model_type))
    sizes = [] if model_type in NO_GRID else ["--image-size", BIGGER]
    finetune_cli(src, tmp_path / "out", data, "--length", old + 16, *sizes, "--steps", 1)
    out, shapes = tmp_path / "out", {k: v.shape for k, v in load_file(src / "model.safetensors").items()}
    back, info = transformers.AutoModel.from_pretrained(out, output_loading_info=True)
    assert type(back) is type(model) and not info["missing_keys"] and not info["unexpected_keys"]
    config = back.config.to_dict()
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == old + 16
    processor = transformers.AutoProcessor.from_pretrained(out)
    ids = processor.tokenizer(["top left: a one. " * 9], truncation=True, return_tensors="pt")
    assert ids["input_ids"].shape[1] == old + 16
    pixels = {k: v for k, v in processor.image_processor([np.zeros((40, 40, 3), np.uint8)], return_tensors="pt").items()}
    if sizes:
        image_key = "image_size"
        assert (config.get("vision_config") or {}).get(image_key) == BIGGER
        assert pixels["pixel_values"].shape[-1] == BIGGER
    with torch.no_grad():
        text = back.get_text_features(**ids)
        image = back.get_image_features(**pixels)
    assert getattr(text, "pooler_output", text).shape[-1] == getattr(image, "pooler_output", image).shape[-1]
    grown = [k for k, v in load_file(out / "model.safetensors").items() if k in shapes and v.shape != shapes[k]]
    assert grown, "no table grew"


def test_a_processor_saved_by_transformers_5_follows_the_image_size(data, tmp_path):
    src = tiny_clip(tmp_path / "src")
    (src / "preprocessor_config.json").unlink()
    transformers.CLIPProcessor(image_processor=transformers.CLIPImageProcessor(
        size={"shortest_edge": IMAGE}, crop_size={"height": IMAGE, "width": IMAGE}), tokenizer=tokenizer(OLD)).save_pretrained(src)
    finetune_cli(src, tmp_path / "out", data, "--length", NEW, "--image-size", BIGGER, "--steps", 1)
    processor = transformers.AutoProcessor.from_pretrained(tmp_path / "out")
    assert processor.image_processor([np.zeros((30, 30, 3), np.uint8)], return_tensors="pt")["pixel_values"].shape[-1] == BIGGER


def test_the_anchor_keeps_the_sources_short_caption_matching(clip, data, tmp_path):
    """``--anchor``: the KL divergence from the source's first-sentence-to-image matching; with it the trained model
    matches first sentences to the held-out images as the source does, closer than the same run without it."""
    import PIL.Image

    rows = [json.loads(line) for line in (data["held"] / "metadata.jsonl").read_text().splitlines()]
    shorts = [first_sentence(r["text"]) for r in rows]
    images = [PIL.Image.open(data["held"] / r["file_name"]).convert("RGB") for r in rows]
    processor = transformers.CLIPProcessor.from_pretrained(clip)
    source = transformers.CLIPModel.from_pretrained(clip).eval()

    def matching(model):  # the first sentences' softmax over the images, at the source's scale
        text, image = _features(model, processor, shorts, images, OLD)
        return torch.softmax(source.logit_scale.exp() * text @ image.T, dim=1)

    target, apart = matching(source), {}
    for anchor in (0.0, 20.0):
        out = tmp_path / f"anchor-{anchor:g}"
        posextend.finetune(clip, out, [str(data["train"])], eval_data=[str(data["held"])], length=NEW, steps=8,
                           lr=3e-4, anchor=anchor, seed=0)
        found = matching(transformers.CLIPModel.from_pretrained(out).eval())
        apart[anchor] = float((target * (target.log() - found.log())).sum(1).mean())  # KL(source || model)
    assert apart[0.0] > 0.01  # the run without it moved the matching
    assert apart[20.0] < 0.5 * apart[0.0], apart  # measured: 0.02 against 0.25
