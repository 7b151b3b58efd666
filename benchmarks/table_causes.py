"""Causes of an extended LM's harm, as the no-harm and uses-context benchmarks try them (issue 60, item 1).

- :func:`table_lr`: the position table trained at a multiple of the run's lr (new rows trained on fewer updates
  than old ones).
- :func:`first_layer_logits`: a GPT-2's first-layer attention logits from its position rows alone.
- :func:`previous_token`: how much of each first-layer head's attention goes to the previous token from the
  positions alone (the first half of an induction head), before and past the old length: what a strategy keeps of
  the source's local attention before any training.
- :func:`banded`: a GPT-2's chosen layers made to see only the last ``width`` keys (eager attention), so a reading
  says which layers at the far positions use keys past the old window.
- :func:`entropy_by_position`: the first layer's attention entropy at chosen query positions (how widely it
  spreads: a head that averages its whole prefix grows as the log of the position).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def table_lr(factor: float, rows: int) -> Iterator[None]:
    """Within the block, a fine-tune's optimizer gives the parameter of ``rows`` rows (the resized position
    table; the benchmark's model has one such) ``factor`` x the run's lr."""
    from posextend.training import setup

    adamw = setup._adamw

    def grouped(params, lr):
        params = list(params)
        table = [p for p in params if p.dim() == 2 and p.shape[0] == rows]
        if len(table) != 1:
            raise RuntimeError(f"expected one parameter of {rows} rows, found {len(table)}")
        rest = [p for p in params if p is not table[0]]
        return adamw([{"params": rest, "lr": lr}, {"params": table, "lr": lr * factor}], lr)

    setup._adamw = grouped
    try:
        yield
    finally:
        setup._adamw = adamw


def first_layer_logits(model, rows: torch.Tensor) -> torch.Tensor:
    """[heads, n, n]: a GPT-2's first-layer attention logits from position rows alone (``ln_1``, the query and key
    projections, their scaling), the future masked."""
    block, width, heads = model.transformer.h[0], model.config.n_embd, model.config.n_head
    n = rows.shape[0]
    qkv = block.attn.c_attn(block.ln_1(rows))
    q, k = (qkv[:, i * width:(i + 1) * width].view(n, heads, -1).transpose(0, 1) for i in (0, 1))
    z = q @ k.transpose(1, 2) / math.sqrt(width // heads)
    return z.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)


@torch.no_grad()
def previous_token(model, length: int, old: int, head: int | None = None) -> dict[str, float]:
    """A GPT-2's first-layer heads read from its position rows alone (``ln_1`` of ``wpe``, the query and key
    projections, their scaling, the causal mask): the largest mean softmax weight a head gives position ``p - 1``, over
    ``p < old`` and over ``old <= p < length`` (0 when ``length <= old``), or head ``head``'s (the source's
    previous-token head, read on a resized copy)."""
    heads = model.config.n_head
    scores = first_layer_logits(model, model.transformer.wpe.weight[:length])
    weight = scores.softmax(-1)[:, torch.arange(1, length), torch.arange(length - 1)]  # [heads, length - 1]: on p-1
    near, far = weight[:, : old - 1].mean(1), weight[:, old - 1:].mean(1) if length > old else torch.zeros(heads)
    best = int(near.argmax()) if head is None else head
    return {"head": best, "within": float(near[best]), "past": float(far[best])}


@contextlib.contextmanager
def banded(layers: set[int], width: int) -> Iterator[None]:
    """Within the block, GPT-2 layers ``layers`` (``layer_idx``), read with ``attn_implementation="eager"``,
    attend causally to the last ``width`` keys only (every other layer causally to all); no padding."""
    from transformers.models.gpt2 import modeling_gpt2

    eager = modeling_gpt2.eager_attention_forward

    def within(module, query, key, value, attention_mask, **kwargs):
        n, m = query.shape[-2], key.shape[-2]
        q, k = torch.arange(m - n, m)[:, None], torch.arange(m)[None]
        allowed = (k <= q) & ((q - k < width) if module.layer_idx in layers else True)
        mask = torch.zeros(n, m, dtype=query.dtype, device=query.device).masked_fill(~allowed.to(query.device),
                                                                                      -math.inf)
        return eager(module, query, key, value, mask, **kwargs)

    modeling_gpt2.eager_attention_forward = within
    try:
        yield
    finally:
        modeling_gpt2.eager_attention_forward = eager


@torch.no_grad()
def entropy_by_position(model, seqs: torch.Tensor, positions: list[int]) -> dict[int, float]:
    """The first layer's attention entropy (nats, mean over heads and sequences) at each query position in
    ``positions`` (the model loaded with ``attn_implementation="eager"``)."""
    weights = model(input_ids=seqs, output_attentions=True).attentions[0]  # [B, heads, n, n]
    entropy = -(weights.clamp_min(1e-12).log() * weights).sum(-1).mean((0, 1))
    return {p: float(entropy[p]) for p in positions}
