"""An audio-caption objective is one plug-in file on the documented API (issue 62): a reader of .wav clips with a
metadata.jsonl, and an ``audio-text`` objective that extends a tiny CLAP's text table (16 → 40 positions) and trains it
with the dual-encoder pair loss, judged by R@1 by caption length against the source reading long captions cut or in
chunks. It is installed by entry point as a third-party plug-in is; it imports only what docs/guides/plugins.md lists."""

from __future__ import annotations

import ast
import inspect
import json
import random
import re
import sys
import wave
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

import posextend
from posextend.training.objectives import base as objectives
from test_image_text import tokenizer

PLUGIN = '''
"""Audio-caption pairs: a CLAP's text tower learns captions longer than its table (a plug-in on the documented API)."""
import json
import math
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import transformers

from posextend.data.heldout import split_items
from posextend.errors import DataError
from posextend.scoring.by_position import evaluating
from posextend.scoring.verdict import Reading
from posextend.training.objectives import Objective, draw_mates, register_objective
from posextend.training.objectives.dual_encoder import (chunk_ids, cut_ids, directions, in_slices, inner_model,
                                                       length_pools, length_report, padded, pair_loss, pooled_output,
                                                       retrieval, text_features)


def read_clips(paths):
    """Each folder's clips: a metadata.jsonl of {"file_name", "text"} beside 16-bit mono .wav files, as items
    {"audio": float32 samples, "sampling_rate", "text"} (the items protocol of posextend.data: a list)."""
    items = []
    for folder in map(Path, paths):
        if not (folder / "metadata.jsonl").is_file():
            raise DataError(f"{folder} has no metadata.jsonl: write one line {{file_name, text}} for each .wav clip.")
        for line in (folder / "metadata.jsonl").read_text().splitlines():
            row = json.loads(line)
            with wave.open(str(folder / row["file_name"])) as clip:
                if clip.getsampwidth() != 2 or clip.getnchannels() != 1:
                    raise DataError(f"{folder / row['file_name']} is not 16-bit mono PCM: convert it.")
                rate, frames = clip.getframerate(), clip.readframes(clip.getnframes())
            audio = np.frombuffer(frames, dtype="<i2").astype(np.float32) / 32768
            items.append({"audio": audio, "sampling_rate": rate, "text": row["text"]})
    if len(items) < 2:
        raise DataError(f"Audio-text training needs at least 2 audio-caption pairs, got {len(items)}.")
    return items


@dataclass
class Held:
    inputs: dict | None = None  # the held-out clips as the feature extractor makes them, once


@register_objective("audio-text", description="CLAP: audio-caption pairs, captions longer than the text table "
                                              "(a plug-in on the documented API).")
class AudioText(Objective):
    """CLAP's text tower extended: each sample is a pair and ``mates`` more, contrasted by the dual-encoder pair loss."""

    model_class = "AutoModel"
    head = "audio-text"
    metric = "R@1"
    State = Held
    stream = False  # samples are pairs, not windows of one stream of tokens
    unused_parameters = True  # the towers' poolers the features skip
    eval_sequences = 8
    lr = {"new-rows": 1e-3, "positions": 1e-3, "all": 2e-4, "lora": 1e-3}
    mates = 3

    def documents(self, paths):
        return read_clips(paths)

    def load_model(self, directory, *, init_head):
        loaded = super().load_model(directory, init_head=init_head)
        loaded.processor = transformers.AutoProcessor.from_pretrained(directory)  # its tokenizer and audio features
        return loaded

    def size_processor(self, processor, sizes):
        processor.tokenizer.model_max_length = sizes.length.new

    def split(self, documents, *, processor, length, config):
        return split_items(documents, least=config.eval_sequences, seed=config.seed)

    def samples(self, processor, documents, length):
        ids = cut_ids(processor.tokenizer, [d["text"] for d in documents], length)
        return [{**d, "tokens": len(row)} for d, row in zip(documents, ids)]

    def count(self, batch):
        group = 1 + self.mates
        return group * len(batch), group * sum(item["tokens"] for item in batch)

    def loss(self, run, positions, batch):
        items = list(batch) + draw_mates(run, positions, self.mates)[0]
        tokenizer, device = run.processor.tokenizer, run.accelerator.device
        rows = cut_ids(tokenizer, [i["text"] for i in items], run.sizes.length.new)
        ids, mask = padded(tokenizer, rows, max(map(len, rows)))
        audio = {k: v.to(device) for k, v in self.audio_inputs(run, items).items()}
        out = run.model(input_ids=ids.to(device), attention_mask=mask.to(device), **audio)
        clips, texts = F.normalize(out.audio_embeds, dim=-1), F.normalize(out.text_embeds, dim=-1)
        scale = inner_model(run.unwrapped).logit_scale_t.exp()  # CLAP keeps its text-side scale under its own name
        return pair_loss(run.unwrapped, clips, texts, False, scale=scale), len(items)

    @torch.no_grad()
    def evaluate(self, run):
        """R@1 (text→audio, audio→text) of every held-out pair by caption length, each caption read whole."""
        pairs, length = run.eval_samples, run.sizes.length.new
        with evaluating(run.model):
            clips = self.clip_features(run, run.model)
            rows = cut_ids(run.processor.tokenizer, [p["text"] for p in pairs], length)
            texts = text_features(run, run.model, rows, length)
        return length_report(texts, clips, [p["tokens"] for p in pairs], objective=self.name, metric=self.metric,
                             length=length, old=run.sizes.length.old, buckets=run.config.buckets)

    def baseline(self, run, unextended):
        """The source reading the long captions cut at its length or in chunks of it averaged, the better."""
        readings = [self.read(run, unextended.to(run.accelerator.device), mode) for mode in ("cut", "chunks")]
        return None if readings[0] is None else max(readings, key=lambda r: r.far)

    def baseline_name(self, run):
        return f"the source reading captions cut at {run.sizes.length.old} tokens or in chunks (the better)"

    def control_name(self, run):
        return f"the same model reading captions cut at {run.sizes.length.old} tokens or in chunks (the better)"

    def reading(self, run):
        return self.read(run, run.model, "whole")

    def notes(self, run):
        long = length_pools([p["tokens"] for p in run.eval_samples], run.sizes.length.old, run.sizes.length.new)[1]
        return [f"audio-text: {len(long)} of {len(run.eval_samples)} held-out captions longer than {run.sizes.length.old} tokens"]

    def audio_inputs(self, run, items):
        made = run.processor.feature_extractor([i["audio"] for i in items], sampling_rate=items[0]["sampling_rate"],
                                               return_tensors="pt")
        return {k: v for k, v in made.items() if isinstance(v, torch.Tensor)}

    def clip_features(self, run, model):
        """The held-out clips' normalised features by ``model`` (their inputs made once a run)."""
        if run.state.inputs is None:
            run.state.inputs = self.audio_inputs(run, list(run.eval_samples))
        inner = inner_model(model)
        features = in_slices(run, lambda **x: pooled_output(inner.get_audio_features(**x)), run.state.inputs)
        return F.normalize(features, dim=-1)

    @torch.no_grad()
    def read(self, run, model, mode):
        """R@1 of ``model``: ``far`` on the captions longer than the old length read ``whole``, ``cut`` at it or in
        ``chunks`` of it averaged; ``original`` on the short captions among theirs. None without long captions."""
        pairs, old, length, tokenizer = run.eval_samples, run.sizes.length.old, run.sizes.length.new, run.processor.tokenizer
        short, long = length_pools([p["tokens"] for p in pairs], old, length)
        if not long:
            return None
        texts = [p["text"] for p in pairs]
        with evaluating(model):
            clips = self.clip_features(run, model)
            rows, owner = (chunk_ids(tokenizer, [texts[i] for i in long], old) if mode == "chunks" else
                           (cut_ids(tokenizer, [texts[i] for i in long], length if mode == "whole" else old), None))
            far = text_features(run, model, rows, length if mode == "whole" else old, owner=owner)
            t2a, a2t = directions(far, clips[long])
            near = text_features(run, model, cut_ids(tokenizer, [texts[i] for i in short], old), old) if short else None
            original = retrieval(near, clips[short])[0].mean() if len(short) > 1 else math.nan
        return Reading(far=float((t2a.mean() + a2t.mean()) / 2), original=float(original), metric="R@1", higher=True,
                       parts={"text→audio": float(t2a.mean()), "audio→text": float(a2t.mean())})
'''

