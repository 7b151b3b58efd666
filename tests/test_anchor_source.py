"""The fine-tune's anchor holds to the ORIGINAL model of a checkpoint resized earlier (resize first,
fine-tune later): found from its provenance or given, else the checkpoint with one logged line."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from typer.testing import CliRunner

import posextend
from posextend.training import loop as training
from posextend.cli import app
from posextend.files.checkpoint import Checkpoint
from posextend.training.loop import finetune
from tiny import loss_nan_at

QUICK = dict(steps=1, batch_size=2, train="all", eval_sequences=2, buckets=2, seed=0)


@pytest.fixture
def runs(monkeypatch) -> list:
    """Every fine-tune's run as it enters the training loop (its anchor's reference in ``cache``)."""
    seen = []
    loop = training._loop

    def recording(run, *args, **kwargs):
        seen.append(run)
        return loop(run, *args, **kwargs)

    monkeypatch.setattr(training, "_loop", recording)
    return seen


@pytest.fixture
def ids(gpt, corpus) -> torch.Tensor:
    """32 tokens of real text: within the original's 32 positions."""
    tok = transformers.AutoTokenizer.from_pretrained(gpt)
    return tok(corpus.read_text()[:3000], return_tensors="pt")["input_ids"][:, :32]


def _logits(model_or_path, ids: torch.Tensor) -> torch.Tensor:
    model = model_or_path
    if isinstance(model_or_path, Path):
        model = transformers.AutoModelForCausalLM.from_pretrained(model_or_path).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def _resized(gpt: Path, tmp_path: Path, strategy: str = "interpolate") -> tuple[Path, Path]:
    """A copy of ``gpt`` (the original, which a test may remove) and its resize to 64 positions."""
    original = tmp_path / "original"
    shutil.copytree(gpt, original)
    resized = tmp_path / f"resized-{strategy}"
    posextend.resize_checkpoint(original, resized, 64, strategy, seed=0)
    return original, resized


def _differs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def test_the_anchor_holds_to_the_recorded_original_not_the_resized_file(gpt, corpus, tmp_path, runs, ids, caplog):
    original, resized = _resized(gpt, tmp_path)
    with caplog.at_level(logging.INFO, logger="posextend.training.setup"):
        report = finetune(resized, tmp_path / "out", [corpus], **QUICK)
    (run,) = runs
    reference = run.reference
    assert (run.sizes.length.old, run.sizes.length.new, report.old_length, report.new_length) == (32, 64, 32, 64)
    assert report.anchor_source == str(original.resolve()) and report.anchor_note is None
    assert not [r for r in caplog.records if "Anchor" in r.getMessage()]
    assert reference.transformer.wpe.weight.shape == (32, 16)  # the original at its own length
    assert not any(p.requires_grad for p in reference.parameters()) and not reference.training
    # the anchor's reference reads short inputs exactly as the original does; the resized file does not
    assert torch.equal(_logits(reference, ids), _logits(original, ids))
    assert _differs(_logits(resized, ids), _logits(original, ids)) > 1e-3
    # the fine-tuned output records the original, so a second fine-tune finds it too
    meta = json.loads(json.dumps(Checkpoint.of(tmp_path / "out").provenance))
    assert (meta["posextend.source"], meta["posextend.old_length"]) == (str(original.resolve()), "32")
    finetune(tmp_path / "out", tmp_path / "again", [corpus], **QUICK)
    assert torch.equal(_logits(runs[1].reference, ids), _logits(original, ids))


def test_an_explicit_source_is_the_reference_and_an_unfit_one_is_refused(gpt, bert, corpus, tmp_path, runs, ids):
    original, resized = _resized(gpt, tmp_path)
    shutil.rmtree(original)  # what the provenance records is gone; the caller knows where the original is
    report = finetune(resized, tmp_path / "out", [corpus], source=gpt, **QUICK)
    assert report.anchor_source == str(gpt.resolve()) and report.anchor_note is None
    assert torch.equal(_logits(runs[0].reference, ids), _logits(gpt, ids))
    assert _differs(_logits(resized, ids), _logits(gpt, ids)) > 1e-3
    with pytest.raises(posextend.TrainingError, match=r"The anchor's source .*bert.* holds a bert model, not gpt2: give"):
        finetune(resized, tmp_path / "b", [corpus], source=bert, **QUICK)
    with pytest.raises(posextend.TrainingError, match=r"is this checkpoint itself"):
        finetune(resized, tmp_path / "c", [corpus], source=resized, **QUICK)
    with pytest.raises(posextend.SourceError, match="does not exist"):
        finetune(resized, tmp_path / "d", [corpus], source=tmp_path / "nowhere", **QUICK)
    with pytest.raises(posextend.TrainingError, match="The masked objective has no anchor term to hold to a source"):
        finetune(bert, tmp_path / "e", [corpus], length=48, source=bert, **QUICK)
    assert not any((tmp_path / n).exists() for n in "bcde")


def _anchor_lines(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage().startswith("Anchor:")]


