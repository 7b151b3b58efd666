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
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal, Protocol, get_args

from posextend.errors import TrainingError
from posextend.options import option

TrainMode = Literal["new-rows", "positions", "all", "lora"]
TRAIN_MODES = get_args(TrainMode)
SCHEDULES = ("constant", "cosine")
PRECISIONS = ("no", "fp16", "bf16")
# an option's help and flag are in its field (:func:`posextend.options.option`): the CLI's ``finetune`` shows each
# field, ``eval`` the ones whose help names it
_option = functools.partial(option, commands=("finetune",))
# options that change how a run is carried out or reported, not what it computes: a resume may change them
_NOT_FINGERPRINTED = {"resume", "overwrite", "eval_every", "save_every", "eval_sequences", "buckets",
                      "gradient_checkpointing", "batch_size", "save_adapter"}


class Defaults(Protocol):
    """What a config takes from its objective (:class:`posextend.training.objectives.base.Objective` has it)."""

    name: str
    anchor: float | None
    steps: int
    schedule: dict[str, str]
    strategy: dict[str, str]

    def default_lr(self, train: str, width: int) -> float: ...


@dataclass(frozen=True)
class FinetuneConfig:
    """Every option of a fine-tune. ``None``: the objective's default (see :meth:`resolved`).

    - ``length``: extend to this many usable positions first (None: train at the checkpoint's length).
    - ``decoder_length``: an encoder-decoder with a length per stack (LED): extend the decoder's table to
      this many positions too (None: as it is; ``length`` sizes the encoder's).
    - ``strategy``: how ``length`` fills the new rows (objective's default: ``interpolate`` for causal LMs
      with ``train="all"`` or ``"lora"``, else ``tile``).
    - ``steps``: optimizer steps (200 for language models, 60 for ``contrastive``).
    - ``train``: ``new-rows`` (only rows beyond the old length; everything else stays bit-identical),
      ``positions`` (the whole table), ``all`` (every parameter) or ``lora`` (LoRA on the attention
      projections, with the table(s) and norms: :mod:`posextend.training.adapters`; the output is merged).
    - ``save_adapter``: with ``lora``, also write the adapter as peft saves it, to ``DST/adapter``.
    - ``lr``: learning rate (by train mode and the table's width: see the objectives).
    - ``schedule``: after a 10% linear warm-up, ``constant`` or ``cosine`` down to 10% of ``lr``.
    - ``batch_size`` (per process), ``grad_accum``, ``mixed_precision`` (``no``, ``fp16``, ``bf16``),
      ``gradient_checkpointing``.
    - ``eval_every``: held-out evaluation every N steps (0: before and after only); ``save_every``:
      resumable state to ``DST.state/`` every N steps; ``resume``: continue from it.
    - ``seed``: data order, masking and strategies.
    - ``old_length``: the old length of a checkpoint extended by another tool (for ``new-rows``).
    - ``init_head``: train a fresh LM head when the checkpoint has none.
    - ``objective``: a registered objective's name (:func:`posextend.training.objectives.available_objectives`;
      default: the one the registry prefers for the checkpoint, :func:`posextend.training.objectives.default_objective`).
    - ``anchor``: weight of the objective's term that keeps the source's outputs on inputs within the
      old length (causal 1, contrastive 2, seq2seq 0; 0 turns it off).
    - ``source``: the original model the anchor holds to, for a checkpoint extended earlier.
    - ``eval_sequences``, ``buckets``: the held-out evaluation's size and position buckets.
    - ``overwrite``: replace DST if it exists.

    Each field carries its command-line help and flag (:func:`posextend.options.option`): the ``finetune`` and
    ``eval`` commands are generated from them.
    """

    length: int | None = _option(None, {"finetune": "Extend to this many usable positions first.",
                                        "eval": "Sequence length (default: the model's)."}, short="-n")
    decoder_length: int | None = _option(
        None, "Encoder-decoders with a length per stack (LED): extend the decoder's table to this many positions "
        "too (--length sizes the encoder's).")
    strategy: str | None = _option(
        None, "How --length fills the new rows: see `posextend strategies` (default: interpolate for causal LMs "
        "with --train all or lora, else tile; from the quality grid).", short="-s")
    steps: int | None = _option(None, "Optimizer steps (default: 200 for language models, 60 for contrastive).")
    train: TrainMode = _option("all", "all (every parameter; best in our benchmark), positions (the table), "
                                      "new-rows (only rows beyond the old length), or lora (LoRA on the attention "
                                      "projections with the table and norms, merged into the output).")
    lr: float | None = _option(
        None, "Learning rate (default: new-rows 3e-3, positions 1e-3; lora: causal 2e-3, contrastive 5e-4, else 1e-3; "
        "all: causal 1e-3 x min(1, 192/width), masked 1e-4, contrastive 5e-5).")
    schedule: Literal["constant", "cosine"] | None = _option(
        None, "Learning rate after a 10% warm-up: constant, or cosine down to 10% (default: cosine for causal LMs "
        "and contrastive with --train all or lora, else constant).")
    batch_size: int = _option(4, {"finetune": "Sequences per micro-batch (per process).",
                                  "eval": "Sequences per batch."})
    grad_accum: int = _option(1, "Micro-batches per optimizer step.")
    mixed_precision: Literal["no", "fp16", "bf16"] = _option("no", "no, fp16 or bf16 (through accelerate).")
    gradient_checkpointing: bool = _option(False, "Trade compute for memory.")
    eval_every: int = _option(0, "Evaluate on held-out data every N steps (0: only before and after).")
    save_every: int = _option(0, "Save resumable state to DST.state/ every N steps.")
    resume: bool = _option(False, "Continue from DST.state/.")
    seed: int = _option(0, "Seed for data order, masking and strategies.")
    old_length: int | None = _option(None, "Old length of a checkpoint extended by another tool (for new-rows).")
    init_head: bool = _option(False, "Train a fresh LM head when SRC has none.")
    objective: str | None = _option(None, {
        "finetune": "The objective to train with (default: the one the registry prefers for SRC: contrastive for "
                    "a sentence-transformers model, else the one whose head the family has). Registered objectives:",
        "eval": "Score as this objective does (default: the one finetune would use). Registered objectives:"})
    anchor: float | None = _option(
        None, "Weight of the term keeping the source's outputs on inputs within the old length (causal: default 1; "
        "contrastive: default 2; seq2seq: default 0, off; 0 turns it off and saves a copy of the model in memory).")
    source: str | Path | None = _option(
        None, "The original model the anchor holds to, for a SRC resized earlier (default: the original SRC's "
        "provenance records, when it is still there).")
    eval_sequences: int = _option(16, "Held-out sequences evaluated before and after.", commands=())  # API only
    buckets: int = _option(8, {"finetune": "Position buckets in the before/after table.",
                               "eval": "Number of position buckets."})
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
        """The options with ``objective``'s defaults filled in (objective, anchor, steps, schedule,
        strategy), checked. ``lr`` stays None until the table's width is known (:meth:`with_lr`)."""
        self._check_train()
        anchor = objective.anchor if self.anchor is None else self.anchor
        config = replace(
            self, objective=objective.name, anchor=anchor,
            steps=objective.steps if self.steps is None else self.steps,
            schedule=self.schedule or objective.schedule.get(self.train, "constant"),
            strategy=self.strategy or objective.strategy.get(self.train, "tile"),
        )
        config.check()
        return config

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
        if self.save_adapter and self.train != "lora":
            raise TrainingError("Only a LoRA run has an adapter to save; train with lora, or leave save_adapter off.")
        if self.mixed_precision not in PRECISIONS:
            raise TrainingError(f"Mixed precision must be one of {', '.join(PRECISIONS)}, got {self.mixed_precision!r}.")
        for name in ("steps", "batch_size", "grad_accum", "length", "decoder_length"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise TrainingError(f"{name} must be at least 1, got {value}.")
        for name in ("eval_every", "save_every"):
            if getattr(self, name) < 0:
                raise TrainingError(f"{name} must be 0 (off) or a number of steps, got {getattr(self, name)}.")

    def fingerprint(self, *, src: Path, data: list[str], processes: int, anchor_source: Path | None) -> str:
        """What a resume must share with the run that saved its state: the source, the data, every option
        that changes what is computed (the global batch, not the per-process one), the anchor's original."""
        settings = {k: v for k, v in dataclasses.asdict(self).items() if k not in _NOT_FINGERPRINTED}
        settings.update(src=str(src), data=data, global_batch=self.batch_size * processes, source=None,
                        anchor_source=str(anchor_source) if anchor_source else None)
        return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]
