"""``posextend eval``: a checkpoint scored by position on held-out text, as its objective scores a fine-tune.

The objective decides what is measured (:meth:`Objective.evaluate`): perplexity for causal LMs,
masked-LM perplexity, masked-sentence perplexity for encoder-decoders, passage retrieval for
sentence-transformers models; a plug-in objective brings its own.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posextend.files.checkpoint import Checkpoint
from posextend.training.context import RunContext, Samples
from posextend.training.sizes import read_sizes
from posextend.errors import PosExtendError
from posextend.scoring.by_position import EvalReport, plot_reports, reading_device
from posextend.scoring.verdict import Verdict
from posextend.training.objectives.base import Objective, default_objective, get_objective
from posextend.training.options import FinetuneConfig


@dataclass(frozen=True)
class _OneProcess:
    """What an objective asks of the accelerator when scoring outside a fine-tune."""

    device: Any
    num_processes: int = 1
    is_main_process: bool = True

    def unwrap_model(self, model: Any) -> Any:  # nothing wraps it: one process, no accelerate
        return model


def _objective_for(name: str | None, checkpoint: Checkpoint, data: Sequence[str | Path]) -> tuple[Objective, Any]:
    """The objective ``name`` (default: the checkpoint's family's) for ``data``'s documents, and those documents."""
    objective = get_objective(name or default_objective(checkpoint))
    docs = objective.documents(data)
    objective = objective.for_data(docs)
    return (objective.with_anchor(0) if objective.anchor else objective), docs  # nothing trains: no frozen copy


def _verdict(objective: Objective, checkpoint: Checkpoint, run: RunContext) -> Verdict | None:
    """The verdict of a checkpoint whose provenance records the original it was extended from (and that
    original is still there): the original reading the data its own way, and the checkpoint reading it so
    (its control), against the checkpoint with its whole context."""
    from posextend.training.loading import find_original

    length = run.sizes.length
    if length.old >= length.new:
        return None
    original = find_original(checkpoint, None, old_length=length.old, length=length.new, extended=False).original
    if original is None:
        return None
    try:
        unextended = objective.read_reference(original, init_head=False)
    except PosExtendError:  # the original lacks this objective's head (it was added by the fine-tune): nothing to compare
        return None
    baseline = objective.baseline(run, unextended)
    reading = objective.reading(run)
    if baseline is None or reading is None:
        return None
    control = objective.control(run)  # the checkpoint itself without its longer context
    controls = {objective.control_name(run): control} if control is not None else {}
    return Verdict(baseline, reading, objective.baseline_name(run), controls=controls, old_length=length.old,
                   extension=objective.extension, whole=objective.whole)


def evaluate(
    model_path: str | Path,
    data: Sequence[str | Path],
    *,
    length: int | None = None,
    objective: str | None = None,
    buckets: int = 8,
    batch_size: int | None = None,
    max_sequences: int | None = 64,
    seed: int = 0,
    json_path: str | Path | None = None,
    plot_path: str | Path | None = None,
    revision: str | None = None,
) -> EvalReport:
    """``posextend eval``: load a checkpoint through its objective (``objective``, default: the one
    ``finetune`` would use), cut ``data`` into samples at ``length`` (default: the model's), and report
    by position as the objective scores them (at most ``max_sequences`` samples). For a checkpoint whose
    provenance records the original it was extended from, ``report.verdict`` says whether the extension is
    worth it on this data: its far range against the original reading the text its own way, and against the
    checkpoint itself reading it so (its control: what the longer context adds).
    A causal LM read past its old length also gets ``report.context_use``: a passage repeated and a pass key
    planted beyond the old window, read with the whole context and through the old window
    (:mod:`posextend.scoring.context_use`): whether the model uses its new positions at all.

    Args:
        model_path: the checkpoint folder, or a Hugging Face Hub id (downloaded into its cache).
        data: text files, folders of them, or JSON Lines with a ``"text"`` field: held-out text.
        length: tokens per sample (default: the model's usable positions; no more than those).
        objective: how to score: a registered objective's name, a plug-in's included
            (:func:`~posextend.training.objectives.available_objectives` lists them; default: the checkpoint's).
        buckets: position buckets to report; with an old length on record, the original range is
            the first bucket and the new range is split into the rest.
        batch_size: samples per forward pass (default 4).
        max_sequences: score at most this many samples (``None``: all).
        seed: seeds what the objective draws (a masked LM's masks), so runs compare.
        json_path: also write the report as JSON here.
        plot_path: also save perplexity against position as a PNG here (needs matplotlib).
        revision: for a hub id, the branch, tag or commit downloaded (default: main).

    Returns:
        Loss and perplexity (or accuracy, for embeddings) overall and per position bucket;
        ``print(report)`` shows them as a table. ``report.verdict``: whether the extension is worth it on
        this data, for a checkpoint whose provenance records the original it was extended from.

    Examples:
        >>> report = posextend.evaluate("gpt2-4k", ["held_out.txt"], buckets=4)
        >>> print(report.verdict.text)
        >>> [round(b.perplexity, 1) for b in report.buckets]
    """
    checkpoint = Checkpoint.resolve(model_path, revision=revision)  # resolved once, passed down
    objective, docs = _objective_for(objective, checkpoint, data)
    loaded = objective.load(checkpoint, init_head=False)
    length = length or loaded.usable
    if length > loaded.usable:
        raise PosExtendError(
            f"A length of {length} exceeds the model's {loaded.usable} positions; extend the model first."
        )
    samples = objective.samples(loaded.processor, docs, length)
    if max_sequences:
        samples = samples[:max_sequences]
    device = reading_device()
    loaded.model.to(device)
    sizes = read_sizes(loaded, length)
    config = FinetuneConfig(batch_size=batch_size or objective.batch_size, buckets=buckets, seed=seed,
                            objective=objective.name, eval_sequences=objective.eval_sequences)
    run = RunContext.of(loaded, objective, config, sizes, Samples(samples[:0], samples, held_out_documents=docs),
                        accelerator=_OneProcess(device))
    report = dataclasses.replace(objective.evaluate(run), verdict=_verdict(objective, checkpoint, run),
                                 context_use=objective.context_use(run))
    if json_path:
        from posextend.files.atomic import write_file

        write_file(json_path, json.dumps(report.to_dict(), indent=2))
    if plot_path:
        plot_reports({"model": report}, plot_path)
    return report
