"""An objective is one file, even with a head posextend does not know: installed from outside the package (a
module and a distribution's entry point in a temporary folder), a token-classification objective on a tiny BERT
shows up in ``posextend finetune --help``, trains through ``posextend finetune`` (a fresh head, the table
extended), is written in the checkpoint's files and layout, and scores through ``posextend eval``; no file of
posextend is touched and no built-in default changes."""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

import pytest
import transformers
from safetensors import safe_open
from test_registry import _install_plugin
from typer.testing import CliRunner

import posextend
from posextend.cli import app
from posextend.training.objectives import base as objectives

PLUGIN = '''
"""Token parity: a token-classification head learns whether each token's id is even."""
from dataclasses import dataclass

import torch

from posextend.scoring.by_position import bucket_edges, report_from
from posextend.training.objectives import Objective, register_objective


@dataclass
class Seen:
    batches: int = 0  # micro-batches trained in this run


@register_objective("token-parity", description="Token classification: is each token's id even? (a test plug-in)")
class TokenParity(Objective):
    model_class = "AutoModelForTokenClassification"
    head = "token-classification"
    metric = "token-parity perplexity"
    State = Seen
    lr = {"new-rows": 3e-3, "positions": 3e-3, "all": 3e-3}

    def loss(self, run, positions, batch):
        batch = batch.to(run.accelerator.device)
        run.state.batches += 1
        return run.model(input_ids=batch, labels=batch % 2).loss, batch.numel()

    @torch.no_grad()
    def evaluate(self, run):
        was_training = run.model.training
        run.model.eval()
        total = torch.zeros(run.sizes.length.new, dtype=torch.float64)
        count = torch.zeros(run.sizes.length.new, dtype=torch.float64)
        for rows in run.eval_samples.split(run.config.batch_size):
            logits = run.model(input_ids=rows.to(run.accelerator.device)).logits.float().cpu()
            losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), rows % 2, reduction="none")
            total += losses.double().sum(0)
            count += rows.shape[0]
        run.model.train(was_training)
        old = run.sizes.length.new_from  # where the new positions start (None: the run adds none)
        edges = bucket_edges(run.sizes.length.new, run.config.buckets, old_length=old)
        return report_from(total, count, edges, objective=self.name, sequences=len(run.eval_samples), old_length=old,
                           metric=self.metric)

    def notes(self, run):
        return [f"token-parity: {run.state.batches} micro-batches"]
'''


def _package_digest() -> str:
    root = Path(posextend.__file__).parent
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(root.rglob("*.py")))).hexdigest()


def _flat(output: str) -> str:
    """Rich's help and tables without their frames and line breaks (a wrapped help line reads as one)."""
    return " ".join(re.sub(r"[│╭╮╰╯─┃┏┓┗┛━┡┩┠┨╇]", " ", output).split())


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    objectives.available_objectives()  # the installed plug-ins (seq2seq) loaded first: the registry after the test has them
    monkeypatch.setattr(objectives._REGISTRY, "items", dict(objectives._REGISTRY.items))
    monkeypatch.setattr(objectives._REGISTRY, "plugins_loaded", False)
    site = tmp_path / "site"  # the plug-in's module and its distribution's entry point, on sys.path
    site.mkdir()
    _install_plugin(site, monkeypatch, "posextend.objectives", PLUGIN)


def test_an_objective_with_an_unknown_head_is_one_file_outside_the_package(plugin, bert, corpus, tmp_path):
    before = _package_digest()
    runner = CliRunner()
    r = runner.invoke(app, ["finetune", "--help"], env={"COLUMNS": "100"})
    assert r.exit_code == 0, r.output
    assert "token-parity: Token classification: is each token's id even? (a test plug-in)" in _flat(r.output)
    assert "masked: BERT masking" in _flat(r.output)  # the built-ins are listed beside it
    # each option's defaults are made from the registry: the plug-in's lr table (lora from the base), schedule, anchor
    assert "causal: all 1e-3, lora 2e-3, positions 1e-3, new-rows 3e-3" in _flat(r.output)
    assert "token-parity: all 3e-3, lora 1e-3, positions 3e-3, new-rows 3e-3" in _flat(r.output)
    assert "token-parity: all constant, lora constant" in _flat(r.output)
    assert "token-parity: none (no anchor term)" in _flat(r.output) and "causal: 1;" in _flat(r.output)
    # --data's kinds too: the plug-in reads text as the base class says, listed with the text objectives
    assert re.search(r"--data .*causal, contrastive, masked, token-parity: UTF-8 text files", _flat(r.output))

    out = tmp_path / "out"
    r = runner.invoke(app, ["finetune", str(bert), str(out), "--data", str(corpus), "--objective", "token-parity",
                            "--init-head", "--length", "48", "--steps", "12", "--batch-size", "2", "--seed", "0"])
    assert r.exit_code == 0, r.output
    shown = _flat(r.output)
    assert "before token-parity" in shown and "after token-parity" in shown  # its metric heads the table
    assert "(token-parity, all, 12 steps" in shown and "32 → 48 positions" in shown
    assert "token-parity: 12 micro-batches" in shown  # its typed per-run state, through its notes
    scores = json.loads((out / "posextend_eval.json").read_text())
    assert scores["before"]["metric"] == scores["after"]["metric"] == "token-parity perplexity"
    assert scores["before"]["length"] == scores["after"]["length"] == 48
    assert 0 < scores["after"]["loss"] < scores["before"]["loss"] - 0.05  # the fresh head learned the parity

    with safe_open(out / "model.safetensors", "pt") as f:  # the head is added to the source's files, in its layout
        names = set(f.keys())
    assert {"classifier.weight", "classifier.bias", "bert.embeddings.position_embeddings.weight"} <= names
    model, info = transformers.AutoModelForTokenClassification.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and type(model).__name__ == "BertForTokenClassification"
    assert model.bert.embeddings.position_embeddings.weight.shape[0] == 48

    r = runner.invoke(app, ["eval", str(out), "--data", str(corpus), "--objective", "token-parity",
                            "--max-sequences", "8", "--json", str(tmp_path / "eval.json")])
    assert r.exit_code == 0, r.output
    assert "8 sequences of 48 tokens (token-parity)" in _flat(r.output)
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["objective"] == "token-parity" and report["metric"] == "token-parity perplexity"
    assert report["length"] == 48 and math.isfinite(report["loss"])
    assert abs(report["loss"] - scores["after"]["loss"]) < 0.1  # the written model scores as the trained one did

    # the plug-in takes no built-in's place: a BERT checkpoint still defaults to masked
    assert objectives.default_objective(bert) == "masked"
    assert _package_digest() == before
