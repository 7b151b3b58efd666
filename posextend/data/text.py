"""Text as users hold it: documents (plain-text files, directories of them, JSON Lines of ``text``) and
supervised ``(source, target)`` pairs (JSON Lines holding both fields), read into a list of items.

Data is text: a file is judged on its first 64 KiB (:func:`not_text`), and one that is not text (a model's weights,
a program) is refused by name, or skipped, with one warning, where a directory holds it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from posextend.errors import DataError

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text", ".jsonl", ".json")
PAIR_FIELDS = ("source", "target")  # a JSON Lines record of supervised sequence-to-sequence data
SNIFFED = 64 * 1024  # bytes of a file that decide whether it is text
MOST_UNDECODABLE = 0.3  # the largest share of those that may be no UTF-8 (a Latin-1 text's accents: a few %)


def not_text(path: Path) -> str | None:
    """Why the file ``path`` is not text, judged on its first 64 KiB; None when it is. Not text: a NUL byte (binary
    files have them, UTF-8 text never), or more than 30% of the bytes undecodable as UTF-8 (random bytes: about
    half). A Latin-1 text is read: only its accented letters, a few in a hundred, are lost (replaced)."""
    try:
        with path.open("rb") as f:
            head = f.read(SNIFFED)
    except OSError as exc:
        raise DataError(f"Cannot read {path}: {exc}") from None
    if b"\0" in head:
        return "it holds NUL bytes: binary, or UTF-16 text"
    undecodable = len(head) - len(head.decode("utf-8", errors="ignore").encode("utf-8"))
    if undecodable > MOST_UNDECODABLE * len(head):
        return f"{undecodable / len(head):.0%} of its first {len(head):,} bytes are not UTF-8"
    return None


def _files(paths: Iterable[str | Path]) -> tuple[list[Path], list[Path]]:
    """The text files ``paths`` name (files, and the text files under directories), and those skipped under
    directories because they are not text. A file named that is not text is refused."""
    files: list[Path] = []
    skipped: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
            if not found:
                raise DataError(f"{path} holds no text files ({', '.join(TEXT_SUFFIXES)}).")
            text = {p: not_text(p) is None for p in found}
            if not any(text.values()):
                raise DataError(f"{path} holds no text: its files are binary or not UTF-8 ({_names(found)}).")
            files += [p for p in found if text[p]]
            skipped += [p for p in found if not text[p]]
        elif path.is_file():
            reason = not_text(path)
            if reason:
                raise DataError(f"Data file {path} is not text ({reason}): give UTF-8 text files, directories of "
                                "them, or JSON Lines.")
            files.append(path)
        else:
            raise DataError(f"Data path {path} does not exist.")
    return files, skipped


def _names(paths: Sequence[Path], shown: int = 10) -> str:
    """``paths`` as one list for a message, the first ``shown`` of them by name."""
    more = f" and {len(paths) - shown} more" if len(paths) > shown else ""
    return ", ".join(map(str, paths[:shown])) + more


def _warn_skipped(skipped: Sequence[Path]) -> None:
    if skipped:
        log.warning("Skipped %d data file(s) that are not text: %s", len(skipped), _names(skipped))


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise DataError(f"Cannot read {path}: {exc}") from None


def _records(path: Path) -> Iterator[tuple[int, Any]]:
    """``(line number, record)`` of each non-empty line of a JSON Lines file."""
    for i, line in enumerate(_read(path).splitlines(), 1):
        if line.strip():
            try:
                yield i, json.loads(line)
            except ValueError:
                raise DataError(f"{path}:{i} is not JSON.") from None


def read_documents(paths: Sequence[str | Path], *, text_field: str = "text") -> list[str]:
    """Documents from plain-text files, directories of them, and JSON Lines (``text_field``)."""
    if not paths:
        raise DataError("No data given: pass data=PATH (a text file, a directory, or JSON Lines).")
    docs: list[str] = []
    files, skipped = _files(paths)
    _warn_skipped(skipped)
    for path in files:
        if path.suffix.lower() != ".jsonl":
            docs.append(_read(path))
            continue
        for i, record in _records(path):
            if not isinstance(record, dict) or text_field not in record:
                raise DataError(f"{path}:{i} is not a JSON object with a {text_field!r} field.")
            docs.append(str(record[text_field]))
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise DataError(f"The data ({', '.join(map(str, paths))}) holds no text.")
    return docs


def read_pairs(paths: Sequence[str | Path]) -> list[tuple[str, str]] | None:
    """``(source, target)`` pairs (a document and its summary) when the data is JSON Lines whose records
    hold both :data:`PAIR_FIELDS`; None when no file's first record does (plain text). A mix is refused."""
    files, skipped = _files(paths) if paths else ([], [])
    paired = [f for f in files if f.suffix.lower() == ".jsonl"
              and isinstance(first := next((r for _, r in _records(f)), None), dict) and set(PAIR_FIELDS) <= first.keys()]
    if not paired:
        return None
    if len(paired) != len(files):
        other = next(f for f in files if f not in paired)
        raise DataError(f"{paired[0]} holds {'/'.join(PAIR_FIELDS)} pairs but {other} does not: give pairs only, "
                        "or plain text only.")
    _warn_skipped(skipped)  # here, not when the data is plain text: read_documents reads it then, and warns
    pairs = []
    for path in paired:
        for i, record in _records(path):
            if not isinstance(record, dict) or not set(PAIR_FIELDS) <= record.keys():
                raise DataError(f"{path}:{i} is not a JSON object with {' and '.join(map(repr, PAIR_FIELDS))} fields, "
                                "which every record of a file of pairs needs.")
            pairs.append((str(record[PAIR_FIELDS[0]]), str(record[PAIR_FIELDS[1]])))
    pairs = [(a, b) for a, b in pairs if a.strip() and b.strip()]
    if not pairs:
        raise DataError(f"The data ({', '.join(map(str, paths))}) holds no pair with text on both sides.")
    return pairs
