"""The command line as a new user reads it (issue 36, items 5-8): usage ``SRC DST``, flags without a value, values
named plainly, finetune's options in panels, and every error one line with nothing before it."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import pytest
import typer
from typer.testing import CliRunner

from posextend.cli import app, with_options
from posextend.options import DEFAULT_PANEL, metavar, option
from posextend.terminal import App
from tiny import FAMILIES, build

runner = CliRunner()
PYTHON_TYPE = re.compile(r"<(bool|int|str|float|path|list\[[^\]]*\])>|\{[a-z_]+\}")
COMMANDS = [(), ("resize-model",), ("inspect",), ("strategies",), ("finetune",), ("eval",)]


def help_text(*command: str, of: typer.Typer = app) -> str:
    r = runner.invoke(of, [*command, "--help"], env={"COLUMNS": "100"})
    assert r.exit_code == 0, r.output
    return r.output


def panels(text: str) -> dict[str, list[str]]:
    """Each panel of a help text and the flags of its rows (an argument: its name)."""
    titles = re.findall(r"╭─ (.+?) ─", text)
    bodies = re.split(r"╭─ .+? ─+╮", text)[1:]
    return {t: re.findall(r"^│\s*\*?\s*(--[a-z-]+|[A-Z]+)\s", b, re.M) for t, b in zip(titles, bodies)}


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "posextend")
def test_help_shows_no_python_types_and_fits_100_columns(command):
    text = help_text(*command)
    assert not PYTHON_TYPE.search(text), PYTHON_TYPE.search(text).group(0)
    assert max(map(len, text.splitlines())) <= 100


def usage(text: str) -> str:
    return re.search(r"Usage: (.*?)\s*$", text, re.M).group(1)


def test_usage_reads_src_dst():
    assert usage(help_text("resize-model")).endswith(" resize-model [OPTIONS] SRC DST")
    assert usage(help_text("finetune")).endswith(" finetune [OPTIONS] SRC DST")
    assert usage(help_text("inspect")).endswith(" inspect [OPTIONS] SRC")
    assert usage(help_text("eval")).endswith(" eval [OPTIONS] MODEL")
    assert panels(help_text("finetune"))["Arguments"] == ["SRC", "DST"]
    assert re.search(r"│ \*\s+SRC\s+Checkpoint directory", help_text("resize-model"))  # no type beside an argument


def test_flags_take_no_value_and_values_have_plain_names():
    resize, finetune = help_text("resize-model"), help_text("finetune")
    assert re.search(r"│ --overwrite\s+Replace DST if it exists", resize)
    assert re.search(r"│ --verify\s+--no-verify\s+Before the output", resize)
    assert re.search(r"│ --help\s+Show this message", resize)
    assert re.search(r"│ --length\s+-n\s+N\s+New length", resize)
    assert re.search(r"│ --param\s+-p\s+KEY=VALUE\s", resize)
    assert re.search(r"│ --image-size\s+SIZE\s", resize)
    assert re.search(r"│ \*\s+--data\s+-d\s+PATH\s+The data, as each objective reads it", finetune)
    assert re.search(r"│ --lr\s+FLOAT\s", finetune) and re.search(r"│\s+--train\s+WHAT\s", finetune)
    assert re.search(r"│ --plot\s+PATH\s", help_text("inspect"))
    assert re.search(r"│ --version\s+Print the version", help_text())


def test_finetune_groups_its_options_in_panels():
    found = panels(help_text("finetune"))
    assert list(found) == ["Arguments", "What most users set", "Training", "Evaluation", "Advanced"]
    assert found["What most users set"] == ["--data", "--length", "--image-size", "--strategy", "--steps", "--budget", "--train",
                                            "--objective"]
    assert {"--lr", "--schedule", "--batch-size", "--anchor", "--seed", "--resume"} <= set(found["Training"])
    assert found["Evaluation"] == ["--eval-every", "--eval-data", "--train-control", "--margin", "--tolerance", "--eval-sequences",
                                   "--buckets", "--plot"]
    assert found["Advanced"][-1] == "--help" and {"--overwrite", "--source", "--init-head"} <= set(found["Advanced"])
    # eval shows some of the same fields, without panels; resize-model has none
    assert list(panels(help_text("eval"))) == list(panels(help_text("resize-model"))) == ["Arguments", "Options"]


def test_finetune_help_says_in_plain_words_what_its_terms_mean():
    text = " ".join(help_text("finetune").replace("│", " ").split())
    for jargon in ("quality grid", "provenance", "min(1, 192/width)", "twin"):
        assert jargon not in text
    assert "only the positions past the old length; the rest stays exactly as it was" in text  # new-rows
    assert "keeps the outputs on inputs within the old length as they were" in text  # the anchor
    assert "as posextend recorded in SRC's files" in text  # the provenance
    assert "docs/concepts/training.md" in text
    assert "twin" not in " ".join(help_text("resize-model").replace("│", " ").split())


@dataclass(frozen=True)
class _Knobs:
    size: int = option(3, "How big.", commands=("go",), panel="What most users set")
    added_later: float | None = option(None, "A field that names no panel.", commands=("go",))
    verbose: bool = option(False, "Say more.", commands=("go",), panel={"go": "Training"})


def test_an_option_that_names_no_panel_lands_last_under_advanced():
    demo = App(add_completion=False)

    @demo.command("go")
    @with_options(_Knobs, "go")
    def go(src: Annotated[str, typer.Argument(help="In.")], options: dict[str, Any]) -> None:
        print(options)

    text = help_text(of=demo)
    assert panels(text) == {"Arguments": ["SRC"], "What most users set": ["--size"], "Training": ["--verbose"],
                            DEFAULT_PANEL: ["--added-later", "--help"]}
    assert re.search(r"│ --added-later\s+FLOAT\s+A field", text) and usage(text).endswith(" [OPTIONS] SRC")
    assert runner.invoke(demo, ["x", "--added-later", "2.5"]).output == \
        "{'size': 3, 'added_later': 2.5, 'verbose': False}\n"


@pytest.mark.parametrize("annotation, name", [
    (int, "N"), (int | None, "N"), (float, "FLOAT"), (bool, ""), (bool | None, ""), (str, "TEXT"), (Path, "PATH"),
    (list[Path], "PATH"), (list[str], "TEXT"), (str | Path | None, "TEXT"), (tuple[int, int], "N"),
    (Annotated[Path | None, "meta"], "PATH"),
])
def test_metavar_names_a_type_plainly(annotation, name):
    assert metavar(annotation) == name


# ---------------------------------------------------------------- errors: one line, nothing before it


def _cli(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "posextend.cli", *map(str, args)], capture_output=True, text=True)


def _one_line(r: subprocess.CompletedProcess, words: str) -> None:
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("Error: ") and r.stderr.count("\n") == 1 and words in r.stderr, repr(r.stderr)
    assert r.stdout == ""


def test_errors_are_one_line_with_nothing_before_them(gpt, corpus, tmp_path):
    # a resize's progress bar stood before it (rich leaves an empty line where stderr is no terminal)
    _one_line(_cli("resize-model", tmp_path / "nope", tmp_path / "out", "--length", "64"), "does not exist")
    # after a model is loaded: transformers' "Loading weights" bar stood before it
    _one_line(_cli("eval", gpt, "--data", corpus, "--length", "1000"), "exceeds the model's 32 positions")
    (tmp_path / "short.txt").write_text("Too short to fill one sequence.")
    _one_line(_cli("finetune", gpt, tmp_path / "ft", "--data", tmp_path / "short.txt", "--steps", "1"),
              "fewer than one sequence of 32")
    assert not (tmp_path / "ft").exists() and not (tmp_path / "out").exists()


def test_a_grid_size_on_a_text_model_says_what_it_has(bert, tmp_path):
    r = runner.invoke(app, ["resize-model", str(bert), str(tmp_path / "out"), "--image-size", "448"])
    assert r.exit_code == 1 and r.stderr == (
        "Error: Model type 'bert' has no learned table of an image grid posextend resizes; it has positions "
        "(max_position_embeddings=32): give a length instead.\n")


def test_inspect_explains_its_terms(minilm, tmp_path):
    text = runner.invoke(app, ["inspect", str(minilm)]).output
    assert "bare (BertModel's names: the base model's own, as sentence-transformers saves them)" in text
    assert "buffers sized by the length (rebuilt by a resize): embeddings.position_ids\n" in text  # one: no "..."
    assert "reserved rows" not in text  # none
    roberta = build(FAMILIES["roberta"], tmp_path / "roberta")
    text = runner.invoke(app, ["inspect", str(roberta)]).output
    assert "usable positions: 37, reserved rows: 2 (before position 0: padding or offset rows), config: " in text
    assert "headed (RobertaForMaskedLM's names: under the base model's prefix" in text
