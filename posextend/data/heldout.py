"""The held-out part of a fine-tune's data: whole items (documents, pairs, images), a few percent, seeded, never
trained on.

The verdict (:mod:`posextend.scoring.verdict`) is only honest on data the run never saw: :func:`split_documents`
sets documents (or pairs) aside before anything is cut into samples, :func:`split_images` images, by class, and
:func:`split_items` items of any other kind (a plug-in's reader: audio clips …).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from posextend.errors import DataError

if TYPE_CHECKING:
    from posextend.data.images import ImageData

SHARE = 0.05  # of the data's characters held out by default
MOST = 0.4  # never more than this share (a small corpus: the tail of a document)
WHOLE = 0.25  # a document too long for the share is still held out whole up to this share of the data (a novel of
# four: 15%), so that the verdict reads text the run never saw; a larger one would cost the run too much of its data


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
    characters (at least ``least`` characters, at most :data:`MOST` of them) are. Where that falls short and the
    data has several documents, the smallest one that fits under :data:`WHOLE` is held out whole too: a model judged
    on the tail of a document it trained on reads names and people it learned there, and a longer context helps it
    there more than on text it never saw. Only where no whole document fits (one long document, or a few of a size)
    a text document gives its tail (cut at a paragraph; :func:`held_out_note` says so). Records of pairs are held out whole.
    Every document keeps its order in ``train``."""
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
            whole = _smallest_whole(documents, sizes, train, taken, total)
            if whole is not None:
                held.append(documents[whole])
                train[whole] = None
                taken += sizes[whole]
                continue
            at = _cut(document, sizes[i] - int(need))
            train[i], tail = document[:at], document[at:]
            held.append(tail)
            taken += len(tail)
        elif train[i] is not None:
            held.append(document)
            train[i] = None
            taken += sizes[i]
    train = [d for d in train if d is not None and _size(d)]
    if not train or not held:
        raise DataError(f"The data holds {len(documents)} document(s) of {total} characters in all: too little to "
                        "hold some out for judging the extension and train on the rest. Give more text, or "
                        "held-out text of its own.")
    return train, held


def _smallest_whole(documents: Sequence[Any], sizes: list[int], train: list[Any], taken: int, total: int) -> int | None:
    """The smallest text document still in ``train`` that can be held out whole: the held-out share stays within
    :data:`WHOLE` of the data and another document is left to train on; None when none can."""
    left = [i for i, d in enumerate(train) if d is not None]
    fits = [i for i in left if isinstance(documents[i], str) and train[i] is documents[i]
            and taken + sizes[i] <= WHOLE * total and len(left) > 1]
    return min(fits, key=lambda i: sizes[i], default=None)


def held_out_note(documents: Sequence[Any], held: Sequence[Any]) -> str:
    """One line on what the verdict was judged on: whole documents the run never trains on, or the tail of a
    document whose beginning it trains on (with what to give instead); empty for data other than text."""
    if not all(isinstance(d, str) for d in documents):
        return ""
    tails = [h for h in held if isinstance(h, str) and any(d is not h and isinstance(d, str) and len(d) > len(h)
                                                             and d.endswith(h) for d in documents)]
    if tails:
        return (f"held out: the tail of a document the run trains on the rest of (its last {sum(map(len, tails)):,} "
                "characters: its names and people are in the training text, so the verdict may be kinder than on text "
                "the model never saw): give held-out text of other documents to judge on text it never saw")
    return f"held out: {len(held)} whole document(s) ({sum(_size(h) for h in held):,} characters), never trained on"


def split_images(data: ImageData, *, share: float = SHARE, least: int = 0, seed: int = 0
                 ) -> tuple[ImageData, ImageData]:
    """``(train, held_out)``: a seeded ``share`` of the items (at least ``least``, and one; never more than
    :data:`MOST` of them) held out whole. With labels each class gives its share
    (largest remainders first), so the held-out part has the classes in proportion. Both keep the data's order.

    Raises:
        DataError: too few items to hold one out and train on the rest.
    """
    n = len(data)
    want = _held_count(n, share, least)
    if want < 1:
        raise DataError(f"The image data ({data.source}) holds {n} item(s): too few to hold some out for judging "
                        "the fine-tune and train on the rest. Give more images, or held-out images of their own.")
    # not datasets' train_test_split(stratify_by_column=): a seed holds out the images it always has, a class of one too
    order = random.Random(seed).sample(range(n), n)  # a seeded shuffle
    held = set(_stratified(order, data.dataset["label"][:], want) if data.has_labels else order[:want])
    return data.select([i for i in range(n) if i not in held]), data.select(sorted(held))


def split_items(items: Sequence[Any], *, share: float = SHARE, least: int = 0, seed: int = 0
                ) -> tuple[list[Any], list[Any]]:
    """``(train, held_out)`` of items of any kind a reader returns (:class:`posextend.data.Items`: audio clips …),
    drawn as :func:`split_images` draws images without labels; raises :class:`DataError` for too few items."""
    n = len(items)
    want = _held_count(n, share, least)
    if want < 1:
        raise DataError(f"The data holds {n} item(s): too few to hold some out for judging the fine-tune and train on "
                        "the rest. Give more, or held-out data of its own.")
    held = set(random.Random(seed).sample(range(n), n)[:want])
    return [items[i] for i in range(n) if i not in held], [items[i] for i in sorted(held)]


def _held_count(n: int, share: float, least: int) -> int:
    """How many of ``n`` items a split holds out: ``share`` of them, at least ``least`` and one, at most :data:`MOST`."""
    return min(max(1, round(share * n), least), math.floor(MOST * n))


def _stratified(order: list[int], labels: list[int | None], want: int) -> list[int]:
    """``want`` items of ``order`` (shuffled): each label's share of them, its first items in ``order``."""
    groups: dict[int | None, list[int]] = {}
    for i in order:
        groups.setdefault(labels[i], []).append(i)
    quota = {label: want * len(items) / len(order) for label, items in groups.items()}
    take = {label: math.floor(q) for label, q in quota.items()}
    for label in sorted(groups, key=lambda label: take[label] - quota[label])[: want - sum(take.values())]:
        take[label] += 1
    return [i for label, items in groups.items() for i in items[: take[label]]]
