"""A table's first rows kept as they are while the rest trains: new-rows training (the rows below the old length) and
Long-CLIP's kps rows (:mod:`posextend.training.objectives.image_text`)."""

from __future__ import annotations

import torch


def keep_rows(table: torch.Tensor, keep: int) -> torch.Tensor:
    """Zero the gradient of ``table``'s first ``keep`` rows for as long as it trains (a hook on the tensor: the rows
    from ``keep`` on learn); returns those rows as they are now, a copy. An optimizer may still move a row with zero
    gradient (weight decay, Adam's moments), so a run that must keep them exact writes the copy back after each step."""
    table.register_hook(lambda grad: torch.cat([torch.zeros_like(grad[:keep]), grad[keep:]]))
    return table.detach()[:keep].clone()
