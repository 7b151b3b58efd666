"""How the ``image-text`` objective (:mod:`posextend.training.objectives.image_text`) holds image-caption pairs: the
pairs with their captions' token counts, the short captions (Long-CLIP's first sentences) and the original range's pairs
among them, and the images as the model's inputs. The dual-encoder machinery it reads them with (pair loss, R@1,
captions as token rows): :mod:`posextend.training.objectives.dual_encoder`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from posextend.training.objectives.dual_encoder import SENTENCE, cut_ids, length_pools


class Pairs(Sequence):
    """Image-caption pairs as a run trains on them: item ``i`` is the data's item with ``tokens``, its caption's
    token count (specials included, at most the run's length)."""

    def __init__(self, data: Sequence[dict[str, Any]], tokens: list[int]):
        self.data, self.tokens = data, tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index):
        if isinstance(index, slice):
            picked = range(len(self))[index]
            return Pairs(self.data[picked.start:picked.stop:picked.step], self.tokens[index])
        return {**self.data[index], "tokens": self.tokens[index]}


def first_sentence(caption: str) -> str:
    """Long-CLIP's short caption: the caption's first sentence."""
    return SENTENCE.split(caption.strip(), maxsplit=1)[0]


def caption_texts(pairs: Pairs) -> list[str]:  # the captions alone (ImageData's column: no image decoded)
    return list(pairs.data.dataset["text"]) if hasattr(pairs.data, "dataset") else [d["text"] for d in pairs.data]


def by_length(pairs: Pairs, old: int, length: int) -> tuple[list[int], list[int]]:
    """The held-out pairs whose caption fits the old length, and those longer (all in one pool when not extended)."""
    return length_pools(pairs.tokens, old, length)


def distinct_shorts(tokenizer: Any, texts: list[str], old: int) -> tuple[list[int], list[list[int]]]:
    """The original range: each caption's short caption (its first sentence, Long-CLIP's, cut at the ``old`` length),
    one pair for each distinct one (the first that has it), and their token rows. Images that share a short caption
    cannot be told apart by it: retrieval among them sits at its ceiling whatever the model has lost."""
    rows = cut_ids(tokenizer, [first_sentence(t) for t in texts], old)
    first: dict[tuple[int, ...], int] = {}
    for i, row in enumerate(rows):
        first.setdefault(tuple(row), i)
    kept = sorted(first.values())
    return kept, [rows[i] for i in kept]


def image_inputs(image_processor: Any, images: list[Any]) -> dict[str, torch.Tensor]:
    """What the image processor makes of ``images`` for the model (pixels; SigLIP2's masks and patch grids too)."""
    return {k: v for k, v in image_processor(images, return_tensors="pt").items() if isinstance(v, torch.Tensor)}
