"""Strategies and objectives share one registry mechanism: names, duplicates, lookups and plug-ins
(entry points) behave the same for both."""

from __future__ import annotations

import logging
import sys

import pytest

from posextend.training.objectives import base as objectives
from posextend.tables import strategies
from posextend.errors import StrategyError, TrainingError

KINDS = {  # registry, an error of its kind, a built-in
    "strategy": (strategies, StrategyError, "tile"),
    "objective": (objectives, TrainingError, "causal"),
}


def _install_plugin(tmp_path, monkeypatch, group: str, source: str) -> None:
    """A distribution whose ``group`` entry point names the module ``source`` (on sys.path)."""
    (tmp_path / "my_plugin.py").write_text(source)
    dist = tmp_path / "my_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[{group}]\nmine = my_plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_plugin", raising=False)


@pytest.fixture
def registry(request, monkeypatch):
    module, error, builtin = KINDS[request.param]
    monkeypatch.setattr(module._REGISTRY, "items", dict(module._REGISTRY.items))
    monkeypatch.setattr(module._REGISTRY, "plugins_loaded", False)
    return module._REGISTRY, error, builtin


@pytest.mark.parametrize("registry", list(KINDS), indirect=True)
def test_a_broken_plugin_warns_and_leaves_the_built_ins(registry, tmp_path, monkeypatch, caplog):
    reg, error, builtin = registry
    _install_plugin(tmp_path, monkeypatch, reg.group, "raise ImportError('needs a GPU library')\n")
    with caplog.at_level(logging.WARNING, logger="posextend.registry"):
        found = reg.available()
    assert builtin in found and "mine" not in found
    assert f"Could not load posextend {reg.kind} plug-in 'mine': needs a GPU library" in caplog.text
    assert reg.get(builtin) is found[builtin]


@pytest.mark.parametrize("registry", list(KINDS), indirect=True)
def test_names_duplicates_and_unknowns_are_refused_alike(registry):
    reg, error, builtin = registry
    with pytest.raises(error, match=f"Invalid {reg.kind} name 'Bad Name'"):
        reg.check_name("Bad Name")
    with pytest.raises(error, match=rf"A {reg.kind} named '{builtin}' is already registered \(by posextend\.[\w.]+\)"):
        reg.check_name(builtin)
    with pytest.raises(error, match=rf"Unknown {reg.kind} 'nope'\. Valid {reg.plural}: .*{builtin}"):
        reg.get("nope")


def test_an_objective_plugin_is_discovered(tmp_path, monkeypatch):
    monkeypatch.setattr(objectives._REGISTRY, "items", dict(objectives._REGISTRY.items))
    monkeypatch.setattr(objectives._REGISTRY, "plugins_loaded", False)
    _install_plugin(tmp_path, monkeypatch, "posextend.objectives", (
        "from posextend.training.objectives import register_objective\n"
        "from posextend.training.objectives.causal import CausalLM\n"
        "@register_objective('causal-copy', description='The causal objective under another name (a test).')\n"
        "class Copy(CausalLM):\n    pass\n"))
    found = objectives.available_objectives()
    assert type(found["causal-copy"]).__module__ == "my_plugin" and found["causal-copy"].name == "causal-copy"


def test_the_seq2seq_objective_is_one_file_found_through_its_entry_point():
    """posextend's own seq2seq objective is registered as a third-party one is: by the package's entry point,
    with nothing in the core importing it."""
    import subprocess

    code = ("import sys, posextend; found = posextend.available_objectives(); "
            "print(type(found['seq2seq']).__module__, 'posextend.training.objectives.seq2seq' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["posextend.training.objectives.seq2seq", "True"]
    from pathlib import Path

    package = Path(objectives.__file__).parent
    assert not [p.name for p in package.glob("*.py") if p.name != "seq2seq.py" and "seq2seq import" in p.read_text()]


def test_an_objective_from_outside_the_package_runs_through_the_cli(gpt, corpus, tmp_path, monkeypatch):
    """A plug-in objective (its own metric) installed by entry point: `finetune --objective NAME` trains with it
    prints its metric in the before/after table and writes the plot, and `eval --objective NAME` scores with it."""
    from typer.testing import CliRunner

    from posextend.cli import app

    monkeypatch.setattr(objectives._REGISTRY, "items", dict(objectives._REGISTRY.items))
    monkeypatch.setattr(objectives._REGISTRY, "plugins_loaded", False)
    _install_plugin(tmp_path, monkeypatch, "posextend.objectives", (
        "import dataclasses\n"
        "from posextend.training.objectives import register_objective\n"
        "from posextend.training.objectives.causal import CausalLM\n"
        "@register_objective('causal-renamed', description='The causal objective with its own metric (a test).')\n"
        "class Renamed(CausalLM):\n"
        "    def evaluate(self, run):\n"
        "        return dataclasses.replace(super().evaluate(run), metric='renamed perplexity')\n"))
    runner = CliRunner()
    r = runner.invoke(app, ["finetune", str(gpt), str(tmp_path / "out"), "--data", str(corpus), "--steps", "2",
                            "--batch-size", "2", "--objective", "causal-renamed", "--plot", str(tmp_path / "p.png")])
    assert r.exit_code == 0, r.output
    assert "renamed perplexity" in r.output and "(causal-renamed, all, 2 steps" in r.output
    assert (tmp_path / "p.png").stat().st_size > 1000
    r = runner.invoke(app, ["eval", str(tmp_path / "out"), "--data", str(corpus), "--objective", "causal-renamed",
                            "--max-sequences", "2"])
    assert r.exit_code == 0 and "renamed perplexity" in r.output, r.output
