"""A command resolves the checkpoint it is given once (:class:`posextend.files.checkpoint.Checkpoint`) and
passes it down: the path is looked up once, its config read once, whatever the command does with it."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

import posextend
from posextend.cli import app
from posextend.files import sources


@pytest.fixture
def lookups(monkeypatch) -> Counter:
    """How often each path was resolved (``"resolve"``) and each model folder's config read (``"config"``),
    by whichever module calls them (each module that imported the functions by name gets the counted ones)."""
    import posextend.training.evaluate
    import posextend.training.loop  # noqa: F401  (every module a command calls, imported)

    counts: Counter = Counter()
    resolve, read = sources.resolve_source, sources.read_config

    def counted_resolve(src, **kwargs):
        counts["resolve", Path(src).expanduser().resolve()] += 1
        return resolve(src, **kwargs)

    def counted_read(directory):
        counts["config", Path(directory).resolve()] += 1
        return read(directory)

    for module in [m for name, m in sys.modules.items() if name.startswith("posextend")]:
        for original, counted in ((resolve, counted_resolve), (read, counted_read)):
            for name, value in list(vars(module).items()):
                if value is original:
                    monkeypatch.setattr(module, name, counted)
    return counts


def test_a_finetune_resolves_its_source_once(gpt, corpus, tmp_path, lookups):
    """Choosing the objective, loading, the provenance, the file names and the save share one checkpoint."""
    posextend.finetune(gpt, tmp_path / "out", [corpus], length=64, train="new-rows", steps=1, batch_size=2,
                       eval_sequences=2, seed=0)
    src = gpt.resolve()
    assert (lookups["resolve", src], lookups["config", src]) == (1, 1)


def test_an_evaluation_resolves_its_model_once(gpt, corpus, lookups):
    posextend.evaluate(gpt, [corpus], max_sequences=2, batch_size=2)
    assert (lookups["resolve", gpt.resolve()], lookups["config", gpt.resolve()]) == (1, 1)


def test_inspect_resolves_its_source_once_with_a_comparison(gpt, tmp_path, lookups):
    """``inspect --compare``: the checkpoint's numbers and both tables' diagnostics from one resolution each."""
    posextend.resize_checkpoint(gpt, tmp_path / "long", 64, "tile", seed=0)
    assert (lookups["resolve", gpt.resolve()], lookups["config", gpt.resolve()]) == (1, 1)
    lookups.clear()
    r = CliRunner().invoke(app, ["inspect", str(tmp_path / "long"), "--compare", str(gpt)])
    assert r.exit_code == 0, r.output
    for path in (tmp_path / "long", gpt):
        assert (lookups["resolve", path.resolve()], lookups["config", path.resolve()]) == (1, 1), path
