"""The label-free objective's augmentation: images moved by a few pixels (FixMatch's weak augmentation), each sample's
moves drawn by its own generator, and the patch features moved back onto the unmoved grid."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from posextend.training.towers.features import Features


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
