"""What a fine-tune reads of a vision tower (:mod:`posextend.training.objectives.vision`): a forward pass's pooled
embedding, patch grid and classification logits (:func:`features`), how far one reading is from another's
(:func:`match`), k-nearest-neighbour accuracy and cross-resolution agreement of embeddings, a classifier's classes by
name (:func:`label_map`, :func:`replace_head`, :class:`NewHead`), and an image processor's output size
(:func:`set_size`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F

from posextend.errors import TrainingError
from posextend.training.loading import Loaded

NEIGHBOURS = 10  # k of the k-NN accuracy (weighted votes at DINO's temperature)
TEMPERATURE = 0.07
NEW_HEAD = "_posextend_new_head"  # set on a model (and so on its copies) whose head was made for the data's classes


@dataclass(frozen=True)
class Features:
    """A forward pass's pooled embedding ``[B, D]``, patch features ``[B, D, h, w]`` (None when the output holds no
    grid) and classification logits ``[B, C]`` (None without a head)."""

    pooled: torch.Tensor
    patches: torch.Tensor | None
    logits: torch.Tensor | None


def label_map(names: Sequence[str] | None, config: Any) -> list[int] | None:
    """The model's class id of each of ``names`` (the data's classes), matched by name in ``config.id2label``
    (case, ``_`` and ``-`` aside; a label's comma-separated aliases count: ``"tench, Tinca tinca"``); None when
    one of them is not there, or two share an id."""
    if not names:
        return None
    own: dict[str, int] = {}
    for i, label in sorted((int(k), v) for k, v in (getattr(config, "id2label", None) or {}).items()):
        for alias in str(label).split(","):
            own.setdefault(_plain(alias), i)
    ids = [own.get(_plain(n)) for n in names]
    return None if None in ids or len(set(ids)) < len(ids) else ids  # type: ignore[return-value]


def _plain(name: str) -> str:
    return " ".join(str(name).lower().replace("_", " ").replace("-", " ").split())


class NewHead(Loaded):
    """A loaded classifier whose head is replaced by one for the data's classes once the fine-tune has observed where
    its tensors sit in the checkpoint's files (``files`` set): the writer then writes the new head, of another shape,
    under the old one's names. (Replaced before, the head's names would hold other values than the files: refused.)"""

    def __init__(self, base: Loaded, swap: Any):
        self._swap, self._files = swap, None
        super().__init__(**{f.name: getattr(base, f.name) for f in fields(Loaded)})

    @property
    def files(self):  # type: ignore[override]
        return self._files

    @files.setter
    def files(self, value) -> None:
        self._files = value
        if value is not None and self._swap is not None:
            self._swap()
            self._swap = None


def replace_head(model: torch.nn.Module, names: Sequence[str]) -> list[str]:
    """Give an image classifier a head for ``names`` in place: each linear layer outside its base model that has one
    output per class (DeiT's two) becomes a new one with one per name, initialised as the family initialises it; the
    config's labels follow. Returns the layers replaced."""
    base = getattr(model, "base_model", model)
    old = model.config.num_labels
    replaced = []
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear) and module.out_features == old and not _inside(base, model, name):
            new = torch.nn.Linear(module.in_features, len(names), bias=module.bias is not None)
            model._init_weights(new)
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, new)
            replaced.append(name)
    if not replaced:
        raise TrainingError(f"{type(model).__name__} has no linear head of {old} classes to replace.")
    model.config.id2label = dict(enumerate(names))
    model.config.label2id = {n: i for i, n in enumerate(names)}
    if hasattr(model, "num_labels"):
        model.num_labels = len(names)
    return replaced


def _inside(base: torch.nn.Module, model: torch.nn.Module, name: str) -> bool:
    prefix = next((n for n, m in model.named_modules() if m is base and n), None)
    return prefix is not None and (name == prefix or name.startswith(prefix + "."))


def forward(model: torch.nn.Module, unwrapped: torch.nn.Module, pixels: torch.Tensor, **kwargs: Any
             ) -> tuple[Any, Any]:
    """``model``'s output on ``pixels`` and its base model's (captured by a hook: one forward pass)."""
    base = getattr(unwrapped, "base_model", unwrapped)
    seen: dict[str, Any] = {}
    hook = base.register_forward_hook(lambda m, i, o: seen.setdefault("out", o)) if base is not unwrapped else None
    try:
        out = model(pixel_values=pixels, **kwargs)
    finally:
        if hook is not None:
            hook.remove()
    return out, seen.get("out", out)


