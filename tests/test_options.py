"""A fine-tune's options: one frozen FinetuneConfig, resolved once against the objective, checked in one place."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, fields, replace
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
    assert (c.objective, c.steps, c.schedule, c.strategy, c.anchor, c.lr) == ("causal", None, "cosine", None, 1.0, None)
    assert c.with_lr(causal, 768).lr == pytest.approx(1e-3 * 192 / 768) and c.with_lr(causal, 64).lr == 1e-3
    assert c.with_strategy(causal, {1}).strategy == "interpolate"  # once the tables that grow are known
    e = FinetuneConfig(train="positions", steps=7).resolved(contrastive)
    assert (e.steps, e.schedule, e.with_strategy(contrastive, {1}).strategy, e.anchor) == (7, "constant", "tile", 2.0)
    assert FinetuneConfig(lr=5e-4).resolved(causal).with_lr(causal, 768).lr == 5e-4  # a given lr stays
    with pytest.raises(FrozenInstanceError):
        c.steps = 3  # type: ignore[misc]


@pytest.mark.parametrize("options, message", [
    ({"train": "everything"}, "train mode must be one of new-rows, positions, all"),
    ({"schedule": "linear"}, "schedule must be constant or cosine"),
    ({"mixed_precision": "fp8"}, "Mixed precision must be one of no, fp16, bf16"),
    ({"steps": 0}, "steps must be at least 1"),
    ({"steps": 5, "budget": "5 steps"}, "not both"),
    ({"budget": "soon"}, "Cannot read the budget 'soon'"),
    ({"margin": 1.5}, "margin must be a fraction"),
    ({"grad_accum": 0}, "grad_accum must be at least 1"),
    ({"save_every": -1}, "save_every must be 0"),
])
def test_bad_values_are_refused_in_one_place(options, message):
    with pytest.raises(posextend.TrainingError, match=message):
        FinetuneConfig(**options).resolved(get_objective("causal"))


def test_a_named_strategy_is_kept_or_refused_the_default_gives_way():
    """The default gives way to the grid's own where it resizes none of the tables that grow; a strategy the user
    named is kept where it resizes one of them, and refused in one line (no flag named) where it resizes none."""
    image_text, vision = get_objective("image-text"), get_objective("vision")
    default = FinetuneConfig().resolved(image_text)
    assert [default.with_strategy(image_text, g).strategy for g in ({1}, {2}, {1, 2}, set())] == ["kps", None, "kps", "kps"]
    for named, grows in (("bicubic", {2}), ("nearest", {1, 2}), ("interpolate", {1}), ("kps", set())):
        assert FinetuneConfig(strategy=named).resolved(image_text).with_strategy(image_text, grows).strategy == named
    with pytest.raises(posextend.TrainingError) as refused:
        FinetuneConfig(strategy="interpolate").resolved(vision).with_strategy(vision, {2})
    message = str(refused.value)
    assert message.startswith("Strategy 'interpolate' resizes positions, but this run resizes only image grids: name one "
                              "that does (bicubic, bilinear, nearest)") and "--" not in message and "\n" not in message


def test_strategy_parameters_are_checked_against_the_strategy_named():
    config = FinetuneConfig(strategy="kps", params={"keep": 4}).resolved(get_objective("image-text"))
    assert config.params == {"keep": 4}
    with pytest.raises(posextend.StrategyError, match="does not take parameter.* std; it accepts: keep"):
        FinetuneConfig(strategy="kps", params={"std": 1}).resolved(get_objective("image-text"))


def test_the_fingerprint_follows_what_is_computed_not_how_it_runs():
    causal = get_objective("causal")
    base = FinetuneConfig(length=64).resolved(causal).with_lr(causal, 64).with_batch_size(causal, 64, 64)
    key = dict(src=Path("/m"), data=["/d"], anchor_source=None, precision="no")
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
    # the precision the steps compute in, auto resolved: auto on a machine where it is fp32 is the same run as no
    assert replace(base, mixed_precision="no").fingerprint(processes=1, **key) == same
    assert base.fingerprint(processes=1, **(key | {"precision": "bf16"})) != same


def _cli_options(command: str) -> dict[str, object]:
    """The options of a ``posextend`` command as the command line has them: name -> default."""
    import typer.main

    from posextend.cli import app

    root = typer.main.get_command(app)  # typer ships its own click: take the context class from the command
    cmd = root.get_command(root.context_class(root), command)
    return {p.name: p.default for p in cmd.params if p.param_type_name == "option" and p.name != "help"}


def test_the_finetune_and_eval_options_are_the_configs_fields():
    """Adding a fine-tune option is one field of FinetuneConfig: the commands' options are generated from them."""
    defaults = {f.name: f.default for f in fields(FinetuneConfig)}
    finetune = _cli_options("finetune")
    assert set(finetune) - set(defaults) == {"data", "plot", "revision"}  # the command's own: positional, a PNG, the hub's
    assert {k: v for k, v in finetune.items() if k in defaults} == defaults  # every field has its flag
    shared = {"length", "buckets", "batch_size", "objective"}
    evaluate = _cli_options("eval")
    assert {k: v for k, v in evaluate.items() if k in defaults} == {k: defaults[k] for k in shared}
    assert not set(evaluate) & (set(defaults) - shared)


