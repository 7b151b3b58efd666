"""Loss and perplexity by position: did the new positions learn anything?

Causal LMs are scored on every next token (credited to the predicted token's position);
masked LMs on 15% masked tokens (BERT masking, a fixed seed so runs compare), repeated
over :data:`ROUNDS` masks: a masked-LM ("pseudo") perplexity.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from posextend.scoring.text import mask_tokens
from posextend.errors import PosExtendError

ROUNDS = 2  # masked LMs: each sequence is scored under this many masks


def reading_device() -> torch.device:
    """Where a model is read outside a fine-tune (``posextend eval``, retrieval): the GPU when there is one."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@contextlib.contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``model`` in eval mode meanwhile (dropout off, batch norms reading their running statistics: ALIGN's), then
    in the mode it was in (a fine-tune reads its model between training steps)."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


@dataclass(frozen=True)
class Bucket:
    start: int  # first position (inclusive)
    end: int  # last position + 1
    loss: float
    perplexity: float
    tokens: int  # what it scored, in its report's ``unit`` (tokens, passages, images …)
    accuracy: float | None = None  # contrastive: retrieval accuracy@1 of passages from this bucket


@dataclass
class EvalReport:
    """Scores by position: overall and per bucket of positions. ``print(report)`` shows them as the table
    ``posextend eval`` prints.

    Attributes:
        objective: the name of the objective that scored (as registered).
        length: the samples' size along ``axis`` (tokens per sequence; an image's height in pixels).
            ``sequences``: samples scored.
        loss: mean loss over every scored item. ``perplexity``: its exponential. ``tokens``: items scored.
        buckets: the same per bucket of ``axis`` (``start`` inclusive, ``end`` exclusive).
        old_length: the length before an extension, when known: the positions from it on are new.
        accuracy: objectives that score by retrieval or classification: their mean accuracy (its numbers, in
            place of perplexity; ``perplexity`` is then only exp(loss)).
        metric: what its numbers are, as reports print it (``"perplexity"``, ``"masked-LM perplexity"`` …).
        axis: what the buckets count, as the table's first column says it: ``"positions"`` (text), ``"px"``
            (an image's height), ``"caption tokens"`` (a caption's length) …
        noun: what ``sequences`` counts, in the plural: ``"sequences"``, ``"documents"``, ``"images"``, ``"pairs"``.
        unit: what ``tokens`` (and each bucket's) counts: ``"tokens"``, ``"passages"``, ``"images"``, ``"pairs"``.
        verdict: whether the extension is worth it on this data (``posextend eval`` of an extended checkpoint).
        context_use: causal LMs read past their old length: whether the model uses its new positions
            (:class:`~posextend.scoring.context_use.ContextUse`; None otherwise).
    """

    objective: str
    length: int
    sequences: int
    loss: float
    perplexity: float
    tokens: int
    buckets: list[Bucket] = field(default_factory=list)
    old_length: int | None = None
    accuracy: float | None = None  # contrastive: mean retrieval accuracy@1
    metric: str = "perplexity"  # what its numbers are, as every report prints it (set by whoever scores)
    axis: str = "positions"  # what the buckets count (set by whoever scores, as metric)
    noun: str = "sequences"  # what the samples are
    unit: str = "tokens"  # what the counts count
    verdict: Any = None  # a Verdict (posextend.scoring.verdict): the far range against the source's own reading
    context_use: Any = None  # causal LMs: a ContextUse (posextend.scoring.context_use): are the new positions used?

    @property
    def score(self) -> str:
        """The field holding its numbers, overall and per bucket: ``accuracy`` (retrieval) or ``perplexity``."""
        return "accuracy" if self.accuracy is not None else "perplexity"

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data (JSON-ready)."""
        return {**asdict(self), "context_use": self.context_use and self.context_use.to_dict()}

    def __str__(self) -> str:
        """The table ``posextend eval`` prints: its score per position bucket (the new range marked), then overall."""
        return f"{self.title} ({self.objective})\n{side_by_side({'': self})}"

    @property
    def title(self) -> str:
        """What was scored, in words: ``16 sequences of 64 tokens``, ``24 images at 32 px``, ``96 pairs, captions up
        to 72 tokens``."""
        if self.axis == "positions":
            return f"{self.sequences} {self.noun} of {self.length} tokens"
        if self.axis.endswith(" tokens"):  # the tokens of a part of each sample (a caption, a source)
            return f"{self.sequences} {self.noun}, {self.axis.removesuffix(' tokens')}s up to {self.length} tokens"
        return f"{self.sequences} {self.noun} at {self.length} {self.axis}"

    def range_perplexity(self, start: int, end: int) -> float:
        """Perplexity over the buckets that lie within positions ``start..end-1`` (token-weighted)."""
        inside = [b for b in self.buckets if b.start >= start and b.end <= end and b.tokens]
        if not inside:
            raise PosExtendError(f"No evaluation bucket lies within positions {start}-{end - 1}.")
        loss = sum(b.loss * b.tokens for b in inside) / sum(b.tokens for b in inside)
        return math.exp(min(loss, 50))


def side_by_side(reports: Mapping[str, EvalReport | None]) -> str:
    """Reports of the same buckets side by side, as text: a column per report (headed by its label and the
    metric), a row per bucket (the new range marked), then ``all``; a report that is None shows ``-``."""
    first = next(r for r in reports.values() if r is not None)
    key = first.score

    def cells(pick) -> list[str]:
        return [_number(getattr(pick(r), key)) if r is not None else "-" for r in reports.values()]

    rows = [[first.axis, *(f"{label} {first.metric}".strip() for label in reports), first.unit]]
    for i, bucket in enumerate(first.buckets):
        mark = " (new)" if first.old_length and bucket.start >= first.old_length else ""
        span = f"{bucket.start}" if bucket.end == bucket.start + 1 else f"{bucket.start}–{bucket.end - 1}"  # one size
        rows.append([f"{span}{mark}", *cells(lambda r: r.buckets[i]), str(bucket.tokens)])
    rows.append(["all", *cells(lambda r: r), str(first.tokens)])
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    aligned = [[cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w) in enumerate(zip(row, widths))]
               for row in rows]
    return "\n".join("  ".join(row) for row in aligned)


def _number(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def far_range_gap(before: EvalReport, after: EvalReport) -> tuple[float, float, int] | None:
    """``(far, original, start)``: ``after``'s perplexity on the far range (the last half of the new
    length, from ``start``) and ``before``'s on the original range (the source model's own
    positions), for a language model extended at least 2x; else None."""
    old = after.old_length
    if after.accuracy is not None or not old or after.length < 2 * old:
        return None
    start = after.length // 2
    edges = [b.start for b in after.buckets]
    start = min((e for e in edges if e >= start), default=None)
    if start is None:
        return None
    try:
        return after.range_perplexity(start, after.length), before.range_perplexity(0, old), start
    except PosExtendError:  # a range without scored tokens (a few masked sentences): nothing to compare
        return None


def bucket_edges(length: int, buckets: int, *, old_length: int | None = None) -> list[int]:
    """Edges of contiguous buckets covering ``0..length-1`` exactly once.

    With ``old_length`` (< length): the original range as one bucket, then the new range
    split into ``buckets - 1`` parts; otherwise ``buckets`` equal parts.
    """
    if buckets < 1:
        raise PosExtendError(f"The number of buckets must be at least 1, got {buckets}.")
    if old_length and 0 < old_length < length and buckets > 1:
        rest = torch.linspace(old_length, length, buckets).round().long().tolist()
        edges = [0, *rest]
    else:
        edges = torch.linspace(0, length, min(buckets, length) + 1).round().long().tolist()
    return sorted(set(edges))


def windows(length: int, window: int | None) -> list[tuple[int, int, int]]:
    """``(first, start, end)`` of each read of a ``length``-token sequence through a sliding ``window``: positions
    ``start..end-1`` are scored by the read of ``first..end-1``. The first read covers ``0..window-1``; each
    later block of half a window is read by the window that ends with it (so with at least half a window of
    context). ``window`` None (or not shorter): one read of the whole sequence."""
    if window is None or window >= length:
        return [(0, 0, length)]
    step = max(1, window // 2)
    return [(0, 0, window)] + [(min(s + step, length) - window, s, min(s + step, length)) for s in range(window, length, step)]


@torch.no_grad()
def position_losses(
    model: torch.nn.Module,
    sequences: torch.Tensor,
    objective: str,
    *,
    tokenizer=None,
    batch_size: int = 4,
    seed: int = 0,
    device: torch.device | str | None = None,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed loss and token count at every position: two ``[L]`` float64 tensors. ``window``: the model
    reads each sequence through a sliding window of that many tokens (:func:`windows`), as a model of that
    length reads a longer text; masked tokens are the same as without a window."""
    device = device or next(model.parameters()).device
    length = sequences.shape[1]
    total = torch.zeros(length, dtype=torch.float64)
    count = torch.zeros(length, dtype=torch.float64)
    generator = torch.Generator().manual_seed(seed)
    reads = windows(length, window)
    with evaluating(model):
        for _ in range(ROUNDS if objective == "masked" else 1):
            for batch in sequences.split(batch_size):
                inputs, labels = (batch, batch) if objective == "causal" else mask_tokens(batch, tokenizer, generator)
                for first, start, end in reads:
                    logits = model(input_ids=inputs[:, first:end].to(device)).logits.float().cpu()
                    losses, chosen = _scored(logits, labels[:, first:end], objective)
                    keep = slice(start - first, end - first)
                    total[start:end] += (losses * chosen)[:, keep].sum(0)
                    count[start:end] += chosen[:, keep].sum(0)
    return total, count


