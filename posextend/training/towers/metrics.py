"""How well a tower's embeddings read held-out images: leave-one-out k-nearest-neighbour accuracy on their labels, and
top-1 agreement with another reading of the same images (the source's, at its own size)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

NEIGHBOURS = 10  # k of the k-NN accuracy (weighted votes at DINO's temperature)
TEMPERATURE = 0.07


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
