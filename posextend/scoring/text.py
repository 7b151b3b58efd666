"""Training and evaluation text: read, tokenise, pack into sequences of exactly the new length."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from posextend.errors import DataError

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text", ".jsonl", ".json")
PAIR_FIELDS = ("source", "target")  # a JSON Lines record of supervised sequence-to-sequence data


def _files(paths: Iterable[str | Path]) -> list[Path]:
    files: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
            if not found:
                raise DataError(f"{path} holds no text files ({', '.join(TEXT_SUFFIXES)}).")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise DataError(f"Data path {path} does not exist.")
    return files


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
    for path in _files(paths):
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
    files = _files(paths) if paths else []
    paired = [f for f in files if f.suffix.lower() == ".jsonl"
              and isinstance(first := next((r for _, r in _records(f)), None), dict) and set(PAIR_FIELDS) <= first.keys()]
    if not paired:
        return None
    if len(paired) != len(files):
        other = next(f for f in files if f not in paired)
        raise DataError(f"{paired[0]} holds {'/'.join(PAIR_FIELDS)} pairs but {other} does not: give pairs only, "
                        "or plain text only.")
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


def pack(tokenizer, documents: Sequence[str], length: int) -> torch.Tensor:
    """Tokenise, join documents with the EOS (or SEP) token, cut into ``[n, length]`` sequences.

    Every sequence is exactly ``length`` tokens long, so every step sees every position;
    the tail shorter than ``length`` is dropped.
    """
    sep = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    ids: list[int] = []
    for doc in documents:
        ids += tokenizer(doc, add_special_tokens=False, verbose=False)["input_ids"]
        if sep is not None:
            ids.append(sep)
    n = len(ids) // length
    if n == 0:
        raise DataError(
            f"The data has {len(ids)} tokens, fewer than one sequence of {length}: give more text or a shorter length=N."
        )
    return torch.tensor(ids[: n * length], dtype=torch.long).view(n, length)


def framed(rows: Sequence[Sequence[int] | torch.Tensor], tokenizer) -> dict[str, torch.Tensor]:
    """An encoder's batch of ``rows`` (token ids without special tokens): ``[CLS] row [SEP]`` each (BOS and
    EOS for a tokenizer without CLS/SEP), padded to the longest, with the attention mask."""
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    if cls is None or sep is None:
        cls, sep = tokenizer.bos_token_id, tokenizer.eos_token_id
    width = max(len(r) for r in rows) + 2
    ids = torch.full((len(rows), width), tokenizer.pad_token_id or 0, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row) + 2] = torch.cat([torch.tensor([cls]), torch.as_tensor(row, dtype=torch.long), torch.tensor([sep])])
        mask[i, : len(row) + 2] = 1
    return {"input_ids": ids, "attention_mask": mask}


def split(sequences: torch.Tensor, eval_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and held-out parts (the held-out part comes from the end of the corpus)."""
    if len(sequences) < 2:
        raise DataError(
            f"The data packs into {len(sequences)} sequence(s) of {sequences.shape[1]} tokens; at least 2 are needed "
            "(one to train on, one held out): give more text or a shorter length=N."
        )
    n_eval = max(1, int(round(len(sequences) * eval_fraction)))
    n_eval = min(n_eval, len(sequences) - 1)
    return sequences[:-n_eval], sequences[-n_eval:]


def mask_tokens(
    input_ids: torch.Tensor, tokenizer, generator: torch.Generator, probability: float = 0.15
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking: 15% of tokens chosen; of those 80% ``[MASK]``, 10% random, 10% kept.

    Returns ``(inputs, labels)`` with labels -100 where nothing is predicted. Special
    tokens are never chosen. Deterministic given ``generator``.
    """
    if tokenizer.mask_token_id is None:
        raise DataError("The tokenizer has no mask token, which masked-LM training needs.")
    labels = input_ids.clone()
    special = torch.zeros_like(input_ids, dtype=torch.bool)
    for token_id in tokenizer.all_special_ids:
        special |= input_ids == token_id
    chosen = (torch.rand(input_ids.shape, generator=generator) < probability) & ~special
    labels[~chosen] = -100
    inputs = input_ids.clone()
    roll = torch.rand(input_ids.shape, generator=generator)
    inputs[chosen & (roll < 0.8)] = tokenizer.mask_token_id
    random_tokens = torch.randint(len(tokenizer), input_ids.shape, generator=generator)
    swap = chosen & (roll >= 0.8) & (roll < 0.9)
    inputs[swap] = random_tokens[swap]
    return inputs, labels
