"""Is the extension worth it? A model's held-out reading of the far range against its baseline.

An extension is worth having only when the model reads a long input better than the source model can
read the same text in pieces (its own window, or chunks averaged): its *baseline*. A :class:`Reading`
holds one model's scores on the two ranges that decide it: the *far* range (what the extension adds:
the last half of the new length, or the new rows below 2x) and the *original* range (the first ``old``
positions, which must not get worse). A :class:`Verdict` compares a reading with the baseline's, and with
its *controls*: the same training without the longer context (the fine-tuned model itself read as the source
is, through its old window or in chunks; or the source fine-tuned at its own length on the same tokens). Part
of any gain is the training on the user's kind of text, which the controls get too: only what the far range
gains over them is the longer context's.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

# the default margins a fine-tune stops at (FinetuneConfig.margin and .tolerance)
MARGIN = 0.03  # the far range must beat the baseline by 3% (of its perplexity; of an accuracy's 1 - accuracy): the readings
# of a check move by 1-2% from one to the next; at 1% the grid's 4 x 192 stopped at 0.988 of its split's baseline and read
# two unseen novels 0.7% and 1.0% worse than the source's window (benchmarks/worth_it.py)
TOLERANCE = 0.02  # the original range may lose at most 2% against the source reading it
MEMORISED = 0.3  # the source reads the held-out far range this much better than the run's best check (30% lower
# perplexity or error), though training improved it: the source may have been trained on it (a ViT fine-tuned at a
# new size on its own pretraining digits: 0.980 for the source, 0.938 for the run, 0.937 against 0.912 on digits
# neither saw)


def far_start(length: int, old_length: int) -> int:
    """The first position of the far range: the last half of ``length``, and never below ``old_length``."""
    return max(old_length, length // 2)


@dataclass(frozen=True)
class Reading:
    """Held-out scores of one model: ``far`` (the far range) and ``original`` (the first ``old`` positions),
    both in ``metric`` (a perplexity, lower is better; or an accuracy, ``higher`` is better). ``parts``: the
    far range task by task, when it is several (an embedding model's passkey and needle, each protocol),
    ``far`` their mean: none may be worse than the baseline's own part (:func:`shortfalls`)."""

    far: float
    original: float
    metric: str = "perplexity"
    higher: bool = False  # higher is better (an accuracy)
    parts: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Point:
    """The reading at one step of a run (the curve a verdict plots), the far range's parts too, and the far range
    of each control read at that check (``controls``: by name; a check reads them only once the baseline is beaten)."""

    step: int
    seconds: float
    far: float
    original: float
    parts: dict[str, float] = field(default_factory=dict)
    controls: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Verdict:
    """A reading against its baseline and its controls: ``worth_it`` when the far range beats the baseline's and
    every control's by ``margin`` (none of its parts worse than theirs) and the original range is within
    ``tolerance`` of the baseline's. ``controls``: by name (how it read: "the same model through a 64-token
    window"), the same training read without the longer context; ``old_length``: the positions without it.
    ``budget``: what the run could spend (None: its steps were fixed); ``curve``: the readings along the run."""

    baseline: Reading
    reading: Reading
    baseline_name: str  # how the baseline reads the text ("the source through its own 512-token window")
    margin: float = MARGIN
    tolerance: float = TOLERANCE
    budget: str | None = None
    curve: list[Point] = field(default_factory=list)
    controls: dict[str, Reading] = field(default_factory=dict)
    old_length: int | None = None
    extension: str = "the longer context"  # what the run gives the model, as the verdict names it ("the larger image")
    whole: str = "with the whole context"  # how the reading reads the far range ("at the new size")

    @property
    def far_ratio(self) -> float:
        """The far range against the baseline's (< 1: better, for a perplexity; > 1 for an accuracy)."""
        return self.reading.far / self.baseline.far if self.baseline.far else math.inf

    @property
    def original_change(self) -> float:
        """The original range's relative change against the baseline's (+0.02: 2% higher)."""
        return self.reading.original / self.baseline.original - 1 if self.baseline.original else math.inf

    @property
    def far_wins(self) -> bool:
        """The far range beats the baseline's by the margin, and none of its parts is worse than the baseline's
        (beyond the tolerance): a mean that wins must not hide a task that loses."""
        return wins(self.reading, self.baseline, self.margin, self.tolerance)

    @property
    def context_loses_to(self) -> str | None:
        """The first control the far range does not beat as it beats the baseline (None: it beats them all): the
        gain is then the training's, not the longer context's."""
        return next((name for name, control in self.controls.items()
                     if not wins(self.reading, control, self.margin, self.tolerance)), None)

    @property
    def has_original(self) -> bool:
        """Whether the run has an original range to keep (a vision tower read at its new size alone has none: its
        reading and the baseline's ``original`` are NaN)."""
        return not (math.isnan(self.reading.original) and math.isnan(self.baseline.original))

    @property
    def original_holds(self) -> bool:
        return not self.has_original or holds(self.reading.original, self.baseline.original, self.tolerance,
                                              higher=self.baseline.higher)

    @property
    def worth_it(self) -> bool:
        return self.far_wins and self.context_loses_to is None and self.original_holds

    @property
    def text(self) -> str:
        """One line: worth it or not yet, with the numbers that say so (the controls' beside the baseline's)."""
        b, r, unit = self.baseline, self.reading, self.baseline.metric
        change = f"{100 * self.original_change:+.1f}%"
        original = f"; original range {_num(r.original)} against {_num(b.original)} ({change})" if self.has_original else ""
        controls = " and ".join(f"{_num(c.far)} for {name}" for name, c in self.controls.items())
        if self.far_wins and self.context_loses_to is not None:
            return (f"the fine-tune helped, {self.extension} did not: far range {unit} {_num(r.far)} {self.whole} "
                    f"against {controls} ({_num(b.far)} for {self.baseline_name}){original}")
        head = "worth it" if self.worth_it else ("not yet worth it" + (" within the budget" if self.budget else ""))
        short = shortfalls(r, b, self.tolerance)
        behind = ", ".join(f"{k} {_num(r.parts[k])} against {_num(b.parts[k])}" for k in short)
        behind = f" (but {behind})" if short else ""
        controls = f" and {controls}" if controls else ""
        return (f"{head}: far range {unit} {_num(r.far)} against {_num(b.far)} for {self.baseline_name}{controls}"
                f"{behind}{original}")

    @property
    def best_far(self) -> float | None:
        """The best far range of the checks after training started (None without any)."""
        trained = [p.far for p in self.curve if p.step > 0]
        return (max if self.baseline.higher else min)(trained) if trained else None

    @property
    def source_memorised(self) -> bool:
        """Not worth it, training improved the far range, yet the source reads it :data:`MEMORISED` better than the
        run's best check: the held-out data may be what the source was trained on, which it reads from memory."""
        best, first = self.best_far, self.curve[0] if self.curve else None
        if self.worth_it or best is None or first is None or first.step != 0:
            return False
        higher = self.baseline.higher
        return beats(best, first.far, 0.0, higher=higher) and beats(self.baseline.far, best, MEMORISED, higher=higher)

    @property
    def advice(self) -> str | None:
        """What to do when the longer context is what fails, or when the held-out data may be the source's own
        training data (None otherwise): the words follow the verdict's line."""
        if self.far_wins and self.context_loses_to:
            if self.extension != Verdict.extension:  # not a length of tokens: an image size
                return f"fine-tune at the old size instead, or train longer: {self.extension} has not paid yet"
            longer = f"longer than {self.old_length} tokens" if self.old_length else "longer than the old length"
            return f"fine-tune at the old length instead, or train longer on documents {longer}"
        if self.source_memorised:
            return (f"the source reads this held-out data far better than any check of the run did "
                    f"({_num(self.baseline.far)} against {_num(self.best_far)} at best): if it was trained on this "
                    "data, the reading tests its memory, not the extension, and no budget will beat it; judge on "
                    "held-out data the source never saw")
        return None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "worth_it": self.worth_it, "text": self.text, "far_ratio": self.far_ratio,
                "original_change": self.original_change, "context_loses_to": self.context_loses_to,
                "source_memorised": self.source_memorised, "advice": self.advice}


