"""How the ``image-text`` objective (:mod:`posextend.training.objectives.image_text`) reads pairs: captions as token
rows (cut, in chunks, padded), their short captions (Long-CLIP's first sentences) and the original range's pairs among
them, features of texts and images, R@1 retrieval, and an image processor at another size."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from posextend.training.context import RunContext

SIGMOID = ("siglip", "siglip2")  # the families of the sigmoid loss, their text padded to its length


SENTENCE = re.compile(r"(?<=[.!?])\s+")  # where a caption's sentences part


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


def inner_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model whose ``get_text_features`` and ``get_image_features`` a forward calls (DDP's or peft's inside)."""
    inner = getattr(model, "module", model)
    base = getattr(inner, "base_model", None)
    return getattr(base, "model", inner) if base is not None and base is not inner else inner


def is_sigmoid(model: torch.nn.Module) -> bool:  # a SigLIP: the sigmoid loss, its text padded to its length
    return getattr(getattr(inner_model(model), "config", None), "model_type", None) in SIGMOID


def first_sentence(caption: str) -> str:
    """Long-CLIP's short caption: the caption's first sentence."""
    return SENTENCE.split(caption.strip(), maxsplit=1)[0]


def pooled_output(out: Any) -> torch.Tensor:
    """Features from ``get_*_features``: a tensor, or (transformers 5) an output's ``pooler_output``."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def caption_texts(pairs: Pairs) -> list[str]:  # the captions alone (ImageData's column: no image decoded)
    return list(pairs.data.dataset["text"]) if hasattr(pairs.data, "dataset") else [d["text"] for d in pairs.data]


def by_length(pairs: Pairs, old: int, length: int) -> tuple[list[int], list[int]]:
    """The held-out pairs whose caption fits the old length, and those longer (all in one pool when not extended)."""
    if old >= length:
        return list(range(len(pairs))), []
    return [i for i, n in enumerate(pairs.tokens) if n <= old], [i for i, n in enumerate(pairs.tokens) if n > old]


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


def cut_ids(tokenizer: Any, texts: list[str], length: int) -> list[list[int]]:
    """Each caption's token ids (its special tokens included), cut at ``length``."""
    return tokenizer(texts, truncation=True, max_length=length)["input_ids"]


def chunk_ids(tokenizer: Any, texts: list[str], length: int) -> tuple[list[list[int]], list[int]]:
    """Each caption in chunks of whole sentences of at most ``length`` tokens (a longer sentence cut in windows),
    each framed by the tokenizer's special tokens; and the caption each chunk belongs to."""
    full, bare = tokenizer("a")["input_ids"], tokenizer("a", add_special_tokens=False)["input_ids"]
    at = next(i for i in range(len(full)) if full[i:i + len(bare)] == bare)
    head, tail = full[:at], full[at + len(bare):]
    room = max(1, length - len(head) - len(tail))
    rows, owner = [], []
    for k, text in enumerate(texts):
        current: list[int] = []
        for sentence in SENTENCE.split(text.strip()):
            ids = tokenizer((" " if current else "") + sentence, add_special_tokens=False)["input_ids"]
            if current and len(current) + len(ids) > room:
                rows.append(current)
                current = []
            current += ids
            while len(current) > room:
                rows.append(current[:room])
                current = current[room:]
        rows += [current] if current else []
        owner += [k] * (len(rows) - len(owner))
    return [head + row + tail for row in rows], owner


def padded(tokenizer: Any, rows: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows padded (with the tokenizer's pad id) to ``width``, and their attention mask."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = torch.as_tensor(row[:width]), 1
    return ids, mask


def mask_kwargs(tokenizer: Any, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The attention mask as a keyword, where the tokenizer makes one (SigLIP's reads its padding unmasked)."""
    return {"attention_mask": mask} if "attention_mask" in getattr(tokenizer, "model_input_names", ()) else {}


def text_features(run: RunContext, model: torch.nn.Module, rows: list[list[int]], length: int,
                   owner: list[int] | None = None) -> torch.Tensor:
    """Normalised text features of token rows (padded as the family reads them: SigLIP to ``length``); with
    ``owner``, the mean of each caption's chunks, normalised (chunk-and-average)."""
    tokenizer, inner = run.processor.tokenizer, inner_model(model)
    ids, mask = padded(tokenizer, rows, length if is_sigmoid(model) else max(len(r) for r in rows))

    def features(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return pooled_output(inner.get_text_features(input_ids=x, **mask_kwargs(tokenizer, m)))

    text = F.normalize(in_slices(run, features, {"x": ids, "m": mask}), dim=-1)
    if owner is None:
        return text
    index = torch.as_tensor(owner, device=text.device)
    summed = torch.zeros(int(index.max()) + 1, text.shape[1], device=text.device).index_add_(0, index, text.float())
    return F.normalize(summed, dim=-1)


def image_inputs(image_processor: Any, images: list[Any]) -> dict[str, torch.Tensor]:
    """What the image processor makes of ``images`` for the model (pixels; SigLIP2's masks and patch grids too)."""
    return {k: v for k, v in image_processor(images, return_tensors="pt").items() if isinstance(v, torch.Tensor)}


def in_slices(run: RunContext, fn: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """``fn(**inputs)`` on the run's device, in slices of 64 rows (all at once when training: one graph)."""
    device, n = run.accelerator.device, len(next(iter(inputs.values())))
    step = n if torch.is_grad_enabled() else 64
    return torch.cat([fn(**{k: v[i:i + step].to(device) for k, v in inputs.items()}) for i in range(0, n, step)])


def directions(text: torch.Tensor, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each pair's R@1 text→image and image→text; a tie at the top shares the hit (ties of identical inputs)."""
    sim = (text.float() @ image.float().T).cpu()
    top = [s >= s.max(1, keepdim=True).values for s in (sim, sim.T)]
    return tuple(t.diagonal().float() / t.sum(1) for t in top)


def retrieval(text: torch.Tensor, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each pair's R@1 (text→image and image→text averaged) and its InfoNCE loss at scale 100, in this pool."""
    t2i, i2t = directions(text, image)
    logits = 100 * (text.float() @ image.float().T).cpu()
    target = torch.arange(len(text))
    loss = (F.cross_entropy(logits, target, reduction="none") + F.cross_entropy(logits.T, target, reduction="none")) / 2
    return (t2i + i2t) / 2, loss


def image_pixels(image_processor: Any) -> tuple[int, int] | None:
    """The (height, width) of the images ``image_processor`` makes: its crop, else its size (a shortest edge: square)."""
    data = image_processor.to_dict()
    size = data.get("crop_size") if data.get("do_center_crop") and data.get("crop_size") else data.get("size")
    size = {"height": size, "width": size} if isinstance(size, int) else size or {}
    side = size.get("shortest_edge")
    return (int(size["height"]), int(size["width"])) if size.get("height") and size.get("width") else \
        (int(side), int(side)) if side else None


def sized(image_processor: Any, size: tuple[int, int]) -> Any:
    """A copy of ``image_processor`` making images of ``size`` (height, width), its settings changed as ``resize-model``
    writes them (:func:`posextend.resize.writer.processor_config`)."""
    from posextend.resize.writer import processor_config

    current = image_pixels(image_processor)
    if current is None or tuple(current) == tuple(size):
        return image_processor
    data = image_processor.to_dict()
    changed = processor_config({k: data[k] for k in ("size", "crop_size") if data.get(k)}, current, tuple(size))
    return type(image_processor).from_dict({**data, **changed})
