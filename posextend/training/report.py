"""What a fine-tune reports and writes: :class:`FinetuneReport` (its options as resolved, throughput, losses,
the evaluations before and after) and the output (:func:`save`): the trained model in the source's files and
layout (:mod:`posextend.training.saving`), its provenance, model card and evaluation.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from posextend.files.atomic import atomic_output
from posextend.files.checkpoint import Checkpoint
from posextend.files.sources import MODULES
from posextend.resize.on_disk import resize_change
from posextend.resize.report import ResizeReport, model_card, resize_report, source_provenance
from posextend.resize.options import ResizeOptions
from posextend.scoring.by_position import EvalReport
from posextend.scoring.context_use import ContextUse
from posextend.scoring.verdict import Verdict
from posextend.training.loading import Loaded
from posextend.training.options import FinetuneConfig
from posextend.version import __version__

if TYPE_CHECKING:
    import torch

    from posextend.training.setup import Run

log = logging.getLogger(__name__)

# the report's keys as plain data (:meth:`FinetuneReport.to_dict`), its options among its own fields
_KEYS = ("dst", "train", "objective", "steps", "old_length", "new_length", "lr", "batch_size", "grad_accum", "precision",
         "items", "tokens", "seconds", "tokens_per_second", "losses", "eval_losses", "before", "after", "processes", "main_process",
         "strategy", "anchor", "window_anchor", "schedule", "anchor_source", "anchor_note", "notes", "verdict",
         "written_step", "held_out", "context_use")


@dataclass
class Trained:
    """What the loop did: each step's loss, the held-out losses (``eval_every``), the items and tokens every process
    trained on (as the objective counts them: an image's tokens are its patches), and the seconds of training."""

    losses: list[float] = field(default_factory=list)
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    items: int = 0
    tokens: int = 0
    seconds: float = 0.0


@dataclass
class FinetuneReport:
    """What ``finetune`` did. ``config``: its options as resolved (the objective's defaults and the lr filled
    in), which ``train``, ``objective``, ``steps``, ``lr``, ``batch_size``, ``grad_accum``, ``schedule``,
    ``anchor`` and ``window_anchor`` read."""

    dst: str
    config: FinetuneConfig
    old_length: int
    new_length: int
    tokens: int  # what it trained on, as its objective counts them (text: tokens; an image: its patches)
    seconds: float
    tokens_per_second: float
    items: int = 0  # samples trained on (token windows, images, pairs of image and caption)
    losses: list[float] = field(default_factory=list)
    eval_losses: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out loss), with --eval-every
    before: EvalReport | None = None
    after: EvalReport | None = None
    processes: int = 1  # processes that trained together (tokens count all of them)
    main_process: bool = True  # False on the other processes of a distributed run (they print nothing)
    strategy: str | None = None  # how the table was extended before training (None: it came extended)
    anchor_source: str | None = None  # the original model the anchor held to (None: the checkpoint as loaded)
    anchor_note: str | None = None  # one line: why the anchor could not hold to the original model
    notes: list[str] = field(default_factory=list)  # the objective's lines about the run (Objective.notes)
    verdict: Verdict | None = None  # the far range against the source's own reading of it (None: no baseline)
    precision: str = "no"  # what the steps computed in, ``auto`` resolved for the device: no (fp32), bf16 or fp16
    context_use: ContextUse | None = None  # causal LMs that extend: does the fine-tuned model use its new positions?
    written_step: int | None = None  # the step whose weights were written (the best check's; None: the last step)
    held_out: str = ""  # what the verdict was judged on (:func:`posextend.data.heldout.held_out_note`)

    @property
    def written(self) -> str:
        """Which weights were written, in words: the best check's, when it was not the last step."""
        if self.written_step is None or self.written_step == self.steps:
            return f"the last step's ({self.steps})"
        return f"the best check's, step {self.written_step} of {self.steps}"

    train = property(lambda self: self.config.train)
    objective = property(lambda self: self.config.objective)
    steps = property(lambda self: self.config.steps)
    lr = property(lambda self: self.config.lr)
    batch_size = property(lambda self: self.config.batch_size)
    grad_accum = property(lambda self: self.config.grad_accum)
    schedule = property(lambda self: self.config.schedule)
    anchor = property(lambda self: float(self.config.anchor or 0.0), doc="The anchor's weight (0: none).")
    window_anchor = property(lambda self: float(self.config.window_anchor or 0.0),
                             doc="The window anchor's weight (0: none).")
    precision_note = property(lambda self: "" if self.precision == "no" else f", {self.precision}",
                              doc="``, bf16`` after the run's other settings when it did not compute in fp32.")

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data: its fields (the evaluations as dicts) and the options it reads from
        ``config``, not the rest of them."""
        own = asdict(self)
        own["verdict"] = self.verdict.to_dict() if self.verdict else None
        own["context_use"] = self.context_use.to_dict() if self.context_use else None
        return {key: own[key] if key in own else getattr(self, key) for key in _KEYS}


def finetune_report(run: Run, dst: Path, evaluations: tuple[EvalReport | None, EvalReport], trained: Trained,
                    verdict: Verdict | None = None, *, written_step: int | None = None) -> FinetuneReport:
    """The fine-tune's report: its options, throughput, losses (held-out ones at steps 0 and the last
    included), the before/after evaluations (after: of the weights written), the verdict, the step written and
    whether the model uses its new positions (the objective's
    :meth:`~posextend.training.objectives.base.Objective.context_use`, read here on the trained model)."""
    (before, after), config = evaluations, run.config
    return FinetuneReport(
        dst=str(dst.resolve()), config=config, old_length=run.sizes.length.old, new_length=run.sizes.length.new,
        tokens=trained.tokens, items=trained.items, seconds=trained.seconds, tokens_per_second=trained.tokens / max(trained.seconds, 1e-9),
        losses=trained.losses,
        eval_losses=([(0, before.loss)] if before else []) + trained.eval_losses + [(config.steps, after.loss)],
        before=before, after=after, processes=run.accelerator.num_processes,
        main_process=run.accelerator.is_main_process, strategy=config.strategy if run.extended else None,
        anchor_source=run.anchor_original.original.name if run.anchor_original.original else None,
        anchor_note=run.anchor_original.note,
        notes=([run.window_note] if run.window_note else []) + run.objective.notes(run), verdict=verdict,
        precision=run.accelerator.mixed_precision,
        written_step=written_step, held_out=run.held_out_note,
        context_use=run.objective.context_use(run),  # read once, on the fine-tuned model
    )


def save(run: Run, dst: Path, report: FinetuneReport, state_dict: dict[str, torch.Tensor]) -> None:
    """The fine-tuned model, written by the checkpoint writer of ``resize-model`` into the source's files and
    layout (:mod:`posextend.training.saving`), with provenance and a model card: the source's tensors resized as the
    plans setup made say (``run.loaded.plans``), the trained ones at their new values.

    ``state_dict``: the trained model's full weights (gathered when sharded across processes: FSDP, DeepSpeed).
    """
    from posextend.training.saving import changes, write_trained

    seed, adapter, loaded = run.config.seed, None, run.loaded
    if run.trainable.adapter is not None:  # LoRA: merged into the model (its adapter kept first, when asked for)
        from posextend.training.adapters import merge

        state_dict, adapter = merge(run.trainable.adapter, run.unwrapped, keep_adapter=run.config.save_adapter)
    with run.checkpoint as checkpoint:
        config, reader, directory, plans = checkpoint.config, checkpoint.reader, checkpoint.directory, loaded.plans
        resized = resize_change(reader, config, plans, seed)
        trained, added = changes(state_dict, run.unwrapped, loaded.files, reader)
        options = ResizeOptions(new_length=run.sizes.length.new, strategy=run.config.strategy, seed=seed)
        resize = resize_report(checkpoint, dst, plans, options) if plans else None
        change = dataclasses.replace(resized, tensors={**resized.tensors, **trained}, added=added,
                                     metadata=_provenance(run, report, checkpoint, resize),
                                     config=run.objective.written_config(run))
        with atomic_output(dst, overwrite=run.config.overwrite) as tmp:
            written = write_trained(checkpoint, tmp, change, type(loaded.hf_model))
            _save_modules(loaded, checkpoint, tmp, run.config.train)
            if adapter is not None:
                adapter.write(tmp / "adapter")
            if resize is not None:
                resize.record(written)
            (tmp / "README.md").write_text(_card(report, resize, directory))
            if report.before or report.after:
                (tmp / "posextend_eval.json").write_text(json.dumps(
                    {"before": report.before and report.before.to_dict(), "after": report.after.to_dict(),
                     "verdict": report.verdict and report.verdict.to_dict(),
                     "context_use": report.context_use and report.context_use.to_dict()}, indent=2))
    log.info("Saved %s: %d tensors trained, %d added, the rest copied from %s", dst, len(trained), len(added), directory)


def _provenance(run: Run, report: FinetuneReport, checkpoint: Checkpoint, resize: ResizeReport | None) -> dict[str, str]:
    """The output's provenance: the resize the run made (or the original recorded before it, or the
    checkpoint itself), its lengths, and the fine-tune."""
    finetune = {"posextend.finetune": json.dumps({"train": report.train, "steps": report.steps, "lr": report.lr,
                                                   "tokens": report.tokens})}
    if report.verdict is not None:
        finetune["posextend.verdict"] = report.verdict.text
    if resize is not None:
        return {**resize.provenance(), **finetune}
    recorded, original = checkpoint.provenance, run.anchor_original.original
    if original is None and "posextend.source" in recorded:
        read_from = source_provenance(recorded["posextend.source"], recorded.get("posextend.source_revision"))
    else:  # the original the anchor held to, or the checkpoint itself
        read_from = source_provenance((original or checkpoint).name, (original or checkpoint).commit)
    return {"posextend.version": __version__, **read_from, "posextend.old_length": str(report.old_length),
            "posextend.new_length": str(report.new_length), **finetune}


def _save_modules(loaded: Loaded, checkpoint: Checkpoint, out: Path, train: str) -> None:
    """A sentence-transformers model's modules beyond the Transformer that trained (a Dense layer, when every
    parameter trains): saved by the module's own ``save`` over its copied folder."""
    if train != "all" or loaded.model is loaded.hf_model or not checkpoint.sentence_transformers:
        return
    for entry in json.loads((checkpoint.directory / MODULES).read_text()):
        module = loaded.model[int(entry["idx"])]
        if getattr(module, "auto_model", None) is not loaded.hf_model and any(True for _ in module.parameters()):
            module.save(str(out / entry["path"]))


