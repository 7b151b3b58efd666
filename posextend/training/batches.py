"""Which samples each micro-batch holds: a pure function of the seed, the global sample number and the pass over
the data, so that a run is the same on any number of processes and resumes on any number of them.

Sample ``p`` is item ``order(epoch = p // n)[p % n]`` of the objective's ``n`` samples (:func:`batch_indices`);
samples that are windows of one stream of tokens are cut at another offset on each later pass
(:func:`epoch_offset`)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch


@functools.lru_cache(maxsize=8)
def _epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))


def batch_positions(k: int, batch_size: int, processes: int = 1, process: int = 0) -> range:
    """Global sample numbers of micro-batch ``k`` on process number ``process``.

    Sample ``p`` is sequence ``order(epoch = p // n)[p % n]``; its random choices (masks) are
    drawn from a generator seeded by ``(seed, p)``. So a run is the same function of its
    global batch whatever the number of processes, and resumes on any number of them.
    """
    start = (k * processes + process) * batch_size
    return range(start, start + batch_size)


def batch_indices(k: int, batch_size: int, n: int, seed: int, processes: int = 1, process: int = 0) -> torch.Tensor:
    """Sequence indices of micro-batch ``k`` on process number ``process``: a pure function of its arguments."""
    return torch.stack([_epoch_order(n, seed, p // n)[p % n] for p in batch_positions(k, batch_size, processes, process)])


@functools.lru_cache(maxsize=64)
def epoch_offset(length: int, seed: int, epoch: int) -> int:
    """Where pass ``epoch`` over the data cuts its stream of tokens into samples of ``length``: at 0 in the
    first pass, then at a seeded offset in 1 … length-1, so that on later passes each text sits at other
    positions. Trained on the same text at the same positions pass after pass, the far range gets worse on
    unseen text while the original range still improves: the grid's 2 × 128 GPT-2 in 15 minutes (19 passes)
    read *Emma*'s far range 1.37× worse than the source through its own window; cut anew each pass, 0.95×
    (``benchmarks/worth_it.py``)."""
    if epoch == 0 or length < 2:
        return 0
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch + 7_919)
    return int(torch.randint(1, length, (1,), generator=generator))


def batch_rows(k: int, batch_size: int, samples: torch.Tensor | Sequence[Any], seed: int, processes: int = 1,
               process: int = 0, *, stream: bool = True) -> torch.Tensor | list[Any]:
    """The samples of micro-batch ``k`` on process number ``process``: rows of ``samples`` in the order of
    :func:`batch_indices` (a tensor's rows, or a list of the items of any other sequence); when the rows are
    consecutive windows of one stream of tokens (``stream``, 2-D ``samples``), each pass after the first cuts them at
    its :func:`epoch_offset` (the last one wraps round to the stream's start). A pure function of its arguments,
    as the order is."""
    n = len(samples)
    indices = batch_indices(k, batch_size, n, seed, processes, process)
    if not isinstance(samples, torch.Tensor):
        return [samples[int(i)] for i in indices]
    if not stream or samples.dim() != 2:
        return samples[indices]
    length, flat = samples.shape[1], samples.reshape(-1)
    rows = []
    for p in batch_positions(k, batch_size, processes, process):
        epoch = p // n
        start = int(_epoch_order(n, seed, epoch)[p % n]) * length + epoch_offset(length, seed, epoch)
        end = start + length
        rows.append(flat[start:end] if end <= flat.numel() else torch.cat([flat[start:], flat[: end - flat.numel()]]))
    return torch.stack(rows)
