"""Data is text (issue 36, item 3): a file that is not text is refused by name, or skipped with one warning where a
directory holds it; a Latin-1 text with a few bytes that are not UTF-8 is still read."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from typer.testing import CliRunner

import posextend
from posextend.cli import app
from posextend.data.text import not_text, read_documents, read_pairs

LATIN1 = "Le café était prêt. " + "The quick brown fox jumps over the lazy dog. " * 40  # 3 accents in ~1.8 KB


def _elf(path: Path) -> Path:
    """An ELF-like executable: the magic, a zeroed header, then code-like bytes."""
    path.write_bytes(b"\x7fELF\x02\x01\x01" + bytes(57) + bytes(range(256)) * 80)
    return path


def _all_bytes(path: Path) -> Path:
    path.write_bytes(bytes(range(256)) * 4096)  # 1 MiB of the bytes 0..255 repeated
    return path


def _latin1(path: Path) -> Path:
    path.write_bytes(LATIN1.encode("latin-1"))
    return path


@pytest.mark.parametrize("make", [_elf, _all_bytes], ids=["elf", "bytes-0-255"])
def test_a_binary_file_is_refused_by_name(tmp_path, make):
    path = make(tmp_path / "data.txt")
    with pytest.raises(posextend.DataError, match=rf"Data file {path} is not text \(it holds NUL bytes"):
        read_documents([path])


def test_a_models_weights_are_refused_by_name(gpt):
    weights = gpt / "model.safetensors"
    with pytest.raises(posextend.DataError, match=rf"Data file {weights} is not text"):
        read_documents([weights])


def test_what_is_text_is_judged_on_the_first_64_kib(tmp_path):
    (tmp_path / "utf8.txt").write_text("Zoë's naïve café: ünïcödé throughout. " * 2000, encoding="utf-8")
    (tmp_path / "high.bin").write_bytes(bytes(range(1, 256)) * 100)  # no NUL, half the bytes not UTF-8
    (tmp_path / "late.txt").write_bytes(b"text " * 20_000 + bytes(1000))  # a NUL after the first 64 KiB
    (tmp_path / "empty.txt").write_bytes(b"")
    assert not_text(tmp_path / "utf8.txt") is None
    assert not_text(_latin1(tmp_path / "latin1.txt")) is None
    assert not_text(tmp_path / "late.txt") is None and not_text(tmp_path / "empty.txt") is None
    assert not_text(tmp_path / "high.bin") == "50% of its first 25,500 bytes are not UTF-8"
    assert not_text(_elf(tmp_path / "elf")) == "it holds NUL bytes: binary, or UTF-16 text"


def test_a_latin1_text_with_a_few_bytes_that_are_not_utf8_is_read(tmp_path):
    [doc] = read_documents([_latin1(tmp_path / "latin1.txt")])
    assert doc.count("\ufffd") == 3  # é, é, ê: replaced, the rest read as it is
    assert doc == LATIN1.replace("é", "\ufffd").replace("ê", "\ufffd")


def _mixed(root: Path, gpt: Path) -> Path:
    root.mkdir()
    (root / "good.txt").write_text("A plain English text. " * 50)
    _latin1(root / "latin1.txt")
    (root / "records.jsonl").write_text('{"text": "a record"}\n')
    _all_bytes(root / "bytes.txt")
    _elf(root / "program.md")
    (root / "model.safetensors").write_bytes((gpt / "model.safetensors").read_bytes())  # no text suffix: not read
    return root


def test_a_directory_skips_what_is_not_text_with_one_warning(tmp_path, gpt, caplog):
    root = _mixed(tmp_path / "data", gpt)
    with caplog.at_level(logging.WARNING, logger="posextend"):
        docs = read_documents([root])
    assert sorted(d[:10] for d in docs) == ["A plain En", "Le caf\ufffd \ufffdt", "a record"]
    [warning] = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert warning.getMessage() == f"Skipped 2 data file(s) that are not text: {root / 'bytes.txt'}, {root / 'program.md'}"


def test_seq2seq_reads_plain_text_from_a_directory_with_one_warning(tmp_path, gpt, caplog):
    """seq2seq looks for pairs first, then reads plain text: the skipped files are named once."""
    from posextend.training.objectives.base import get_objective

    root = _mixed(tmp_path / "data", gpt)
    with caplog.at_level(logging.WARNING, logger="posextend"):
        assert read_pairs([root]) is None
        assert not caplog.records
        docs = get_objective("seq2seq").documents([root])
    assert len(docs) == 3 and len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1


def test_a_directory_of_nothing_but_binary_files_is_refused(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    _all_bytes(root / "bytes.txt")
    _elf(root / "program.md")
    with pytest.raises(posextend.DataError, match=rf"{root} holds no text: its files are binary or not UTF-8 "
                                                  rf"\({root / 'bytes.txt'}, {root / 'program.md'}\)"):
        read_documents([root])


@pytest.mark.parametrize("command", ["finetune", "eval"])
def test_the_cli_refuses_binary_data_by_name_in_one_line(tmp_path, gpt, command):
    weights = gpt / "model.safetensors"
    args = [command, str(gpt), *([str(tmp_path / "out")] if command == "finetune" else []), "--data", str(weights)]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 1
    assert r.stderr == (f"Error: Data file {weights} is not text (it holds NUL bytes: binary, or UTF-16 text): give "
                        "UTF-8 text files, directories of them, or JSON Lines.\n")
    assert not (tmp_path / "out").exists()
