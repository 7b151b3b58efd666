"""The dual-encoder machinery of a contrastive fine-tune (CLIP-style: two towers whose normalised features meet in one
similarity), apart from what the second input is: the pair loss (:func:`pair_loss`: InfoNCE or SigLIP's sigmoid, as
open_clip's ``ClipLoss`` and ``SigLipLoss``), the principal components Long-CLIP holds short captions to (:func:`pca`),
R@1 retrieval both ways (:func:`directions`, :func:`retrieval`) and by caption length (:func:`length_report`), and captions as token rows: cut (:func:`cut_ids`), in
chunks of whole sentences (:func:`chunk_ids`), padded (:func:`padded`), read to features (:func:`text_features`).

The image-text objective (:mod:`posextend.training.objectives.image_text`) uses it with images; an audio-caption
objective (CLAP: ``ClapModel.get_audio_features``) would use it with audio, its own reader of the other tower being the
only new part.

Example (one training step of a dual encoder ``model`` on a batch whose row ``i`` of each tower is pair ``i``)::

    image = F.normalize(model.get_image_features(pixel_values=pixels), dim=-1)
    text = F.normalize(model.get_text_features(input_ids=ids, attention_mask=mask), dim=-1)
    loss = pair_loss(model, image, text, is_sigmoid(model))
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from posextend.scoring.by_position import Bucket, EvalReport, bucket_edges
from posextend.training.context import RunContext

SIGMOID = ("siglip", "siglip2")  # the families of the sigmoid loss, their text padded to its length
SMOOTHING = 0.1  # Long-CLIP's label smoothing of InfoNCE
SENTENCE = re.compile(r"(?<=[.!?])\s+")  # where a caption's sentences part


def pair_loss(model: torch.nn.Module, image: torch.Tensor, text: torch.Tensor, sigmoid: bool, *,
              scale: torch.Tensor | None = None) -> torch.Tensor:
    """The contrastive loss of ``image`` and ``text`` features (normalised rows; row ``i`` of each is pair ``i``, the
    other rows its in-batch negatives) at ``model``'s own logit scale: symmetric InfoNCE, as open_clip's ``ClipLoss``
    (label smoothing :data:`SMOOTHING`, the scale clamped at 100), or with ``sigmoid`` SigLIP's sigmoid loss (its
    logit bias too), summed over every pair of rows and divided by the rows. ``scale``: InfoNCE's logit scale where
    the model keeps it under a name of its own (CLAP's ``logit_scale_t``; default: ``1 / temperature``, else
    ``logit_scale.exp()``).

    Not transformers' ``return_loss=True``: its CLIP loss has no label smoothing and no clamp, and its SigLIP loss
    sums by rows first (other float rounding); and a forward here reads two captions per image (Long-CLIP's)."""
    inner = inner_model(model)
    if sigmoid:
        logits = text @ image.T * inner.logit_scale.exp() + inner.logit_bias
        signs = 2 * torch.eye(len(text), device=text.device) - 1
        return -F.logsigmoid(signs * logits).sum() / len(text)
    if scale is None:
        scale = 1 / inner.temperature if hasattr(inner, "temperature") else inner.logit_scale.exp()
    logits = scale.clamp(max=100) * image @ text.T
    target = torch.arange(len(text), device=text.device)
    return (F.cross_entropy(logits, target, label_smoothing=SMOOTHING)
            + F.cross_entropy(logits.T, target, label_smoothing=SMOOTHING)) / 2


def pca(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` (rows of features) reduced to its ``k`` principal components and mapped back (Long-CLIP's ``PCA``). The
    components are found without gradient (an SVD's backward divides by gaps between singular values, which a small
    batch's features close: inf, then NaN weights); the gradient reaches the features through the projection."""
    mean = x.mean(0, keepdim=True)
    centred = (x - mean).float()
    with torch.no_grad():
        components = torch.linalg.svd(centred.double(), full_matrices=False)[2][:k].T.to(centred.dtype)
    return (centred @ components @ components.T + mean).to(x.dtype)


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


def length_pools(tokens: Sequence[int], old: int, length: int) -> tuple[list[int], list[int]]:
    """The held-out pairs whose caption (``tokens``: each one's token count) fits the old length, and those longer (all
    in one pool when the run does not extend the text)."""
    if old >= length:
        return list(range(len(tokens))), []
    return [i for i, n in enumerate(tokens) if n <= old], [i for i, n in enumerate(tokens) if n > old]


def length_report(text: torch.Tensor, other: torch.Tensor, tokens: Sequence[int], *, objective: str, metric: str,
                  length: int, old: int, buckets: int) -> EvalReport:
    """Held-out pairs (row ``i`` of the normalised ``text`` and ``other`` features: pair ``i``, its caption ``tokens[i]``
    tokens long) scored by caption length: each pair's R@1 (:func:`retrieval`) among the captions of its pool
    (:func:`length_pools`: short captions among theirs, long among theirs), in ``buckets`` of caption length split at
    ``old`` when the run extends the text."""
    hits, losses = torch.zeros(len(tokens)), torch.zeros(len(tokens))
    for pool in length_pools(tokens, old, length):
        if pool:
            hits[pool], losses[pool] = retrieval(text[pool], other[pool])
    edges = bucket_edges(length + 1, buckets, old_length=old + 1 if old < length else None)
    lengths = torch.tensor(list(tokens))
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        inside = (lengths >= lo) & (lengths < hi)
        n = int(inside.sum())
        if n:
            loss = float(losses[inside].mean())
            rows.append(Bucket(lo, hi, loss, math.exp(min(loss, 50)), n, accuracy=float(hits[inside].mean())))
    loss = float(losses.mean())
    return EvalReport(objective, length, len(tokens), loss, math.exp(min(loss, 50)), len(tokens), rows,
                      old if old < length else None, accuracy=float(hits.mean()), metric=metric,
                      axis="caption tokens", noun="pairs", unit="pairs")


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
    """Token rows padded (with the tokenizer's pad id) to ``width``, and their attention mask. Not ``tokenizer.pad``:
    that pads on the tokenizer's side (left for some), refuses a tokenizer without a pad token (0 here) and cuts
    nothing (a row here is cut at ``width``)."""
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


def in_slices(run: RunContext, fn: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """``fn(**inputs)`` on the run's device, in slices of 64 rows (all at once when training: one graph)."""
    device, n = run.accelerator.device, len(next(iter(inputs.values())))
    step = n if torch.is_grad_enabled() else 64
    return torch.cat([fn(**{k: v[i:i + step].to(device) for k, v in inputs.items()}) for i in range(0, n, step)])


def inner_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model whose ``get_text_features`` and ``get_image_features`` a forward calls (DDP's or peft's inside). Not
    accelerate's ``unwrap_model``: that takes off DDP's and ``torch.compile``'s wrappers, not peft's (LoRA)."""
    inner = getattr(model, "module", model)
    base = getattr(inner, "base_model", None)
    return getattr(base, "model", inner) if base is not None and base is not inner else inner


def is_sigmoid(model: torch.nn.Module) -> bool:  # a SigLIP: the sigmoid loss, its text padded to its length
    return getattr(getattr(inner_model(model), "config", None), "model_type", None) in SIGMOID


def pooled_output(out: Any) -> torch.Tensor:
    """Features from ``get_*_features``: a tensor, or (transformers 5) an output's ``pooler_output``."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output