def wins(reading: Reading, other: Reading, margin: float, tolerance: float) -> bool:
    """``reading``'s far range beats ``other``'s by ``margin``, and none of its parts is worse than ``other``'s
    same part by more than ``tolerance``."""
    return beats(reading.far, other.far, margin, higher=other.higher) and not shortfalls(reading, other, tolerance)


def beats(value: float, baseline: float, margin: float, *, higher: bool = False) -> bool:
    """``value`` is better than ``baseline`` by ``margin``: for a perplexity, at most ``(1 - margin)`` of it;
    for an accuracy, its error ``1 - value`` at most ``(1 - margin)`` of the baseline's (and above it)."""
    if not (math.isfinite(value) and math.isfinite(baseline)):
        return False
    if higher:
        return value > baseline and (1 - value) <= (1 - margin) * (1 - baseline)
    return value <= (1 - margin) * baseline


def shortfalls(reading: Reading, baseline: Reading, tolerance: float) -> list[str]:
    """The parts of ``reading``'s far range worse than the baseline's same part by more than ``tolerance``
    (two that both fail a task, at its floor, are even)."""
    return [name for name, value in reading.parts.items()
            if name in baseline.parts and not holds(value, baseline.parts[name], tolerance, higher=baseline.higher)]


def holds(value: float, baseline: float, tolerance: float, *, higher: bool = False) -> bool:
    """``value`` is no more than ``tolerance`` worse than ``baseline`` (relative)."""
    if not (math.isfinite(value) and math.isfinite(baseline)):
        return False
    return value >= (1 - tolerance) * baseline if higher else value <= (1 + tolerance) * baseline


