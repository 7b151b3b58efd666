"""How long a fine-tune trains: a fixed number of steps, or a budget spent while its held-out reading improves.

A :class:`Budget` is what a run may spend, as the user thinks of it (``15min``, ``20M tokens``,
``2000 steps``: :func:`parse_budget`). :class:`Schedule` is the lr schedule over the steps the budget
plans (a time is turned into steps once the first steps are timed). :class:`Judge` reads the held-out
far and original ranges as training goes, keeps the best check (the weights a run writes) and says when to stop:
when :data:`PATIENCE` checks in a row found no better reading than the best, or when the budget is spent. The
verdict (:mod:`posextend.scoring.verdict`) is given after, on the best check: a verdict is not a stopping rule
(a run that stopped at its first "worth it" left most of its gain behind).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from posextend.errors import TrainingError
from posextend.scoring.verdict import Point, Reading, Verdict, beats, holds

_UNITS = {"s": 1, "sec": 1, "second": 1, "seconds": 1, "m": 60, "min": 60, "minute": 60, "minutes": 60,
          "h": 3600, "hour": 3600, "hours": 3600}
_SCALE = {"": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "B": 10**9}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKMGB]?)\s*([a-z]*)\s*$")
CHECKS = 20  # held-out checks over a budget (about one per 5% of it), when the run sets no eval_every
CHECK_SHARE = 0.1  # the most of a run's time its checks may take (a time budget plans its steps in the rest)
PROBE_STEPS = 3  # steps timed before a time budget is turned into a number of steps
PATIENCE = 5  # checks in a row without a better reading before a budgeted run stops (a quarter of CHECKS): two
# stopped on a check's noise (label-free vision: 185 s, 0.43 kept aside, against 0.49 for its whole budget)
IMPROVEMENT = 0.005  # a better reading: the far range at least 0.5% better than the best (of a perplexity; of an
# accuracy's error), with the original range within the tolerance


@dataclass(frozen=True)
class Budget:
    """What a run may spend: ``seconds`` of wall-clock, ``tokens`` trained on, or ``steps``; ``text`` as given."""

    text: str
    seconds: float | None = None
    tokens: int | None = None
    steps: int | None = None


def parse_budget(text: str) -> Budget:
    """``15min``, ``1.5h``, ``900s`` (a time); ``20M tokens``, ``500k tokens`` (tokens); ``2000 steps``."""
    match = _PATTERN.match(str(text))
    if match:
        number, scale, unit = float(match[1]), _SCALE[match[2]], match[3]
        if unit in _UNITS and not match[2] and number > 0:
            return Budget(text, seconds=number * _UNITS[unit])
        if unit in ("tokens", "token", "tok") and number * scale >= 1:
            return Budget(text, tokens=int(number * scale))
        if unit in ("steps", "step") and not match[2] and number >= 1 and number == int(number):
            return Budget(text, steps=int(number))
    raise TrainingError(f"Cannot read the budget {text!r}: give a time (15min, 1h, 900s), a number of tokens "
                        "(20M tokens) or of steps (2000 steps).")


@dataclass
class Schedule:
    """The lr factor at each step (a ``LambdaLR`` lambda): a linear warm-up over 10% of ``steps``, then
    ``constant`` or ``cosine`` down to 10%. ``steps`` may be set once the budget is known in steps; being an
    object, it is saved and restored with the scheduler's state."""

    steps: int
    kind: str

    def __call__(self, s: int) -> float:
        warmup = max(1, self.steps // 10)
        if s < warmup or self.kind == "constant":
            return min(1.0, (s + 1) / warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (s - warmup) / max(1, self.steps - warmup))))


