"""A vision tower's forward pass read (:func:`forward`, :func:`features`: pooled embedding, patch grid, logits) and the
losses between two readings: :func:`match` (student against teacher), :func:`divergence` (KL of a head's outputs) and
:func:`information` (SHOT's information maximisation)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Features:
    """A forward pass's pooled embedding ``[B, D]``, patch features ``[B, D, h, w]`` (None when the output holds no
    grid) and classification logits ``[B, C]`` (None without a head)."""

    pooled: torch.Tensor
    patches: torch.Tensor | None
    logits: torch.Tensor | None


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
