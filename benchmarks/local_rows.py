"""A strategy that keeps the source's local attention past the old length: ``keep-local`` (issue 60, item 3).

``interpolate`` puts neighbouring rows closer than any head was trained on, and ``tile`` shows a query in a later
tile keys the source only ever saw as future positions: either way a GPT-2's first-layer previous-token head (the
first half of an induction head) is gone past the old length (``table_causes.previous_token``), and a 180 s
fine-tune does not rebuild it (``uses_context.py``). ``keep-local`` starts from ``tile`` and fits the new
rows (Adam on the rows alone, every weight of the source frozen) so that the source's first layer, reading the
position rows alone, attends from each new position over the keys at the same offsets as it does from an old
position in the second half of its table (:func:`targets`), with a penalty ``weight`` x the rows' squared distance
from ``tile``'s (relative to their size) that keeps them where the later layers can read them.

A prototype for benchmarks, registered on import like ``quality_grid.byparts``: it needs the source's first
layer, not only its table (``params={"source": SRC}``), and knows GPT-2's layout only. Measured, it is not what a
model needs (``uses_context.py``, eighth session): it keeps 0.45 of the head's 0.80 past the old length and copies
a repeated passage soonest, but reads documents worse whole than through its own window (1.00-1.12 at 3,000 and
6,000 steps), while ``interpolate`` given 6,000 steps learns to copy its own way (0.56-0.57).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from table_causes import first_layer_logits  # noqa: E402

import posextend  # noqa: E402
from posextend.tables.strategies import tile  # noqa: E402


def targets(model, old: int, new: int) -> torch.Tensor:
    """[heads, new - old, new]: for each new query ``p``, the source's attention from an old query ``ref`` (cycling
    through ``old // 2 .. old - 1``) put on the keys at the same offsets back, ``p - d`` for ``d <= ref``."""
    with torch.no_grad():
        a = first_layer_logits(model, model.transformer.wpe.weight[:old]).softmax(-1)
    t, half = torch.zeros(a.shape[0], new - old, new), old // 2
    for i, p in enumerate(range(old, new)):
        ref = half + (p - old) % half
        d = torch.arange(ref + 1)
        t[:, i, p - d] = a[:, ref, ref - d]
    return t


@posextend.register_strategy("keep-local", keeps_rows=True,
                             description="tile, then the new rows fitted so that the source's first layer attends "
                                         "from them at the same offsets as from its own (GPT-2; a prototype)")
def keep_local(table: torch.Tensor, new_len: int, *, generator: torch.Generator, source: str, steps: int = 600,
               weight: float = 1.0) -> torch.Tensor:
    """``tile``'s rows, the new ones fitted for ``steps`` Adam steps (lr 3e-3) to :func:`targets` (cross-entropy)
    plus ``weight`` x their squared distance from ``tile``'s over their mean squared norm."""
    model = transformers.AutoModelForCausalLM.from_pretrained(source).eval().float().requires_grad_(False)
    old = table.shape[0]
    if not torch.equal(model.transformer.wpe.weight.to(table.dtype), table):
        raise ValueError(f"keep-local: {source} is not the model whose table is being resized")
    start = tile(table, new_len, generator=generator).float()
    goal, fixed, init = targets(model, old, new_len), start[:old], start[old:]
    scale = init.pow(2).sum(1).mean()
    rows = init.clone().requires_grad_(True)
    opt = torch.optim.Adam([rows], lr=3e-3)
    with torch.enable_grad():
        for _ in range(steps):
            logp = first_layer_logits(model, torch.cat([fixed, rows]))[:, old:].log_softmax(-1).clamp(min=-1e4)
            loss = -(goal * logp).sum(-1).mean() + weight * (rows - init).pow(2).sum(1).mean() / scale
            opt.zero_grad()
            loss.backward()
            opt.step()
    return torch.cat([fixed, rows.detach()]).to(table.dtype)