@dataclass
class Judge:
    """The run's budget, its held-out checks and its verdict. ``early``: stop once :data:`PATIENCE` checks in a
    row found no better reading than the best (a budget); otherwise the run trains its steps whatever it reads.
    ``keep_best``: the run writes its best check's weights (a budget: :attr:`best`), not its last step's."""

    budget: Budget
    early: bool
    baseline: Reading | None = None
    baseline_name: str = ""
    margin: float = 0.01
    tolerance: float = 0.02
    eval_every: int = 0  # steps between checks (0: by time or steps, CHECKS over the budget)
    tokens_per_step: int = 1
    control_name: str = ""  # how the model's own control reads the text ("the same model through a 64-token window")
    old_length: int | None = None  # the positions without the extension (the verdict's advice names them)
    extension: str = Verdict.extension  # what the run gives the model, as the verdict names it
    whole: str = Verdict.whole  # how the verdict says the far range was read
    controls: dict[str, Reading] = field(default_factory=dict)  # the controls read last, by name (the verdict's)
    controls_step: int | None = None  # the step they were read at
    start: float = field(default_factory=time.perf_counter)
    curve: list[Point] = field(default_factory=list)
    wins: int = 0  # checks in a row whose reading is worth it (against the baseline and the controls read)
    keep_best: bool = False
    best: Point | None = None  # the best check after training started (:meth:`better`)
    since_best: int = 0  # checks since the best one
    checking: float = 0.0  # seconds the checks took so far
    _last_check: float = 0.0

    @property
    def steps(self) -> int | None:
        """The steps the budget allows, when it is known without timing (steps, tokens)."""
        if self.budget.steps is not None:
            return self.budget.steps
        if self.budget.tokens is not None:
            return max(1, math.ceil(self.budget.tokens / self.tokens_per_step))
        return None

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def planned(self, done: int, seconds: float) -> int:
        """The steps a time budget allows, from ``done`` steps that took ``seconds``: what is left of it, less
        a tenth for the held-out checks and the run's ending (:meth:`ending`), at that pace."""
        left = max(0.0, self.budget.seconds - self.elapsed() - self.ending())
        return done + max(1, int(0.9 * left / max(seconds / max(done, 1), 1e-9)))

    def spent(self, step: int) -> bool:
        """The budget is spent after ``step`` steps: a time budget once what is left would not hold the run's
        last reading and evaluation (:meth:`ending`), so that the whole run, loading to writing, keeps to it."""
        if self.budget.seconds is not None:
            return self.elapsed() + self.ending() >= self.budget.seconds
        return step >= (self.steps or 0)

    def ending(self) -> float:
        """The seconds a run needs after its last step: its last reading and its evaluation after, each about as
        long as a check has been (0 before any check)."""
        return 2 * self.checking / len(self.curve) if self.curve else 0.0

    def check_due(self, step: int, planned: int) -> bool:
        """A held-out check is due after ``step`` of ``planned`` steps: every ``eval_every`` steps when set;
        else about :data:`CHECKS` times over the budget, as long as the checks so far took at most
        :data:`CHECK_SHARE` of the run's time (a reading can cost more than many steps: an embedding model's
        retrieval tasks)."""
        if self.baseline is None and not self.eval_every:
            return False
        if self.eval_every:
            return step % self.eval_every == 0
        if self.budget.seconds is not None:
            due = self.elapsed() - self._last_check >= self.budget.seconds / CHECKS
        else:
            due = step % max(1, planned // CHECKS) == 0
        return due and self.checking <= CHECK_SHARE * self.elapsed()

    def check(self, step: int, read: Callable[[], Reading | None],
              control: Callable[[], Reading | None] | None = None) -> bool:
        """:meth:`record` the reading ``read()`` gives after ``step`` (and ``control()``'s, when it is needed),
        timed (the checks' share of the run)."""
        t0 = time.perf_counter()
        reading = read()
        try:
            return self.record(step, reading, control)
        finally:
            self.checking += time.perf_counter() - t0

    def record(self, step: int, reading: Reading | None, control: Callable[[], Reading | None] | None = None) -> bool:
        """Add a check's ``reading`` to the curve; True when the run should stop: the budget allows stopping early
        and :data:`PATIENCE` checks in a row after training started found no better reading than the best
        (:meth:`better`). ``control()``: the model's own reading without its longer context
        (:meth:`Objective.control`), read only when the reading beats the baseline (until then the run is not worth
        it whatever the control reads), and at step 0 it is never read. The reading before training (step 0) is on
        the curve but is never the best: a run writes a trained model."""
        self._last_check = self.elapsed()
        if reading is None:
            return False
        won = self.baseline is not None and self._verdict(reading, {}).worth_it
        if won and step > 0 and control is not None:
            self.read_controls(step, control)
            won = self._verdict(reading, self.controls).worth_it
        read = {k: v.far for k, v in self.controls.items()} if self.controls_step == step else {}
        point = Point(step, round(self.elapsed(), 2), reading.far, reading.original, dict(reading.parts), read)
        self.curve.append(point)
        self.wins = self.wins + 1 if won and step > 0 else 0
        if step == 0:
            return False
        if self.best is None or self.better(point, self.best):
            self.best, self.since_best = point, 0
            return False
        self.since_best += 1
        return self.early and self.since_best >= PATIENCE

    def better(self, point: Point, than: Point) -> bool:
        """``point`` reads better than ``than``: its original range holds (within the tolerance of the baseline's)
        where ``than``'s did not, or both do (or neither) and its far range is better by :data:`IMPROVEMENT`."""
        if self.baseline is None:
            return point.far < than.far
        higher, base = self.baseline.higher, self.baseline.original
        holds_now, held = (not math.isfinite(base) or holds(p.original, base, self.tolerance, higher=higher)
                           for p in (point, than))
        if holds_now != held:
            return holds_now
        return beats(point.far, than.far, IMPROVEMENT, higher=higher)

    def best_reading(self) -> Reading | None:
        """The best check's reading, as the baseline's kind of reading (None before any check after step 0)."""
        return None if self.best is None else self.reading_at(self.best)

    def reading_at(self, point: Point) -> Reading | None:
        """The reading a check on the curve had, as the baseline's kind of reading (None without a baseline)."""
        if self.baseline is None:
            return None
        return dataclasses.replace(self.baseline, far=point.far, original=point.original, parts=dict(point.parts))

    def read_controls(self, step: int, control: Callable[[], Reading | None]) -> None:
        """The model's own control, read after ``step`` (kept with the run's other controls, by name)."""
        reading = control()
        if reading is not None:
            self.controls = {**self.controls, self.control_name: reading}
            self.controls_step = step

    def _verdict(self, reading: Reading, controls: dict[str, Reading], **more) -> Verdict:
        return Verdict(self.baseline, reading, self.baseline_name, margin=self.margin, tolerance=self.tolerance,
                       controls=controls, old_length=self.old_length, extension=self.extension, whole=self.whole,
                       **more)

    def verdict(self, reading: Reading | None, controls: dict[str, Reading] | None = None) -> Verdict | None:
        """The final reading against the baseline and the controls read with it (None without a baseline)."""
        if self.baseline is None or reading is None:
            return None
        return self._verdict(reading, self.controls if controls is None else controls,
                             budget=self.budget.text if self.early else None, curve=list(self.curve))