def _scored(logits: torch.Tensor, labels: torch.Tensor, objective: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position losses of one read, and which positions are scored (float64 ``[B, n]`` each): causal,
    each token from the logits before it (not the read's first); masked, the masked tokens."""
    if objective == "causal":
        losses = torch.zeros(labels.shape, dtype=torch.float64)
        losses[:, 1:] = token_losses(logits, labels.roll(-1, 1))[:, :-1].double()
        chosen = torch.ones_like(losses)
        chosen[:, 0] = 0
        return losses, chosen
    return token_losses(logits, labels).double(), (labels != -100).double()


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each token (``[B, n]``; 0 where a label is -100) from ``[B, n, vocab]`` logits, computed
    on rows of the vocabulary: ``cross_entropy`` over a transposed ``[B, vocab, n]`` takes a strided path 3-5x
    slower on a 50k vocabulary."""
    flat = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none",
                           ignore_index=-100)
    return flat.view(labels.shape)


def report_from(
    total: torch.Tensor, count: torch.Tensor, edges: Sequence[int], *, objective: str, sequences: int,
    old_length: int | None = None, metric: str = "perplexity",
) -> EvalReport:
    """The report of per-position losses ``total`` over ``count`` tokens, by the buckets ``edges`` cut.
    ``metric``: what the numbers are (the scoring objective's ``metric``)."""
    buckets = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        n = float(count[lo:hi].sum())
        loss = float(total[lo:hi].sum()) / n if n else float("nan")
        buckets.append(Bucket(lo, hi, loss, math.exp(min(loss, 50)) if n else float("nan"), int(n)))
    n = float(count.sum())
    loss = float(total.sum()) / n if n else float("nan")
    return EvalReport(
        objective=objective, length=len(total), sequences=sequences, loss=loss,
        perplexity=math.exp(min(loss, 50)) if n else float("nan"), tokens=int(n), buckets=buckets,
        old_length=old_length, metric=metric,
    )


def score_model(
    model: torch.nn.Module,
    sequences: torch.Tensor,
    objective: str,
    *,
    tokenizer=None,
    buckets: int = 8,
    old_length: int | None = None,
    batch_size: int = 4,
    seed: int = 0,
) -> EvalReport:
    """Loss and perplexity per position bucket (and overall) of ``model`` on ``sequences``."""
    total, count = position_losses(model, sequences, objective, tokenizer=tokenizer, batch_size=batch_size, seed=seed)
    edges = bucket_edges(sequences.shape[1], buckets, old_length=old_length)
    return report_from(total, count, edges, objective=objective, sequences=len(sequences), old_length=old_length)


def plot_reports(
    reports: dict[str, EvalReport], path: str | Path, *, reference: float | None = None,
    styles: dict[str, dict[str, Any]] | None = None,
) -> Path:
    """Perplexity against position (bucket centres), old length marked; one line per report.

    ``reference`` draws a horizontal line (e.g. the original model at its own length);
    ``styles`` passes matplotlib line options per label.
    """
    from posextend.scoring.analysis import _pyplot, _save

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9.5 if len(reports) > 3 else 7.5, 4.6))
    old = None
    for label, report in reports.items():
        xs = [(b.start + b.end - 1) / 2 for b in report.buckets]
        ys = [getattr(b, report.score) for b in report.buckets]  # accuracy where it scores so (not exp(loss))
        ax.plot(xs, ys, marker="o", label=label, **(styles or {}).get(label, {}))
        old = old or report.old_length
    if old:
        ax.axvline(old, color="grey", linestyle="--", linewidth=1, label=f"old length {old}")
    if reference is not None:
        ax.axhline(reference, color="black", linestyle=":", linewidth=1, label=f"original model: {reference:.1f}")
    first = next(iter(reports.values()))
    ax.set_xlabel(first.axis)
    ax.set_ylabel(first.metric)
    if first.score == "perplexity":
        ax.set_yscale("log")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small") if len(reports) > 3 else ax.legend()
    return _save(fig, Path(path), plt)