def test_a_missing_original_is_said_in_one_line_and_the_checkpoint_is_held_to(gpt, corpus, tmp_path, runs, ids, caplog):
    original, resized = _resized(gpt, tmp_path)
    shutil.rmtree(original)
    with caplog.at_level(logging.INFO, logger="posextend"):
        report = finetune(resized, tmp_path / "out", [corpus], **QUICK)
    (line,) = _anchor_lines(caplog)
    assert line.levelno == logging.WARNING and "\n" not in line.getMessage()
    assert line.getMessage() == report.anchor_note
    assert f"the original model {original.resolve()} that resized-interpolate was extended from is missing" in line.getMessage()
    assert "whose first 32 rows interpolate moved; give the original as the anchor's source" in line.getMessage()
    assert report.anchor_source is None
    # today's behaviour: the reference is the checkpoint as loaded (64 rows, interpolated), not the original
    reference = runs[0].reference
    assert reference.transformer.wpe.weight.shape == (64, 16)
    assert torch.equal(_logits(reference, ids), _logits(resized, ids))
    assert _differs(_logits(reference, ids), _logits(gpt, ids)) > 1e-3


def test_another_family_at_the_recorded_path_is_not_the_original(gpt, bert, corpus, tmp_path, caplog):
    original, resized = _resized(gpt, tmp_path)
    shutil.rmtree(original)
    shutil.copytree(bert, original)
    with caplog.at_level(logging.WARNING, logger="posextend"):
        report = finetune(resized, tmp_path / "out", [corpus], **QUICK)
    (line,) = _anchor_lines(caplog)
    assert "holds a bert model, not gpt2, so the anchor holds to resized-interpolate as given" in line.getMessage()
    assert report.anchor_source is None


def test_tile_without_its_original_is_exact_and_said_so_quietly(gpt, corpus, tmp_path, runs, ids, caplog):
    original, resized = _resized(gpt, tmp_path, "tile")
    shutil.rmtree(original)
    with caplog.at_level(logging.INFO, logger="posextend"):
        finetune(resized, tmp_path / "out", [corpus], **QUICK)
    (line,) = _anchor_lines(caplog)
    assert line.levelno == logging.INFO  # nothing is lost: not a warning
    assert line.getMessage().endswith(": exact, since tile kept the original's first 32 rows.")
    assert torch.equal(_logits(runs[0].reference, ids), _logits(gpt, ids))  # the fallback is the original


def test_no_provenance_with_an_old_length_is_said(gpt, corpus, tmp_path, caplog):
    _, resized = _resized(gpt, tmp_path)
    plain = tmp_path / "plain"  # the same weights saved by transformers: no provenance
    transformers.AutoModelForCausalLM.from_pretrained(resized).save_pretrained(plain)
    transformers.AutoTokenizer.from_pretrained(resized).save_pretrained(plain)
    with caplog.at_level(logging.WARNING, logger="posextend"):
        report = finetune(plain, tmp_path / "out", [corpus], old_length=32, **QUICK)
    (line,) = _anchor_lines(caplog)
    assert line.getMessage().startswith(f"Anchor: {plain} records no original model, so the anchor holds its first 32")
    assert report.anchor_note == line.getMessage()


def test_without_an_anchor_nothing_changes(gpt, corpus, tmp_path, runs, caplog):
    original, resized = _resized(gpt, tmp_path)
    shutil.rmtree(original)
    with caplog.at_level(logging.INFO, logger="posextend"):
        report = finetune(resized, tmp_path / "out", [corpus], anchor=0, source=tmp_path / "ignored", **QUICK)
    assert not _anchor_lines(caplog) and report.anchor_source is None and report.anchor_note is None
    assert runs[0].reference is None


def _fingerprint(state: Path) -> str:
    return json.loads((state / "posextend.json").read_text())["fingerprint"]


def test_the_resume_fingerprint_names_the_reference(gpt, corpus, tmp_path):
    original, resized = _resized(gpt, tmp_path)
    kwargs = dict(QUICK, steps=3)
    fingerprints = {}
    for name, source in (("recorded", None), ("given", gpt)):
        with pytest.raises(posextend.TrainingError, match="The loss became nan at step 1"), loss_nan_at(1):
            finetune(resized, tmp_path / name, [corpus], source=source, **kwargs)
        fingerprints[name] = _fingerprint(tmp_path / f"{name}.state")
    moved = original.rename(tmp_path / "moved")
    with pytest.raises(posextend.TrainingError, match="The loss became nan at step 1"), loss_nan_at(1):
        finetune(resized, tmp_path / "missing", [corpus], **kwargs)
    fingerprints["missing"] = _fingerprint(tmp_path / "missing.state")
    assert len(set(fingerprints.values())) == 3, fingerprints
    # the original moved away: resuming the run that held to it is refused, not continued against another reference
    with pytest.raises(posextend.TrainingError, match="Cannot resume"):
        finetune(resized, tmp_path / "recorded", [corpus], resume=True, **QUICK | {"steps": 3})
    moved.rename(original)
    report = finetune(resized, tmp_path / "recorded", [corpus], resume=True, **QUICK | {"steps": 3})
    assert report.anchor_source == str(original.resolve()) and (tmp_path / "recorded").is_dir()


def test_cli_source_option(gpt, corpus, tmp_path):
    original, resized = _resized(gpt, tmp_path)
    shutil.rmtree(original)
    result = CliRunner().invoke(app, ["finetune", str(resized), str(tmp_path / "out"), "--data", str(corpus),
                                      "--steps", "1", "--batch-size", "2", "--source", str(gpt)])
    assert result.exit_code == 0, result.output
    assert f"anchor: held to the original model {gpt.resolve()}" in " ".join(result.output.split())
