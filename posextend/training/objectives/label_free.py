"""The ``vision`` objective without labels (:mod:`posextend.training.objectives.vision`): how it trains and how it is
judged, a mix-in of :class:`~posextend.training.objectives.vision.Vision` (whose readers of held-out images it uses).

Training: the source, frozen, reads each image at its own size and the model at the new one, moved by up to a tenth
of its side. A classifier matches the source's head outputs (KL, weighted by the anchor), plus SHOT's information
maximisation (each output sure, the batch's spread); a tower without a head, its pooled embedding and patch features
resampled to the source's grid (cosine).

Judging, when the held-out images have no labels: the **teacher** (the source at its own size) labels them with its
head's predictions, and every reading is the *teacher agreement*: the share of held-out images whose prediction is the
teacher's label (the teacher at its own size agrees with itself: 1.0). The run is worth it when the model at the new
size agrees with the teacher better, by the verdict's margin, than

- the **baseline**: the source read at the new size untrained (transformers' run-time interpolation of its grid, as
  ``resize-model`` alone would leave it): the fine-tune earned its time;
- the **control**: the same trained model read at the source's size, the teacher's own view: the new size is where
  the trained model reads best, so it is the size to use.

With labelled held-out images (``eval_data``) a label-free run is judged on their labels, as a supervised one. A tower
without a head gives the teacher no labels: no verdict, and its readings are how closely its embeddings find the
source's (:func:`~posextend.training.towers.metrics.agreement`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from posextend.errors import TrainingError
from posextend.scoring.verdict import Reading
from posextend.training.context import RunContext
from posextend.training.objectives.base import draw_mates
from posextend.training.towers.augment import moved_back, random_moves, shifted
from posextend.training.towers.features import Features, divergence, features, forward, information, match
from posextend.training.towers.heads import NEW_HEAD

TEACHER = "teacher agreement"  # the share of held-out images read as the teacher (its head at its own size) labels them


class LabelFree:
    """Label-free training and its judge, mixed into the ``vision`` objective (see the module). Uses the objective's
    ``_pixels``, ``_grid``, ``_read``, ``_unextended_size`` and its ``anchor``, ``mates`` and ``shift``."""

    def _label_free(self) -> None:
        if "anchor" in vars(self) and not self.anchor:
            raise TrainingError("Label-free training learns from the source model itself, which an anchor of 0 "
                                "leaves out: leave the anchor unset, or give images with labels.")
        # SHOT's spread needs a batch's worth; readings creep up from the teacher's by less than a check's noise
        # SHOT's spread needs a batch's worth; readings creep up from the teacher's by less than a check's noise
        self.anchor, self.mates, self.early_stop = self.anchor or 1.0, 7, False

    def _distilled(self, run: RunContext, positions: range, images: list[Any]) -> torch.Tensor:
        """Label-free, on the samples and :attr:`mates` more each (see the module): matching the source learns its
        readings; made sure and steady under the move too, they read better than it (benchmarks/vision.py)."""
        mates, generators = draw_mates(run, positions, self.mates)
        images = images + [item["image"] for item in mates]
        pixels = self._pixels(run, images, run.sizes.image.new).to(run.accelerator.device)
        (height, width), grid = pixels.shape[-2:], self._grid(run, run.sizes.image.new)
        moves = random_moves(generators, (round(height * self.shift), round(width * self.shift)), 1 + self.mates)
        out, base = forward(run.model, run.unwrapped, shifted(pixels, moves))
        student = moved_back(features(out, base, grid, len(images)), moves, (height // grid[0], width // grid[1]))
        teacher = self._teacher(run, images)
        if student.logits is None or teacher.logits is None:
            return match(student, teacher)
        # a classifier matches its head's outputs alone: its features held to the 16 px ones would keep it there
        return self.anchor * divergence(student.logits, teacher.logits) + information(student.logits)

    @torch.no_grad()
    def _teacher(self, run: RunContext, images: list[Any]) -> Features:
        """The source (``run.reference``) reading ``images`` at its own size."""
        teacher = run.reference.to(run.accelerator.device)
        size = self._unextended_size(run)
        pixels = self._pixels(run, images, size).to(run.accelerator.device)
        out, base = forward(teacher, teacher, pixels)
        return features(out, base, self._grid(run, size), len(images))

    # ------------------------------------------------------------------ judged by the teacher's labels

    def _teacher_baseline(self, run: RunContext, unextended: torch.nn.Module, own: Features) -> Reading | None:
        """Held-out images without labels: the teacher's labels (the argmax of the source's logits ``own``, read at
        its own size), and the baseline, the source read at the run's size untrained against them. None when the
        source has no head of its own to label them (no verdict), or the run does not change the size."""
        if (own.logits is None or getattr(unextended, NEW_HEAD, None)
                or run.sizes.image.new == self._unextended_size(run)):
            return None
        run.state.teacher = own.logits.argmax(1)
        untrained = self._read(run, unextended, unextended, run.sizes.image.new)
        if untrained is None:
            run.state.teacher = None
            return None
        run.state.baseline_metric = TEACHER
        return Reading(far=self._agreed(run, untrained)[1], original=math.nan, metric=TEACHER, higher=True)

    def _agreed(self, run: RunContext, read: Features) -> tuple[str, float, float]:
        """``(metric, score, loss)`` of a reading against the teacher's labels: the share it predicts, and the
        cross-entropy of its logits on them."""
        target = run.state.teacher
        agreed = float((read.logits.argmax(1) == target).float().mean())
        return TEACHER, agreed, float(F.cross_entropy(read.logits, target))

    def _teacher_baseline_name(self, run: RunContext) -> str:
        (h, w), (nh, nw) = self._unextended_size(run), run.sizes.image.new
        return f"the source at {nh}x{nw} px untrained (the teacher's labels: the source's at its own {h}x{w} px)"

    def _free_notes(self, run: RunContext, labelled: bool) -> list[str]:
        """How a label-free run trained, and what it was judged on when its held-out images have no labels."""
        h, w = self._unextended_size(run)
        taught = ("its head's outputs, made sure and spread" if "ForImageClassification" in type(run.unwrapped).__name__
                  else "its pooled embedding and patch features")
        lines = [f"vision: label-free, the source at {h}x{w} px as the teacher ({taught}); {self.mates} mates a "
                 f"sample, each image moved by up to {self.shift:.0%} of its side"]
        if labelled:
            return lines
        if run.state.teacher is not None:
            lines.append(f"vision: no labels among the held-out images: judged by the teacher's labels (the source's "
                         f"predictions at its own {h}x{w} px)")
        else:
            lines.append("vision: no labels among the held-out images and no head to label them, so no verdict: give "
                         "labelled held-out images (a subfolder per class) for one")
        return lines