def features(out: Any, base: Any, grid: tuple[int, int], images: int) -> Features:
    """The pooled embedding (the base model's ``pooler_output``, else its first prefix token, else the patches'
    mean), the patch features on a ``grid`` of patches (the last hidden state less its prefix tokens; a
    ``[B, D, h, w]`` or ``[B, h, w, D]`` one as it is) and the logits of a classification head, of ``images``
    images. A hidden state or pooled output whose first dimension is not the images' (a pixel shuffle's tokens) is
    read as one row of tokens per image."""
    hidden = getattr(base, "last_hidden_state", None)
    if hidden is None:
        hidden = base[0] if isinstance(base, (tuple, list)) else base
    if hidden.shape[0] != images:
        hidden = hidden.reshape(images, -1, hidden.shape[-1])
    patches, prefix = _patch_grid(hidden, grid)
    pooled = getattr(base, "pooler_output", None)
    if isinstance(pooled, torch.Tensor) and pooled.dim() == 2 and pooled.shape[0] % images == 0:
        pooled = pooled.reshape(images, -1, pooled.shape[-1]).mean(1)  # tokens of each image (a pixel shuffle's)
    else:
        pooled = (hidden[:, 0] if hidden.dim() == 3 and prefix else patches.mean((2, 3)) if patches is not None
                  else hidden.flatten(1, -2).mean(1))
    logits = getattr(out, "logits", None)
    logits = logits if isinstance(logits, torch.Tensor) and logits.dim() == 2 else None
    return Features(pooled.float(), None if patches is None else patches.float(), logits)


def _patch_grid(hidden: torch.Tensor, grid: tuple[int, int]) -> tuple[torch.Tensor | None, int]:
    h, w = grid
    if hidden.dim() == 4:
        if tuple(hidden.shape[2:]) == (h, w):
            return hidden, 0
        return (hidden.permute(0, 3, 1, 2), 0) if tuple(hidden.shape[1:3]) == (h, w) else (None, 0)
    prefix = hidden.shape[1] - h * w if hidden.dim() == 3 else -1
    if prefix < 0:  # fewer tokens than patches (ViT-MAE drops some): no grid to compare
        return None, 0
    return hidden[:, prefix:].transpose(1, 2).reshape(hidden.shape[0], -1, h, w), prefix


def match(student: Features, teacher: Features) -> torch.Tensor:
    """How far ``student`` (the model at the new size) is from ``teacher`` (the source at its own): one minus the
    cosine of the pooled embeddings, plus the same for each patch of the student's grid resampled to the teacher's
    (area-averaged when larger), plus the KL divergence of the head's outputs from the teacher's, where both have
    one."""
    loss = (1 - F.cosine_similarity(student.pooled, teacher.pooled, dim=-1)).mean()
    if student.patches is not None and teacher.patches is not None:
        size = tuple(teacher.patches.shape[-2:])
        moved = student.patches
        if tuple(moved.shape[-2:]) != size:
            larger = moved.shape[-2] >= size[0] and moved.shape[-1] >= size[1]
            moved = F.adaptive_avg_pool2d(moved, size) if larger else F.interpolate(moved, size=size, mode="bilinear")
        loss = loss + (1 - F.cosine_similarity(moved, teacher.patches, dim=1)).mean()
    if student.logits is not None and teacher.logits is not None and student.logits.shape == teacher.logits.shape:
        loss = loss + divergence(student.logits, teacher.logits)
    return loss


