"""The options of a fine-tune, in one frozen dataclass (:class:`FinetuneConfig`).

The API (``posextend.finetune(src, dst, data, **options)``) and the CLI build it; it is resolved once
against the objective's defaults (:meth:`FinetuneConfig.resolved`), checked in one place, and
fingerprinted for resuming (:meth:`FinetuneConfig.fingerprint`). Nothing below takes loose options.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal, Protocol, get_args

from posextend.errors import TrainingError
from posextend.options import option
from posextend.resize.options import PARAM_HELP
from posextend.scoring.verdict import MARGIN, TOLERANCE

TrainMode = Literal["new-rows", "positions", "all", "lora"]
TRAIN_MODES = get_args(TrainMode)
SCHEDULES = ("constant", "cosine")
PRECISIONS = ("no", "fp16", "bf16", "auto")
DEFAULTED = ("lr", "schedule", "strategy", "anchor", "window_anchor")  # the options whose defaults are each objective's
DEFAULT_BATCH = 4  # sequences per micro-batch where none is given (an objective may take fewer: Objective.batch_size_for)
DEFAULT_BUDGET = "15min"  # what a run that extends may spend to become worth it, when neither steps nor budget is given
# an option's help and flag are in its field (:func:`posextend.options.option`): the CLI's ``finetune`` shows each
# field, ``eval`` the ones whose help names it; ``finetune --help`` groups them in these panels (a field that names
# none is shown last, under "Advanced")
_option = functools.partial(option, commands=("finetune",))
MOST, TRAINING, EVALUATION = "What most users set", "Training", "Evaluation"
# options that change how a run is carried out or reported, not what it computes: a resume may change them
_NOT_FINGERPRINTED = {"resume", "overwrite", "eval_every", "save_every", "eval_sequences", "buckets",
                      "gradient_checkpointing", "batch_size", "budget", "margin", "tolerance", "save_adapter"}


class Defaults(Protocol):
    """What a config takes from its objective (:class:`posextend.training.objectives.base.Objective` has it)."""

    name: str
    anchor: float | None
    window_anchor: float | None
    steps: int
    eval_sequences: int
    schedule: dict[str, str]
    strategy: dict[str, str]

    def default_lr(self, train: str, width: int) -> float: ...

    def batch_size_for(self, old: int, new: int) -> int: ...


@dataclass(frozen=True)
class FinetuneConfig:
    """Every option of a fine-tune. ``None``: the objective's default (see :meth:`resolved`).

    - ``length``: extend to this many usable positions first (None: train at the checkpoint's length).
    - ``image_size``: a model with an image grid (a vision tower, CLIP's): give it this size in pixels first.
    - ``decoder_length``: an encoder-decoder with a length per stack (LED): extend the decoder's table to
      this many positions too (None: as it is; ``length`` sizes the encoder's).
    - ``strategy``: how ``length`` fills the new rows (objective's default: ``interpolate`` for causal LMs
      with ``train="all"`` or ``"lora"``, ``kps`` for image-text, ``bicubic`` for vision, else ``tile``); one
      named is kept where it resizes a table that grows, and refused where it resizes none (:meth:`with_strategy`).
      ``params``: its parameters (``{"keep": 4}`` for ``kps``), as ``resize_checkpoint`` takes them.
    - ``steps``: exactly this many optimizer steps; ``budget``: what a run may spend (``15min``, ``20M tokens``,
      ``2000 steps``) while its held-out reading improves, writing its best check (:mod:`posextend.training.budget`);
      neither: a run that extends spends :data:`DEFAULT_BUDGET`, one that does not trains the objective's steps
      (200 for language models, 60 for ``contrastive``).
    - ``eval_data``: held-out data of the kinds ``data`` takes (default: a few percent of the data, whole documents
      where it has several, never trained on); give data the source never saw when ``data`` is what it was trained on;
      ``train_control``: also fine-tune the source at its own length on the same text and tokens (the exact
      control: what not extending gives), which the far range must beat too; ``margin`` / ``tolerance``: how
      much the far range must beat the baseline by, and how much the original range may lose
      (:mod:`posextend.scoring.verdict`).
    - ``train``: ``new-rows`` (only rows beyond the old length; everything else stays bit-identical),
      ``positions`` (the whole table), ``all`` (every parameter) or ``lora`` (LoRA on the attention
      projections, with the table(s) and norms: :mod:`posextend.training.adapters`; the output is merged).
    - ``save_adapter``: with ``lora``, also write the adapter as peft saves it, to ``DST/adapter``.
    - ``lr``: learning rate (by train mode and the table's width: see the objectives).
    - ``schedule``: after a 10% linear warm-up, ``constant`` or ``cosine`` down to 10% of ``lr``.
    - ``batch_size`` (per process), ``grad_accum``, ``mixed_precision`` (``auto``: the launcher's when
      ``accelerate launch`` gives one, else bf16 where the device computes it natively, a GPU of Ampere or later
      or a CPU with AVX512-BF16 or AMX, else ``no``; or ``no``, ``fp16``, ``bf16``), ``gradient_checkpointing``
      (also turned on by itself when the first step runs out of GPU memory).
    - ``eval_every``: held-out evaluation every N steps (0: before and after only); ``save_every``:
      resumable state to ``DST.state/`` every N steps; ``resume``: continue from it.
    - ``seed``: data order, masking and strategies.
    - ``old_length``: the old length of a checkpoint extended by another tool (for ``new-rows``).
    - ``init_head``: train a fresh LM head when the checkpoint has none.
    - ``objective``: a registered objective's name (:func:`posextend.training.objectives.available_objectives`;
      default: the one the registry prefers for the checkpoint, :func:`posextend.training.objectives.default_objective`).
    - ``anchor``: weight of the objective's term that keeps the source's outputs on inputs within the
      old length (causal 1, contrastive 2, seq2seq 0; 0 turns it off).
    - ``window_anchor``: weight of the objective's term that holds the new positions to the model's own reading
      through its old window (the control the verdict reads), so that the longer context does not read worse than
      that window (0 turns it off; None: the objective's,
      :meth:`~posextend.training.objectives.base.Objective.window_anchor_for`: causal 1, or 0 for a source that uses
      its context within its window).
    - ``source``: the original model the anchor holds to, for a checkpoint extended earlier.
    - ``eval_sequences``, ``buckets``: the held-out evaluation's size (contrastive: the documents of each
      retrieval task its verdict reads) and position buckets.
    - ``overwrite``: replace DST if it exists.

    Each field carries its command-line help and flag (:func:`posextend.options.option`): the ``finetune`` and
    ``eval`` commands are generated from them.
    """

    length: int | None = _option(None, {"finetune": "Extend SRC to this many positions (tokens) first.",
                                        "eval": "Sequence length in tokens (default: the model's)."}, short="-n",
                                 panel={"finetune": MOST})
    image_size: int | None = _option(
        None, "Vision towers and image-text models: give the image grid this size in pixels first (its patches follow).",
        metavar="PIXELS", panel=MOST)
    decoder_length: int | None = _option(
        None, "Encoder-decoders with a length per stack (LED): extend the decoder's table to this many positions "
        "too (--length sizes the encoder's).")
    strategy: str | None = _option(
        None, "How --length (or --image-size) fills the new positions, listed by `posextend strategies` (default: the "
        "best in our benchmarks, by objective and --train, listed below; an image grid that grows takes bicubic where "
        "the objective's default resizes only lengths; see docs/concepts/strategies.md).",
        short="-s", metavar="NAME", panel=MOST)
    params: Mapping[str, Any] | None = _option(
        None, PARAM_HELP, flag="--param", short="-p", metavar="KEY=VALUE", cli_type=list[str])  # parse_params reads them
    steps: int | None = _option(
        None, "Train exactly this many steps (default: train while the held-out reading improves, within --budget).",
        panel=MOST)
    budget: str | None = _option(
        None, "What training may spend: a time (15min, 1h), tokens (20M tokens) or steps (2000 steps). It stops "
        "earlier once the held-out reading stops improving (5 checks in a row without a better one; label-free vision "
        "trains it whole) and writes the weights of its best check; then it says whether the extension is worth it "
        f"(default: {DEFAULT_BUDGET}).",
        metavar="SIZE", panel=MOST)
    train: TrainMode = _option(
        "all", "What learns: all (every weight; the best in our benchmarks), positions (the position table only), "
        "new-rows (only the positions past the old length; the rest stays exactly as it was) or lora (small adapters "
        "on the attention with the position table and norms, merged into the output: for models too big to train "
        "whole).", metavar="WHAT", panel=MOST)
    lr: float | None = _option(
        None, "Learning rate (default: by objective and --train, listed below).", panel=TRAINING)
    schedule: Literal["constant", "cosine"] | None = _option(
        None, "Learning rate after a 10% warm-up: constant, or cosine down to 10% (default: by objective and --train, "
        "listed below).", metavar="NAME", panel=TRAINING)
    batch_size: int | None = _option(
        None, {"finetune": f"Sequences per micro-batch (per process; default {DEFAULT_BATCH}, and for a language model "
                           f"extended with the window anchor on as many tokens as {DEFAULT_BATCH} sequences of its old "
                           "length: 1 at 4x the length, 2 at 2x).",
               "eval": f"Sequences per batch (default {DEFAULT_BATCH})."}, panel={"finetune": TRAINING})
    grad_accum: int = _option(1, "Micro-batches per optimizer step (a larger batch in the same memory).",
                              panel=TRAINING)
    mixed_precision: Literal["auto", "no", "fp16", "bf16"] = _option(
        "auto", "Compute in half precision: auto (the launcher's under accelerate launch, else bf16 on a GPU or CPU "
        "that computes it natively, else no), no, fp16 or bf16 (through accelerate).", metavar="NAME", panel=TRAINING)
    gradient_checkpointing: bool = _option(
        False, "Use less memory for more compute (recompute activations; on a GPU, turned on by itself when the "
        "first step does not fit).", panel=TRAINING)
    eval_every: int = _option(0, "Evaluate on held-out data every N steps (0: as the budget needs, about 20 times "
                                 "a run).", panel=EVALUATION)
    eval_data: list[str] | None = _option(
        None, {"finetune": "Held-out data to judge the extension on, of the kinds --data takes (default: a few percent "
                           "of --data, whole documents where it has several, never trained on). Give data the source "
                           "never saw when --data is what it was trained on: it reads that from memory. By objective:"},
        cli_type=list[Path], metavar="PATH",
        panel={"finetune": EVALUATION})
    train_control: bool = _option(
        False, "Also fine-tune SRC at its own length on the same training text and as many tokens, and read it as the "
        "source reads held-out text: what you would get without extending. The extension must beat it too to be worth "
        "it (about twice the run's time and memory).", panel=EVALUATION)
    margin: float = _option(MARGIN, "How much better than the source's own reading (and the controls') the far "
                                    "positions must read held-out data for the extension to be worth it (0.03: 3% "
                                    "lower perplexity).", panel=EVALUATION)
    tolerance: float = _option(TOLERANCE, "How much worse the first positions (the old length) may read it than the "
                                          "source does (0.02: 2%).", panel=EVALUATION)
    save_every: int = _option(0, "Save resumable state to DST.state/ every N steps.", panel=TRAINING)
    resume: bool = _option(False, "Continue from DST.state/ (saved by --save-every).", panel=TRAINING)
    seed: int = _option(0, "Seed for data order, masking and strategies.", panel=TRAINING)
    old_length: int | None = _option(
        None, "The length SRC had before another tool extended it (--train new-rows needs it; posextend's own "
        "outputs record it).")
    init_head: bool = _option(False, "SRC has no language-model head (a bare model): add a new one and train it.")
    objective: str | None = _option(None, {
        "finetune": "What the model learns from the data (default: contrastive for a sentence-transformers "
                    "model, else the one that fits the model's head). Registered objectives:",
        "eval": "Score as this objective does (default: the one finetune would use). Registered objectives:"},
        metavar="NAME", panel={"finetune": MOST})
    anchor: float | None = _option(
        None, "How strongly training keeps the outputs on inputs within the old length as they were (0 turns it off "
        "and saves a copy of the model in memory; see docs/concepts/training.md; default: by objective, listed "
        "below).", panel=TRAINING)
    window_anchor: float | None = _option(
        None, "How strongly training pulls the new positions' predictions toward the model's own reading of the same "
        "text through a window of its old length (the control the verdict reads), so that the longer context does not "
        "read worse than that window (0 turns it off; a step costs about 1.5x with it; default: by objective, listed "
        "below, and off for a source that uses its context within its window, which the extension may learn to use "
        "past it; see docs/concepts/training.md).", panel=TRAINING)
    source: str | Path | None = _option(
        None, "The original model the anchor compares with, when SRC was resized earlier (default: the model "
        "SRC was resized from, as posextend recorded in SRC's files, when it is still there).", metavar="PATH")
    eval_sequences: int | None = _option(
        None, "Held-out samples each check reads (fewer: cheaper checks, coarser readings; default 16 sequences of "
        "text; contrastive: documents per retrieval task; images: the objective's).", metavar="N", panel=EVALUATION)
    buckets: int = _option(8, {"finetune": "Rows of the before/after table: the positions cut into this many "
                                           "ranges.",
                               "eval": "Rows of the table: the positions cut into this many ranges."},
                           panel={"finetune": EVALUATION})
    overwrite: bool = _option(False, "Replace DST if it exists.")
    save_adapter: bool = _option(False, "With --train lora: also write the LoRA adapter (peft's files) to DST/adapter.")

    @classmethod
    def of(cls, options: dict[str, Any]) -> FinetuneConfig:
        """The config of keyword ``options``; an unknown name is refused with the valid ones."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise TrainingError(f"Unknown fine-tune option(s) {', '.join(unknown)}; the options are: "
                                f"{', '.join(sorted(names))}.")
        return cls(**options)

    def resolved(self, objective: Defaults) -> FinetuneConfig:
        """The options with ``objective``'s defaults filled in (objective, anchor, schedule), checked; the window
        anchor's, where none is given, once the run has read its source (:func:`posextend.training.setup.setup`).
        ``steps`` stays None unless given: the run's budget decides them (:mod:`posextend.training.budget`). ``lr``
        stays None until the table's width is known (:meth:`with_lr`), ``strategy`` (None: not named) until the
        tables that grow are (:meth:`with_strategy`)."""
        self._check_train()
        anchor = objective.anchor if self.anchor is None else self.anchor
        config = replace(
            self, objective=objective.name, anchor=anchor,
            schedule=self.schedule or objective.schedule.get(self.train, "constant"),
            eval_sequences=self.eval_sequences or objective.eval_sequences,
        )
        config.check()
        return config

    def with_strategy(self, objective: Defaults, grows: Collection[int]) -> FinetuneConfig:
        """The config with the run's strategy, given the grid ranks of the tables that grow (1: positions, 2: an
        image grid; none: the run resizes nothing): the one named, where it resizes one of them (refused where it
        resizes none); none named, ``objective``'s default where it resizes one of them, else None (each table's
        own default: ``bicubic`` for an image grid)."""
        from posextend.tables.strategies import available_strategies, get_strategy

        if self.strategy is None:
            default = objective.strategy.get(self.train, "tile")
            fits = not grows or set(get_strategy(default).ranks) & set(grows)
            return replace(self, strategy=default if fits else None)
        if grows and not set(get_strategy(self.strategy).ranks) & set(grows):
            what = {1: "positions", 2: "image grids"}
            fitting = ", ".join(n for n, s in available_strategies().items() if set(s.ranks) & set(grows))
            raise TrainingError(
                f"Strategy {self.strategy!r} resizes {' and '.join(what[r] for r in get_strategy(self.strategy).ranks)}"
                f", but this run resizes only {' and '.join(what[r] for r in sorted(grows))}: name one that does "
                f"({fitting}), or none for the default.")
        return self

    def with_batch_size(self, objective: Defaults, old: int, new: int) -> FinetuneConfig:
        """The config with ``batch_size`` set: the given one, else ``objective``'s for a run from ``old`` to ``new``
        positions (:meth:`~posextend.training.objectives.base.Objective.batch_size_for`)."""
        return self if self.batch_size is not None else replace(self, batch_size=objective.batch_size_for(old, new))

    def with_lr(self, objective: Defaults, width: int) -> FinetuneConfig:
        """The config with ``lr`` set: the given one, else ``objective``'s for the train mode and ``width``."""
        return self if self.lr is not None else replace(self, lr=objective.default_lr(self.train, width))

    def _check_train(self) -> None:
        if self.train not in TRAIN_MODES:
            raise TrainingError(f"The train mode must be one of {', '.join(TRAIN_MODES)}, got {self.train!r}.")

    def check(self) -> None:
        """Refuse values no run can use, each with what to give instead."""
        self._check_train()
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise TrainingError(f"The schedule must be constant or cosine, got {self.schedule!r}.")
        if self.train_control and self.train == "new-rows":
            raise TrainingError("Training only new rows keeps every weight the old length uses, so its control is the "
                                "source itself, which the verdict reads already: leave train_control off.")
        if self.save_adapter and self.train != "lora":
            raise TrainingError("Only a LoRA run has an adapter to save; train with lora, or leave save_adapter off.")
        if self.strategy is not None:
            from posextend.tables.strategies import check_params

            check_params(self.strategy, self.params)  # its name, and its parameters' names
        if self.mixed_precision not in PRECISIONS:
            raise TrainingError(f"Mixed precision must be one of {', '.join(PRECISIONS)}, got {self.mixed_precision!r}.")
        if self.image_size is not None and self.train == "new-rows":
            raise TrainingError("An image grid resized to a new image size has no old rows to keep (every row is "
                                "resampled): train the positions, lora or every parameter.")
        for name in ("steps", "batch_size", "grad_accum", "length", "decoder_length", "image_size", "eval_sequences"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise TrainingError(f"{name} must be at least 1, got {value}.")
        for name in ("margin", "tolerance"):
            if not 0 <= getattr(self, name) < 1:
                raise TrainingError(f"{name} must be a fraction between 0 and 1, got {getattr(self, name)}.")
        if self.budget is not None:
            from posextend.training.budget import parse_budget

            if self.steps is not None:
                raise TrainingError("Give a number of steps or a budget, not both: steps train exactly that many, a "
                                    "budget trains while its held-out reading improves.")

            parse_budget(self.budget)
        for name in ("eval_every", "save_every"):
            if getattr(self, name) < 0:
                raise TrainingError(f"{name} must be 0 (off) or a number of steps, got {getattr(self, name)}.")

    def fingerprint(self, *, src: Path, data: list[str], processes: int, anchor_source: Path | None,
                    precision: str) -> str:
        """What a resume must share with the run that saved its state: the source, the data, every option
        that changes what is computed (the global batch, not the per-process one; the ``precision`` the steps
        compute in, ``auto`` resolved on this machine), the anchor's original."""
        settings = {k: v for k, v in dataclasses.asdict(self).items() if k not in _NOT_FINGERPRINTED}
        settings.update(src=str(src), data=data, global_batch=self.batch_size * processes, source=None,
                        anchor_source=str(anchor_source) if anchor_source else None, mixed_precision=precision)
        return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]
