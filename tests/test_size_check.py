"""What a resize will write is known before it writes a byte: its size (refused when the destination's file
system has less free space, or when the new tables are far past what the model can use unless that is said
to be intended), and whether it changes anything at all (a resize to the current length writes nothing unless
asked). The fine-tune, which extends in memory and then writes, checks the same before it trains. The seed is
shown only where the strategy draws random numbers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import transformers
from typer.testing import CliRunner

import posextend
from conftest import tree_digest
from posextend.cli import app
from posextend.files.checkpoint import Checkpoint
from posextend.resize import size
from posextend.resize.plan import Request, plan_resize

Usage = namedtuple("Usage", "total used free")


def _folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and p.name != "README.md")


def _sharded(gpt: Path, where: Path) -> Path:
    """The tiny GPT-2 in two shards: the word embeddings in one, the rest (the position table too) in the other."""
    transformers.AutoModelForCausalLM.from_pretrained(gpt).save_pretrained(where, max_shard_size="2MB")
    shutil.copy(gpt / "tokenizer.json", where / "tokenizer.json")
    return where


def _planned(src: Path, length: int, dst: Path, *, link: bool = False) -> size.OutputSize:
    with Checkpoint.open(src) as source:
        plans = plan_resize(source.config, source.shapes, Request(length))
        return size.output_size(source, plans, dst, link=link)


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_the_planned_size_is_the_written_size(gpt, tmp_path, layout):
    src = gpt if layout == "single" else _sharded(gpt, tmp_path / "sharded")
    planned = _planned(src, 4096, tmp_path / "out")
    posextend.resize_checkpoint(src, tmp_path / "out", 4096, "interpolate", seed=0)
    written = _folder_bytes(tmp_path / "out")
    assert abs(planned.total - written) < 16384, (planned, written)  # provenance in the headers and index, edited JSON
    assert planned.tables == 4096 * 16 * 4 and planned.rest == 3_238_592  # fp32, width 16; every other weight
    assert not planned.large


def test_linked_shards_take_no_space_on_the_same_file_system(gpt, tmp_path):
    src = _sharded(gpt, tmp_path / "sharded")
    copied, linked = (_planned(src, 64, tmp_path / "out", link=link) for link in (False, True))
    embeddings = (src / "model-00001-of-00002.safetensors").stat().st_size  # no table in it: linked
    assert copied.total - linked.total == embeddings


def test_a_destination_without_the_space_refuses_before_writing(gpt, tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(size.shutil, "disk_usage", lambda path: seen.append(Path(path)) or Usage(10**9, 10**9, 1000))
    dst = tmp_path / "not" / "yet" / "out"
    with pytest.raises(posextend.DestinationError, match=rf"^Writing {dst} needs 6\.5 MiB, but its file system has "
                       r"only 1000 B free: free some space or choose a destination on another disk\. "
                       r"Nothing was written\.$"):
        posextend.resize_checkpoint(gpt, dst, 64)
    assert seen == [tmp_path]  # the nearest folder that exists
    assert list(tmp_path.iterdir()) == []
    r = CliRunner().invoke(app, ["resize-model", str(gpt), str(dst), "--length", "64"])
    assert r.exit_code == 1 and r.output.strip().startswith(f"Error: Writing {dst} needs 6.5 MiB") and "\n" not in r.output.strip()


def test_tables_far_past_what_the_model_can_use_are_refused_at_once_stating_their_size(gpt, tmp_path):
    """resize-model --length 100000000: 5.96 GiB of position table for 3.1 MiB of other weights."""
    code = ("import sys, posextend\n"
            "try:\n"
            "    posextend.resize_checkpoint(sys.argv[1], sys.argv[2], 100_000_000, 'interpolate')\n"
            "except posextend.LargeOutputError as error:\n"
            "    print(error)\n"
            "print('torch' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code, str(gpt), str(tmp_path / "out")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "The new position table(s) would take 6.0 GiB, 1,976 times the 3.1 MiB of every other weight of the "
        "checkpoint: far more positions than a model of this size can use. Nothing was written. To write them "
        "anyway, pass allow_large=True.",
        "False",  # refused before any table was computed: torch never imported
    ]
    assert list(tmp_path.iterdir()) == []


def test_the_cli_asks_before_large_tables_and_refuses_without_a_terminal(gpt, tmp_path, monkeypatch):
    import typer.testing

    monkeypatch.setattr(size.shutil, "disk_usage", lambda path: Usage(10**9, 10**9, 10**6))  # what a write would meet
    args = ["resize-model", str(gpt), str(tmp_path / "out"), "--length", "100000000"]
    r = CliRunner().invoke(app, args)  # stdin is no terminal: no question, one line
    assert r.exit_code == 1 and r.output.strip().count("\n") == 0 and r.output.endswith("To write them anyway, pass --yes.\n")
    r = CliRunner().invoke(app, [*args, "--yes"])
    assert r.exit_code == 1 and "needs 6.0 GiB, but its file system has only 976.6 KiB free" in r.output

    monkeypatch.setattr(typer.testing._NamedTextIOWrapper, "isatty", lambda self: True, raising=False)  # a terminal
    r = CliRunner().invoke(app, args, input="n\n")
    assert r.exit_code == 1 and "6.0 GiB, 1,976 times the 3.1 MiB" in r.output and "Write it anyway? [y/N]" in r.output
    r = CliRunner().invoke(app, args, input="y\n")  # answered yes: on to the space check, which refuses here
    assert r.exit_code == 1 and "needs 6.0 GiB, but its file system" in r.output
    assert list(tmp_path.iterdir()) == []


def test_a_finetune_checks_the_size_of_its_output_before_it_trains(gpt, corpus, tmp_path, monkeypatch):
    import posextend.training.loop as loop

    with pytest.raises(posextend.LargeOutputError, match=r"far more positions than a model of this size can use\. "
                       r"Nothing was written\. Choose a shorter length\.$"):
        posextend.finetune(gpt, tmp_path / "out", [corpus], length=100_000_000)
    monkeypatch.setattr(size.shutil, "disk_usage", lambda path: Usage(10**9, 10**9, 1000))
    monkeypatch.setattr(loop, "setup", lambda *a: pytest.fail("trained without the space to save"))
    with pytest.raises(posextend.DestinationError, match=r"needs 6\.5 MiB, but its file system has only 1000 B free"):
        posextend.finetune(gpt, tmp_path / "out", [corpus], length=64)
    assert list(tmp_path.iterdir()) == []


def test_a_resize_to_the_current_length_writes_nothing_unless_asked(gpt, tmp_path):
    before = tree_digest(gpt)
    with pytest.raises(posextend.InvalidLengthError, match=rf"^{gpt} already has 32 usable positions: the resize "
                       r"would change no table, so nothing was written\. To write a copy anyway, pass allow_same=True\.$"):
        posextend.resize_checkpoint(gpt, tmp_path / "out", 32)
    assert list(tmp_path.iterdir()) == []
    r = CliRunner().invoke(app, ["resize-model", str(gpt), str(tmp_path / "out"), "--length", "32"])
    assert r.exit_code == 1 and r.output.strip().endswith("To write a copy anyway, pass --allow-same.")
    report = posextend.resize_checkpoint(gpt, tmp_path / "out", 32, allow_same=True)
    assert (report.old_length, report.new_length) == (32, 32) and (tmp_path / "out" / "model.safetensors").is_file()
    assert tree_digest(gpt) == before


def test_a_no_op_says_what_a_copy_would_change_and_image_sizes_count_too(minilm, tmp_path):
    with pytest.raises(posextend.InvalidLengthError, match=r"To write a copy anyway \(its only change: the "
                       r"sentence-transformers max_seq_length, 256 -> 512\), pass allow_same=True\.$"):
        posextend.resize_checkpoint(minilm, tmp_path / "out", 512)
    config = transformers.ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                    image_size=224, patch_size=16)
    transformers.ViTModel(config).save_pretrained(tmp_path / "vit")
    with pytest.raises(posextend.InvalidLengthError, match=r"already has an image size of 224x224 pixels: the resize"):
        posextend.resize_checkpoint(tmp_path / "vit", tmp_path / "out", image_size=224)
    report = posextend.resize_checkpoint(tmp_path / "vit", tmp_path / "out", image_size=240)
    assert report.new_grid == [15, 15] and json.loads((tmp_path / "out" / "config.json").read_text())["image_size"] == 240


def test_the_seed_is_shown_only_where_the_strategy_draws_random_numbers(gpt, tmp_path):
    from posextend.tables.strategies import available_strategies

    assert [name for name, s in available_strategies().items() if s.random] == ["random"]
    outputs = {}
    for strategy in ("tile", "interpolate", "random"):
        dst = tmp_path / strategy
        r = CliRunner().invoke(app, ["resize-model", str(gpt), str(dst), "--length", "64", "-s", strategy, "--seed", "7"])
        assert r.exit_code == 0, r.output
        outputs[strategy] = (next(line for line in r.output.splitlines() if "Resized" in line), (dst / "README.md").read_text())
    for strategy in ("tile", "interpolate"):
        line, card = outputs[strategy]
        assert f"with {strategy}, in " in line and "seed" not in line and "seed" not in card
    line, card = outputs["random"]
    assert "with random, seed 7, in " in line and "- Parameters: `{}`, seed 7" in card