def divergence(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """The KL divergence of a head's outputs ``student`` ``[B, C]`` from ``teacher``'s (per image)."""
    return F.kl_div(student.float().log_softmax(-1), teacher.float().log_softmax(-1), log_target=True,
                    reduction="batchmean")


def information(logits: torch.Tensor) -> torch.Tensor:
    """SHOT's information maximisation (Liang et al., 2020) on a head's outputs ``[B, C]``: the mean entropy of each
    image's prediction (each made sure) less the entropy of the batch's mean prediction (kept spread over the
    classes)."""
    p = logits.float().softmax(-1)
    mean = p.mean(0)
    return -(p * p.clamp_min(1e-8).log()).sum(-1).mean() + (mean * mean.clamp_min(1e-8).log()).sum()


def random_moves(generators: Sequence[torch.Generator], most: tuple[int, int], each: int) -> list[tuple[int, int]]:
    """``each`` moves ``(down, right)`` of up to ``most`` pixels a side from each generator (a sample's): the first
    of every generator's (the samples'), then the others in turn (their batch-mates')."""
    drawn = [[tuple(int(torch.randint(-m, m + 1, (1,), generator=g)) for m in most) for _ in range(each)]
             for g in generators]
    return [d[0] for d in drawn] + [m for d in drawn for m in d[1:]]


def shifted(pixels: torch.Tensor, moves: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Each image of ``pixels`` ``[B, C, H, W]`` moved by its ``(down, right)`` pixels, its edge reflected in
    (FixMatch's weak augmentation)."""
    height, width = pixels.shape[-2:]
    my, mx = max(abs(m[0]) for m in moves), max(abs(m[1]) for m in moves)
    padded = F.pad(pixels, (mx, mx, my, my), mode="reflect")
    return torch.stack([padded[k, :, my - dy:my - dy + height, mx - dx:mx - dx + width]
                        for k, (dy, dx) in enumerate(moves)])


def moved_back(found: Features, moves: Sequence[tuple[int, int]], patch: tuple[int, int]) -> Features:
    """The patch features of :func:`shifted` images moved back onto the unmoved images' grid, to the nearest whole
    patch of ``patch`` pixels (the patches moved in at the edge wrap round)."""
    if found.patches is None:
        return found
    back = torch.stack([found.patches[k].roll((-round(dy / patch[0]), -round(dx / patch[1])), (1, 2))
                        for k, (dy, dx) in enumerate(moves)])
    return Features(found.pooled, back, found.logits)


def knn_accuracy(pooled: torch.Tensor, labels: Sequence[int]) -> float:
    """Leave-one-out k-nearest-neighbour accuracy of embeddings ``pooled`` (cosine; :data:`NEIGHBOURS` votes weighted
    by ``exp(similarity / TEMPERATURE)``, as DINO's k-NN evaluation): each image classified by the others."""
    x = F.normalize(pooled.float(), dim=1)
    y = torch.as_tensor(list(labels))
    similarity = x @ x.T
    similarity.fill_diagonal_(-math.inf)
    k = min(NEIGHBOURS, len(y) - 1)
    top, index = similarity.topk(k, dim=1)
    votes = torch.zeros(len(y), int(y.max()) + 1).scatter_add_(1, y[index], (top / TEMPERATURE).exp())
    return float((votes.argmax(1) == y).float().mean())


def agreement(pooled: torch.Tensor, reference: torch.Tensor) -> float:
    """How often each image's embedding ``pooled`` (the model's) finds the same image's ``reference`` embedding (the
    source's, at its own size) nearest among all of them: top-1 retrieval across the two readings, each centred on its
    mean (a tower's embeddings share a large common part, which plain cosines would measure instead)."""
    x = F.normalize(pooled.float() - pooled.float().mean(0), dim=1)
    y = F.normalize(reference.float() - reference.float().mean(0), dim=1)
    return float(((x @ y.T).argmax(1) == torch.arange(len(x))).float().mean())


def output_size(processor: Any) -> tuple[int, int] | None:
    """The image size ``processor`` makes: its crop when it crops, else its size (a shortest edge: square)."""
    data = processor.to_dict()
    for value in ((data.get("crop_size") if data.get("do_center_crop") else None), data.get("size")):
        if isinstance(value, int) and not isinstance(value, bool):
            return value, value
        if isinstance(value, dict) and value.get("height") and value.get("width"):
            return int(value["height"]), int(value["width"])
        if isinstance(value, dict) and value.get("shortest_edge"):
            return int(value["shortest_edge"]), int(value["shortest_edge"])
    return None


def set_size(processor: Any, old: tuple[int, int], new: tuple[int, int]) -> None:
    """``processor`` (which makes images of ``old`` pixels) made to make them of ``new``, in place, as
    ``resize-model`` writes its ``preprocessor_config.json`` (:func:`posextend.resize.writer.processor_config`)."""
    from posextend.resize.writer import processor_config

    data = processor.to_dict()
    updated = processor_config({k: data[k] for k in ("size", "crop_size") if data.get(k) is not None}, old, new)
    for key, value in updated.items():
        current = getattr(processor, key, None)
        setattr(processor, key, type(current)(**value) if isinstance(value, dict) and hasattr(current, "keys")
                and not isinstance(current, dict) else value)


def resized_copy(model: torch.nn.Module, size: tuple[int, int], strategy: str | None, seed: int) -> torch.nn.Module:
    """A copy of ``model`` (in eval mode) whose image grid is resized in memory to ``size`` (height, width), as
    ``extend_model`` resizes it (shrinking allowed), its messages kept below warnings."""
    import copy
    import logging

    from posextend.resize.in_memory import resize_in_memory
    from posextend.resize.plan import Request

    moved = copy.deepcopy(model).eval()
    quiet = logging.getLogger("posextend.resize.in_memory")
    level, quiet.level = quiet.level, logging.WARNING
    try:
        resize_in_memory(moved, Request(image_size=size, strategy=strategy, allow_shrink=True), seed)
    finally:
        quiet.level = level
    return moved
