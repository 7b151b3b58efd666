"""The held-out part of a fine-tune's data: whole documents, a few percent, seeded, never trained on.

The verdict (:mod:`posextend.scoring.verdict`) is only honest on text the run never saw:
:func:`split_documents` sets documents aside before anything is cut into samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from posextend.errors import DataError

SHARE = 0.05  # of the data's characters held out by default
MOST = 0.4  # never more than this share (a small corpus: the tail of a document)


def _size(document: Any) -> int:
    return len(document) if isinstance(document, str) else sum(len(str(part)) for part in document)


def _cut(text: str, keep: int) -> int:
    """Where to cut ``text`` so that about ``keep`` characters stay before the cut: at a paragraph, line or
    word boundary near it."""
    for mark in ("\n\n", "\n", " "):
        at = text.rfind(mark, max(0, keep - 2000), keep)
        if at > 0:
            return at + len(mark)
    return keep


def split_documents(documents: Sequence[Any], *, least: int = 0, share: float = SHARE, seed: int = 0
                    ) -> tuple[list[Any], list[Any]]:
    """``(train, held_out)``: documents in a seeded order are held out whole until ``share`` of the
    characters (at least ``least`` characters, at most :data:`MOST` of them) are; a text document that
    would overshoot by more than half gives only its tail (cut at a paragraph), so one long document
    splits too. Records of pairs are held out whole. Every document keeps its order in ``train``."""
    sizes = [_size(d) for d in documents]
    total = sum(sizes)
    want = min(max(share * total, least), MOST * total)
    order = torch.randperm(len(documents), generator=torch.Generator().manual_seed(seed)).tolist()
    train: list[Any] = list(documents)
    held: list[Any] = []
    taken = 0
    for i in order:
        need = want - taken
        if need <= 0:
            break
        document = documents[i]
        if isinstance(document, str) and sizes[i] > 2 * need:
            at = _cut(document, sizes[i] - int(need))
            train[i], tail = document[:at], document[at:]
            held.append(tail)
            taken += len(tail)
        else:
            held.append(document)
            train[i] = None
            taken += sizes[i]
    train = [d for d in train if d is not None and _size(d)]
    if not train or not held:
        raise DataError(f"The data holds {len(documents)} document(s) of {total} characters in all: too little to "
                        "hold some out for judging the extension and train on the rest. Give more text, or "
                        "held-out text of its own.")
    return train, held
