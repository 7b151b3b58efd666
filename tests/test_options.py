"""A fine-tune's options: one frozen FinetuneConfig, resolved once against the objective, checked in one place."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, fields
from pathlib import Path

import pytest

import posextend
from posextend.training.objectives.base import get_objective
from posextend.training.options import FinetuneConfig


def test_unknown_options_are_refused_with_the_valid_ones(gpt, corpus, tmp_path):
    with pytest.raises(posextend.TrainingError, match=r"Unknown fine-tune option\(s\) step, trian; the options are: .*steps.*train"):
        posextend.finetune(gpt, tmp_path / "out", [corpus], step=3, trian="all")
    assert not (tmp_path / "out").exists()


def test_resolved_fills_the_objectives_defaults_once():
    causal, contrastive = get_objective("causal"), get_objective("contrastive")
    c = FinetuneConfig().resolved(causal)
    assert (c.objective, c.steps, c.schedule, c.strategy, c.anchor, c.lr) == ("causal", 200, "cosine", "interpolate", 1.0, None)
    assert c.with_lr(causal, 768).lr == pytest.approx(1e-3 * 192 / 768) and c.with_lr(causal, 64).lr == 1e-3
    e = FinetuneConfig(train="positions", steps=7).resolved(contrastive)
    assert (e.steps, e.schedule, e.strategy, e.anchor) == (7, "constant", "tile", 2.0)
    assert FinetuneConfig(lr=5e-4).resolved(causal).with_lr(causal, 768).lr == 5e-4  # a given lr stays
    with pytest.raises(FrozenInstanceError):
        c.steps = 3  # type: ignore[misc]


@pytest.mark.parametrize("options, message", [
    ({"train": "everything"}, "train mode must be one of new-rows, positions, all"),
    ({"schedule": "linear"}, "schedule must be constant or cosine"),
    ({"mixed_precision": "fp8"}, "Mixed precision must be one of no, fp16, bf16"),
    ({"steps": 0}, "steps must be at least 1"),
    ({"grad_accum": 0}, "grad_accum must be at least 1"),
    ({"save_every": -1}, "save_every must be 0"),
])
def test_bad_values_are_refused_in_one_place(options, message):
    with pytest.raises(posextend.TrainingError, match=message):
        FinetuneConfig(**options).resolved(get_objective("causal"))


def test_the_fingerprint_follows_what_is_computed_not_how_it_runs():
    base = FinetuneConfig(length=64).resolved(get_objective("causal")).with_lr(get_objective("causal"), 64)
    key = dict(src=Path("/m"), data=["/d"], anchor_source=None)
    same = base.fingerprint(processes=1, **key)
    # the global batch, not the per-process one; evaluation and saving settings may change on resume
    assert FinetuneConfig(**{f.name: getattr(base, f.name) for f in fields(base)} | {"batch_size": 2}).fingerprint(
        processes=2, **key) == same
    for changed in ({"eval_every": 5, "save_every": 5, "buckets": 4, "resume": True, "overwrite": True},):
        assert FinetuneConfig(**{f.name: getattr(base, f.name) for f in fields(base)} | changed).fingerprint(
            processes=1, **key) == same
    for changed in ({"lr": 1e-4}, {"seed": 1}, {"length": 96}, {"strategy": "tile"}, {"anchor": 0.0}):
        assert FinetuneConfig(**{f.name: getattr(base, f.name) for f in fields(base)} | changed).fingerprint(
            processes=1, **key) != same, changed
    assert base.fingerprint(processes=1, **(key | {"data": ["/other"]})) != same