OLD, NEW, RATE = 16, 40, 4000  # text positions before and after; the clips' sampling rate
PITCHES = {"low": 220, "middle": 550, "high": 1100, "silent": 0}
PARTS = ["first", "second", "third", "fourth"]
WORDS = sorted(set(PITCHES) | set(PARTS) | {"a", "tone", ":", "."})


@pytest.fixture(scope="module")
def clap(tmp_path_factory) -> Path:
    """A tiny CLAP twin from a config (text: RoBERTa-like, 16 usable positions + 2 reserved), with its processor."""
    path = tmp_path_factory.mktemp("clap")
    words = tokenizer(OLD, WORDS)  # test_image_text's word-level tokenizer, of these captions' words
    text = dict(vocab_size=len(words), hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                max_position_embeddings=OLD + 2, pad_token_id=1, bos_token_id=0, eos_token_id=len(words) - 1)
    audio = dict(hidden_size=16, patch_embeds_hidden_size=8, depths=[1, 1], num_attention_heads=[1, 1], window_size=2,
                 spec_size=32, num_mel_bins=16, patch_size=4, patch_stride=(4, 4), enable_fusion=False, mlp_ratio=1.0)
    torch.manual_seed(0)
    transformers.ClapModel(transformers.ClapConfig(text_config=text, audio_config=audio, projection_dim=8)).save_pretrained(path)
    features = transformers.ClapFeatureExtractor(feature_size=16, sampling_rate=RATE, hop_length=64, max_length_s=1,
                                                 fft_window_size=256, truncation="rand_trunc",
                                                 frequency_max=RATE // 2)
    transformers.ClapProcessor(feature_extractor=features, tokenizer=words).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> Path:
    """32 one-second clips of four tones (one per quarter) and captions naming them ("first : a low tone . …", 26
    tokens; every fourth names two quarters: 14 tokens, within the old length), written with the stdlib wave."""
    path = tmp_path_factory.mktemp("clips")
    rng, rows = random.Random(0), []
    for i in range(32):
        pitches = [rng.choice(list(PITCHES)) for _ in PARTS]
        t = np.arange(RATE // 4) / RATE
        audio = np.concatenate([0.5 * np.sin(2 * np.pi * PITCHES[p] * t) for p in pitches])
        with wave.open(str(path / f"{i}.wav"), "wb") as f:
            f.setnchannels(1), f.setsampwidth(2), f.setframerate(RATE)
            f.writeframes((audio * 32767).astype("<i2").tobytes())
        named = PARTS[:2] if i % 4 == 0 else PARTS
        rows.append({"file_name": f"{i}.wav", "text": " ".join(f"{w} : a {p} tone ." for w, p in zip(named, pitches))})
    (path / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    from test_registry import _install_plugin

    objectives.available_objectives()  # the installed plug-ins loaded first: the registry after the test has them
    monkeypatch.setattr(objectives._REGISTRY, "items", dict(objectives._REGISTRY.items))
    monkeypatch.setattr(objectives._REGISTRY, "plugins_loaded", False)
    site = tmp_path / "site"
    site.mkdir()
    _install_plugin(site, monkeypatch, "posextend.objectives", PLUGIN)
    assert "audio-text" in objectives.available_objectives()
    return sys.modules["my_plugin"]


def test_posextend_resizes_the_clap_text_table(clap, tmp_path):
    info = posextend.inspect_checkpoint(clap)
    assert [(g.usable, g.reserved) for g in info.groups] == [(OLD, 2)], info
    posextend.resize_checkpoint(clap, tmp_path / "out", NEW, strategy="tile")
    model = transformers.ClapModel.from_pretrained(tmp_path / "out")
    assert model.text_model.embeddings.position_embeddings.weight.shape[0] == NEW + 2


def test_an_audio_caption_objective_trains_through_finetune(plugin, clap, clips, tmp_path):
    dst = tmp_path / "out"
    report = posextend.finetune(clap, dst, [clips], objective="audio-text", length=NEW, steps=2, batch_size=2, seed=0)
    assert report.before.metric == report.after.metric == "R@1" and report.after.length == NEW
    assert 0 <= report.after.accuracy <= 1 and len(report.after.buckets) >= 2  # by caption length
    assert OLD + 1 in {b.end for b in report.after.buckets}  # split where the old length ends
    assert 0 <= report.verdict.baseline.far <= 1 and 0 <= report.verdict.reading.far <= 1
    assert list(report.verdict.controls) == [f"the same model reading captions cut at {OLD} tokens or in chunks (the better)"]
    assert report.verdict is not None  # its baseline, reading and control were read
    assert any("held-out captions longer than 16 tokens" in n for n in report.notes)
    model, info = transformers.ClapModel.from_pretrained(dst, output_loading_info=True)
    assert not any(info.values()), info
    table = model.text_model.embeddings.position_embeddings.weight
    assert table.shape[0] == NEW + 2  # 40 usable rows and RoBERTa's 2 reserved ones
    assert json.loads((dst / "config.json").read_text())["text_config"]["max_position_embeddings"] == NEW + 2
    words = transformers.AutoTokenizer.from_pretrained(dst)
    ids = words(" ".join(["first : a low tone ."] * 7), return_tensors="pt")["input_ids"][:, :NEW]
    assert ids.shape[1] == NEW
    with torch.no_grad():
        features = model.eval().get_text_features(input_ids=ids)
    features = features if isinstance(features, torch.Tensor) else features.pooler_output
    assert features.shape == (1, 8) and torch.isfinite(features).all()


def test_the_plugin_is_small_and_imports_only_the_documented_api(plugin):
    lines = sum(len(inspect.getsource(x).splitlines()) for x in (plugin.AudioText, plugin.read_clips, plugin.Held))
    assert lines <= 220, lines
    guide = (Path(__file__).resolve().parent.parent / "docs" / "guides" / "plugins.md").read_text()
    listed = set(re.findall(r"`([\w.]+)`", guide))
    for node in ast.walk(ast.parse(PLUGIN)):
        if isinstance(node, ast.ImportFrom) and node.module.startswith("posextend"):
            assert node.module in listed, f"{node.module} is not named in docs/guides/plugins.md"
            for alias in node.names:
                assert not alias.name.startswith("_") and alias.name in listed, (node.module, alias.name)
        elif isinstance(node, ast.Import):
            assert not any(a.name.startswith("posextend") for a in node.names)