def test_the_resize_options_are_the_resize_options_fields():
    from posextend.resize.options import ResizeOptions

    assert _cli_options("resize-model") == {f.name: f.default for f in fields(ResizeOptions)}


def test_the_commands_hand_the_generated_options_to_the_library(monkeypatch, tmp_path):
    """What the flags say reaches ``finetune``, ``evaluate`` and ``resize_checkpoint`` under the fields' names."""
    from typer.testing import CliRunner

    from posextend.cli import app

    seen = {}

    def recording(name):
        def call(*args, **kwargs):
            seen[name] = kwargs
            raise posextend.PosExtendError("recorded")
        return call

    monkeypatch.setattr("posextend.training.loop.finetune", recording("finetune"))
    monkeypatch.setattr("posextend.training.evaluate.evaluate", recording("eval"))
    monkeypatch.setattr("posextend.resize.on_disk.resize_checkpoint", recording("resize"))
    monkeypatch.setattr("posextend.files.checkpoint.Checkpoint.resolve", classmethod(lambda cls, src, revision=None: src))
    runner = CliRunner()
    runner.invoke(app, ["finetune", "src", str(tmp_path / "dst"), "-d", "x", "-n", "96", "--anchor", "0",
                        "--train", "positions", "--gradient-checkpointing", "--source", "orig"])
    options = {k: v for k, v in seen["finetune"].items() if k not in ("progress", "revision")}
    expected = {f.name: f.default for f in fields(FinetuneConfig)}
    assert options == expected | {"length": 96, "anchor": 0.0, "train": "positions", "gradient_checkpointing": True,
                                  "source": "orig"}
    runner.invoke(app, ["finetune", "src", str(tmp_path / "dst"), "-d", "x", "-s", "kps", "-p", "keep=4", "--param", "x=a"])
    assert seen["finetune"]["params"] == {"keep": 4, "x": "a"}  # read as resize-model reads them
    runner.invoke(app, ["eval", "m", "-d", "x", "--batch-size", "2", "--objective", "masked"])
    assert seen["eval"] == {"length": None, "batch_size": 2, "objective": "masked", "buckets": 8,
                            "max_sequences": 64, "json_path": None, "plot_path": None}
    runner.invoke(app, ["resize-model", "src", str(tmp_path / "dst"), "--image-size", "448x336", "-p", "std=0.5",
                        "--shrink", "--no-verify"])
    assert {k: v for k, v in seen["resize"].items() if k not in ("progress", "revision", "allow_same", "allow_large")} == {
        "new_length": None, "image_size": (448, 336), "strategy": None, "seed": None, "overwrite": False,
        "allow_shrink": True, "link": False, "table": None, "verify": False, "st_max_seq_length": None, "std": 0.5}


def test_finetune_takes_no_test_hooks():
    import inspect

    assert list(inspect.signature(posextend.finetune).parameters) == ["src", "dst", "data", "progress", "revision", "options"]


def test_the_reports_hold_their_options_and_read_them_as_before():
    from posextend.training.report import FinetuneReport

    config = FinetuneConfig(steps=3, lr=1e-3, train="positions", objective="causal", anchor=1, schedule="constant")
    report = FinetuneReport(dst="/out", config=config, old_length=32, new_length=64, tokens=10, seconds=1.0,
                            tokens_per_second=10.0)
    assert (report.train, report.steps, report.lr, report.objective, report.anchor) == ("positions", 3, 1e-3, "causal", 1.0)
    assert list(report.to_dict()) == [
        "dst", "train", "objective", "steps", "old_length", "new_length", "lr", "batch_size", "grad_accum", "precision", "items", "tokens",
        "seconds", "tokens_per_second", "losses", "eval_losses", "before", "after", "processes", "main_process",
        "strategy", "anchor", "window_anchor", "schedule", "anchor_source", "anchor_note", "notes", "verdict",
        "written_step", "held_out", "context_use"]
    assert report.to_dict()["anchor"] == 1.0 and "config" not in report.to_dict() and report.to_dict()["precision"] == "no"
    assert report.window_anchor == report.to_dict()["window_anchor"] == 0.0  # none resolved: no such term
