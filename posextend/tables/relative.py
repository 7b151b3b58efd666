"""Relative-position tables (SAM's ``rel_pos_h`` / ``rel_pos_w``), resampled as their family does at run time.

A grid's absolute table is resized by a strategy (:mod:`.strategies`); its relative-position companions, one row
per offset between two patches, follow its new side exactly as SAM's ``get_rel_pos`` resamples them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from posextend.errors import CorruptCheckpointError, StrategyError

if TYPE_CHECKING:
    import torch


def resize_relative(table: torch.Tensor, new_len: int) -> torch.Tensor:
    """A relative-position table ``[2 * side - 1, head_dim]`` (SAM's ``rel_pos_h`` / ``rel_pos_w``) resampled to
    ``new_len`` rows exactly as SAM's ``get_rel_pos`` resamples it at run time (linear, ``align_corners=False``,
    no antialias), in float32 and cast back: a model holding the result computes what the source computes on
    inputs of the new size.

    Examples:
        >>> resize_relative(torch.randn(127, 64), 159).shape  # 64x64 -> 80x80
        torch.Size([159, 64])
    """
    import torch
    import torch.nn.functional as F

    if table.dim() != 2 or table.shape[0] < 1 or not isinstance(new_len, int) or new_len < 1:
        raise StrategyError(f"Expected a [rows, dim] relative-position table and a positive length, got shape "
                            f"{tuple(table.shape)} and {new_len!r}.")
    if not torch.isfinite(table.detach().float()).all():
        raise CorruptCheckpointError("A relative-position table already holds NaN/Inf values: the source model is "
                                     "damaged. Re-download or re-save it; nothing was changed.")
    x = table.detach().to("cpu", torch.float32)
    with torch.no_grad():
        out = F.interpolate(x.reshape(1, x.shape[0], -1).transpose(1, 2), size=new_len, mode="linear")
    out = out.reshape(-1, new_len).permute(1, 0)
    return out.to(device=table.device, dtype=table.dtype).contiguous()