def _num(x: float) -> str:
    return f"{x:.3f}" if abs(x) < 10 else f"{x:.1f}"


def plot_verdict(verdict: Verdict, path: Any, reports: dict[str, Any] | None = None) -> Any:
    """The run's curve: the far and original ranges at each held-out check against the baseline's (dashed), and
    the far range's parts, thin, against theirs (dotted), titled with the verdict; with ``reports`` (label:
    :class:`~posextend.scoring.by_position.EvalReport`), a first panel of the score by position (before and after)."""
    from pathlib import Path

    from posextend.scoring.analysis import _pyplot, _save

    plt = _pyplot()
    panels = 2 if reports else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.4), squeeze=False)
    if reports:
        ax = axes[0][0]
        for label, report in reports.items():
            ax.plot([(b.start + b.end - 1) / 2 for b in report.buckets], [getattr(b, report.score) for b in report.buckets],
                    marker="o", label=label)
        first = next(iter(reports.values()))
        if first.old_length:
            ax.axvline(first.old_length, color="grey", linestyle="--", linewidth=1, label=f"old length {first.old_length}")
        ax.set(xlabel=first.axis, ylabel=verdict.baseline.metric, title="held-out score by position")
        ax.legend(fontsize="small")
    ax = axes[0][-1]
    steps = [p.step for p in verdict.curve]
    for name, color in (("far", "tab:red"), ("original", "tab:blue"))[:1 + verdict.has_original]:
        ax.plot(steps, [getattr(p, name) for p in verdict.curve], marker=".", color=color, label=f"{name} range")
        ax.axhline(getattr(verdict.baseline, name), color=color, linestyle="--", linewidth=1,
                   label=f"{name} range, {verdict.baseline_name}")
    for (name, control), marker in zip(verdict.controls.items(), "xv^"):  # read at the checks that beat the baseline
        read = [(p.step, p.controls[name]) for p in verdict.curve if name in p.controls]
        if not read or read[-1][0] != (steps[-1] if steps else None):
            read.append((steps[-1] if steps else 0, control.far))  # the verdict's own reading of it
        ax.plot(*zip(*read), marker=marker, linestyle=":", color="tab:red", label=f"far range, {name}")
    colors = ("C2", "C4", "C5", "C6", "C8", "C9")  # not the ranges' red and blue
    for (name, value), color in zip(verdict.baseline.parts.items(), colors):
        ax.plot(steps, [p.parts.get(name, math.nan) for p in verdict.curve], color=color, linewidth=0.8, label=name)
        ax.axhline(value, color=color, linestyle=":", linewidth=0.8)
    ax.set(xlabel="step", ylabel=verdict.baseline.metric)
    b, r = verdict.baseline, verdict.reading
    far = (f"far {r.far - b.far:+.3f} over the baseline" if b.higher  # an accuracy: a ratio of them means little
           else f"far x{verdict.far_ratio:.3f} of the baseline")
    head = ("worth it" if verdict.worth_it else f"{verdict.extension} did not help" if verdict.context_loses_to
            and verdict.far_wins else "not yet worth it")
    original = f", original {100 * verdict.original_change:+.1f}%" if verdict.has_original else ""
    ax.set_title(f"{head}: {far}{original}", fontsize=10)
    ax.legend(fontsize="x-small")
    return _save(fig, Path(path), plt)