def _card(report: FinetuneReport, resize: ResizeReport | None, directory: Path) -> str:
    """The output's model card: the resize the run made (and the source's card under it), or the source's
    card as it is; then the fine-tune."""
    card = directory / "README.md"
    given_card = card.read_text(errors="replace") if card.is_file() else ""
    if resize is not None:
        head = model_card(resize, given_card, trained=True).rstrip()
    else:
        head = given_card.rstrip() or f"---\ntags:\n- posextend\n---\n\n# Fine-tuned with posextend {__version__}"
    lines = [head, "", "## Fine-tune", "",
             f"- Trained: `{report.train}` for {report.steps} steps ({report.tokens} tokens, lr {report.lr}"
             f"{report.precision_note}) "
             f"at {report.new_length} positions (old length {report.old_length}); written: {report.written} weights"]
    for label, ev in (("before", report.before), ("after", report.after)):
        if ev is not None and math.isfinite(getattr(ev, ev.score)):
            lines.append(f"- Held-out {ev.metric} {label}: {getattr(ev, ev.score):.3f}")
    if report.verdict is not None:
        advice = f": {report.verdict.advice}" if report.verdict.advice else ""
        lines.append(f"- Verdict: {report.verdict.text}{advice}")
        if report.held_out:
            lines.append(f"- Judged on: {report.held_out}")
    if report.context_use is not None:
        lines.append(f"- Context: {report.context_use.text}")
    lines += [f"- {note}" for note in report.notes]
    return "\n".join(lines) + "\n"
