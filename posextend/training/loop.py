"""Short fine-tune that adapts the new positions (accelerate: CPU, one GPU, many).

``finetune`` is setup (:mod:`posextend.training.setup`: load through the objective, extend, cut the
data into samples, choose what trains), the shared loop here (accumulation, resume, NaN, Ctrl-C,
progress, distribution) and the output (:mod:`posextend.training.report`: the report, and saving
through the atomic writer). What is trained and how it is scored is the objective's
(:mod:`posextend.training.objectives`). Samples are addressed by their global number: the order is a
pure function of (seed, epoch) and every random choice of a sample of (seed, number), so a run
on N processes equals one process with the same global batch, and ``resume`` continues a run
on any number of processes. Several processes::

    torchrun --nproc_per_node 4 -m posextend.cli finetune SRC DST --data corpus/ --length 2048
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from posextend.errors import TrainingError
from posextend.files.checkpoint import Checkpoint
from posextend.files.sources import check_destination
from posextend.resize.size import check_extension_size
from posextend.training.objectives.base import default_objective, get_objective
from posextend.training.options import FinetuneConfig
from posextend.scoring.verdict import Reading
from posextend.training.batches import batch_positions, batch_rows
from posextend.training.budget import PROBE_STEPS
from posextend.training.report import FinetuneReport, Trained, finetune_report, save
from posextend.training.setup import Run, fit_in_memory, setup

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _stop_at_step_boundary() -> Iterator[Callable[[], bool]]:
    """Ctrl-C asks to stop after the current step (so saved state is consistent); twice, stops now."""
    requested = []
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return

    def handler(signum, frame):
        if requested:
            raise KeyboardInterrupt
        requested.append(signum)
        log.warning("Stopping after this step and saving state (Ctrl-C again to stop at once)")

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: bool(requested)
    finally:
        signal.signal(signal.SIGINT, previous)


def _micro_loss(run: Run, k: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """Loss of micro-batch ``k`` on this process, scaled so that the processes' gradients average
    to the gradient of the mean over the *global* batch's items (tokens, or pairs); and its items and tokens,
    as its objective counts them (:meth:`Objective.count`)."""
    acc = run.accelerator
    positions = batch_positions(k, run.config.batch_size, acc.num_processes, acc.process_index)
    batch = batch_rows(k, run.config.batch_size, run.train_samples, run.config.seed, acc.num_processes, acc.process_index,
                       stream=run.objective.stream)
    loss, count = run.objective.loss(run, positions, batch)
    if acc.num_processes > 1:
        total = int(acc.reduce(torch.tensor([count], device=acc.device), "sum").item())
        loss = loss * (count * acc.num_processes / max(total, 1)) if count else loss * 0.0
    return loss, run.objective.count(batch)


def _step(run: Run, step: int) -> tuple[float, int, int]:
    """One optimizer step (its micro-batches accumulated): its loss and the items and tokens every process saw.
    A non-finite loss saves the last good state and stops the run."""
    acc, trainable = run.accelerator, run.trainable
    step_loss, items, tokens = 0.0, 0, 0
    for micro in range(run.config.grad_accum):
        with acc.accumulate(run.model):
            loss, (m, n) = _micro_loss(run, step * run.config.grad_accum + micro)
            bad = acc.reduce(torch.tensor([0.0 if torch.isfinite(loss) else 1.0], device=acc.device), "sum")
            if bad.item():
                run.save_state(step)
                raise TrainingError(
                    f"The loss became {loss.item()} at step {step}; training stopped. The last good state "
                    f"(step {step}) is in {run.state_dir}: lower the lr (lr={run.config.lr / 3:.2g}) or use mixed_precision=bf16, then resume=True."
                )
            acc.backward(loss)
            trainable.optimizer.step()
            trainable.scheduler.step()
            trainable.optimizer.zero_grad()
        step_loss += loss.item() / run.config.grad_accum
        items, tokens = items + m * acc.num_processes, tokens + n * acc.num_processes
    if trainable.saved_rows:
        with torch.no_grad():
            for t, rows in zip(trainable.tables, trainable.saved_rows):
                t[: len(rows)] = rows
    return step_loss, items, tokens


def _all_agree(run: Run, flag: bool) -> bool:
    """True on every process when it is on any (the budget and the checks' share are read by each process's
    own clock)."""
    if run.accelerator.num_processes == 1:
        return flag
    return bool(run.accelerator.reduce(torch.tensor([float(flag)], device=run.accelerator.device), "sum").item())


def _check(run: Run, step: int, eval_losses: list[tuple[int, float]]) -> bool:
    """The held-out check after ``step``: the loss curve with ``eval_every``, the judge's reading (a better one's
    weights kept, when the run writes its best check); True when the run has stopped improving and may stop."""
    if run.config.eval_every:
        mid = run.evaluate()
        eval_losses.append((step, mid.loss))
        log.info("step %d: held-out loss %.4f (%s %.2f)", step, mid.loss, mid.metric, getattr(mid, mid.score))
    stop = run.judge.check(step, lambda: run.objective.reading(run), lambda: run.objective.control(run))
    if run.best_weights is not None and run.judge.best is not None and run.judge.best.step == step:
        run.best_weights.take(step)
    if run.judge.curve and run.accelerator.is_main_process:
        point = run.judge.curve[-1]
        log.info("step %d: far range %.4g, original range %.4g", step, point.far, point.original)
    return stop


def _loop(run: Run, start_step: int, *, save_every: int, progress: Callable[[int, int, float, float], None] | None,
          ) -> Trained:
    """The shared training loop: steps until the judge's budget is spent or the run is worth it
    (:class:`posextend.training.budget.Judge`), held-out checks, Ctrl-C, state saving, progress."""
    judge, schedule, trained = run.judge, run.trainable.schedule, Trained()
    step = start_step
    run.model.train()  # gradient checkpointing applies only in training mode (dropout is the objective's choice)
    with _stop_at_step_boundary() as stop_requested:
        while judge.budget.seconds is not None or step < schedule.steps:
            t0 = time.perf_counter()
            loss, items, tokens = _step(run, step)
            trained.seconds += time.perf_counter() - t0
            step, trained.items, trained.tokens = step + 1, trained.items + items, trained.tokens + tokens
            trained.losses.append(loss)
            if judge.budget.seconds is not None and step - start_step == PROBE_STEPS:
                schedule.steps = judge.planned(step, trained.seconds * step / PROBE_STEPS)
            if progress and run.accelerator.is_main_process:
                progress(step, schedule.steps, loss, trained.tokens / max(trained.seconds, 1e-9))
            done = _all_agree(run, judge.spent(step)) if judge.budget.seconds is not None else step >= schedule.steps
            if not done and _all_agree(run, judge.check_due(step, schedule.steps)) and _check(run, step, trained.eval_losses):
                break
            if save_every and step % save_every == 0:
                run.save_state(step)
            if stop_requested():
                run.save_state(step)
                raise TrainingError(
                    f"Interrupted after step {step}; state saved in {run.state_dir}: rerun with resume=True to continue."
                )
            if done:
                break
    return trained


def _resume_step(run: Run) -> int:
    meta = run.state_dir / "posextend.json"
    if not meta.is_file():
        raise TrainingError(f"Nothing to resume: no saved state at {run.state_dir}; start without resume=True.")
    info = json.loads(meta.read_text())
    if info["fingerprint"] != run.fingerprint:
        raise TrainingError(
            f"Cannot resume: the state in {run.state_dir} was saved by a run with other settings "
            "(source, data, length, train mode, lr, global batch, seed, precision); use the same ones or remove it."
        )
    run.accelerator.load_state(str(run.state_dir))
    run.trainable.schedule.steps = info.get("planned", run.trainable.schedule.steps)
    log.info("Resuming at step %d from %s", info["step"], run.state_dir)
    return info["step"]


def _final_reading(run: Run, steps: int) -> tuple[Reading | None, int]:
    """The reading the verdict is given on, and the step whose weights the run writes: the best check's, its
    weights put back, when the run keeps its best (a budget) and the last step is not it; else the last check's
    when it was at the last step, or a new one. The model's own control (:meth:`Objective.control`) is read beside
    it, now, unless the check it comes from read it."""
    judge, last = run.judge, run.judge.curve[-1] if run.judge.curve else None
    if judge.baseline is None:
        return None, steps
    if last is not None and last.step == steps:
        reading = judge.reading_at(last)
    else:
        reading = run.objective.reading(run)
        judge.record(steps, reading)
    written, best = steps, judge.best
    if run.best_weights is not None and best is not None and best.step != steps and run.best_weights.step == best.step:
        run.best_weights.restore()
        reading, written = judge.best_reading(), best.step
    if reading is not None and judge.controls_step != written:
        judge.read_controls(written, lambda: run.objective.control(run))
    return reading, written


def _train_control(run: Run, tokens: int, batch_size: int | None,
                   progress: Callable[[int, int, float, float], None] | None) -> None:
    """The exact control: the source fine-tuned at its own length on the run's training documents and as many
    tokens (its lr, schedule and anchor; ``batch_size``, the one the run was given, else what a run at the old
    length takes: the objective's), read as the baseline reads the source (its window, or chunks) on
    the run's held-out data; kept among the judge's controls, which the verdict asks the far range to beat. What the
    user would get by fine-tuning without extending. The run's optimizer state is let go first (its memory)."""
    config = dataclasses.replace(run.config, length=None, decoder_length=None, budget=None, eval_every=0,
                                 save_every=0, resume=False, train_control=False, steps=1, batch_size=batch_size)
    run.trainable.optimizer.zero_grad(set_to_none=True)
    getattr(run.trainable.optimizer, "optimizer", run.trainable.optimizer).state.clear()
    control = setup(run.checkpoint, run.state_dir.with_name(run.state_dir.name + "-control"), [], config, run.objective,
                       documents=(run.train_documents, run.eval_documents))
    per_step, schedule = control.judge.tokens_per_step, control.trainable.schedule
    schedule.steps = max(1, round(tokens / per_step))  # its lr schedule over them, as the run's
    if run.accelerator.is_main_process:
        log.info("Training the control: the source at its own %d positions, %d steps of %d tokens (%d in all)",
                 run.sizes.length.old, schedule.steps, per_step, schedule.steps * per_step)
    _loop(control, 0, save_every=0, progress=progress)
    reading = run.objective.baseline(run, control.unwrapped)
    if reading is not None:
        name = "the source fine-tuned at its own length on the same tokens, read the same way"
        run.judge.controls = {**run.judge.controls, name: reading}


def finetune(
    src: str | Path,
    dst: str | Path,
    data: Sequence[str | Path],
    *,
    progress: Callable[[int, int, float, float], None] | None = None,
    revision: str | None = None,
    **options: Any,
) -> FinetuneReport:
    """Extend (optionally) and fine-tune ``src`` while its held-out reading improves, evaluate before and after,
    save its best check to ``dst``.

    A run that extends measures its baseline first: the source reading held-out text (a few percent of
    ``data``, whole documents where it has several, never trained on; or ``eval_data``) its own way, through its
    own window (:meth:`Objective.baseline <posextend.training.objectives.base.Objective.baseline>`). It then trains
    until its held-out reading stops improving (:data:`~posextend.training.budget.PATIENCE` checks in a row without
    a better one) or its ``budget`` (a time, tokens or steps; default 15 minutes) is spent, and writes the weights
    of its best check; ``steps`` trains exactly that many and writes the last. ``report.verdict`` says whether it
    is worth it: the far range beats the baseline and the controls by ``margin``, the original range within
    ``tolerance`` (:class:`~posextend.scoring.verdict.Verdict`).

    Args:
        src: the checkpoint: a folder (transformers or sentence-transformers), or a Hugging Face Hub id
            (downloaded into its cache); the original with ``length``, or one extended already.
        dst: where the fine-tuned model is written, in the source's files and layout (atomically).
        data: text files, folders of them, or JSON Lines with a ``"text"`` field (seq2seq: also
            ``source``/``target`` pairs).
        progress: called as ``progress(step, steps, loss, tokens_per_second)`` after each step (on the main
            process; ``steps`` is the budget's plan, which a time budget sets once the first steps are timed).
        revision: for a hub id, the branch, tag or commit downloaded (default: main).
        **options: :class:`~posextend.training.options.FinetuneConfig`'s fields: ``length``, ``budget``,
            ``steps``, ``train`` (``all``, ``positions``, ``new-rows``: only the rows beyond the old length
            train, everything else stays bit-identical), ``lr``, ``objective``, ``anchor`` (the weight of the
            term keeping the source's outputs on inputs within the old length: causal 1, contrastive 2,
            seq2seq 0), ``window_anchor`` (the weight of the term holding the new positions to the model's own
            reading through its old window: causal 1), ``source`` (the original the anchor holds to, for a
            checkpoint extended earlier:
            default, the one its provenance records), ``eval_data``, ``seed`` …; those left out take the
            objective's defaults. ``batch_size`` is per process: under ``torchrun`` / ``accelerate launch``
            with N processes the global batch is N × ``batch_size``, and the result equals a one-process run
            with that batch (tested). Resumable state lives in ``DST.state/`` (``save_every``, Ctrl-C, a
            non-finite loss; ``resume``).

    Returns:
        A :class:`~posextend.training.report.FinetuneReport`: the options as resolved, the steps and tokens
        trained, the held-out evaluations before and after, and ``verdict``.

    Examples:
        >>> report = posextend.finetune("openai-community/gpt2", "gpt2-2k",
        ...                             ["corpus/"], length=2048)
        >>> report.before.perplexity, report.after.perplexity
    """
    started = time.perf_counter()  # a time budget is the whole run's: loading, the baseline and the checks count
    checkpoint = Checkpoint.resolve(src, revision=revision)  # the one resolution of src: passed down, its facts read once
    given = FinetuneConfig.of(options)
    objective = get_objective(given.objective or default_objective(checkpoint))
    if given.anchor is not None:
        objective = objective.with_anchor(given.anchor)
    if given.window_anchor is not None:
        objective = objective.with_window_anchor(given.window_anchor)
    config = given.resolved(objective)
    dst = Path(dst).expanduser()
    check_destination(checkpoint.directory, dst, overwrite=config.overwrite)
    with checkpoint:  # the weights' headers, released before training
        check_extension_size(checkpoint, dst, config.length, decoder_length=config.decoder_length)
    run = setup(checkpoint, dst, data, config, objective)
    config = run.config  # with its lr
    run.judge.start = started
    before = None if config.resume else run.evaluate()
    start_step = _resume_step(run) if config.resume else 0
    if not config.resume:
        run.judge.check(0, lambda: run.objective.reading(run))
    trained = fit_in_memory(run, run.loaded.hf_model, functools.partial(
        _loop, run, start_step, save_every=config.save_every, progress=progress))
    steps = start_step + len(trained.losses)
    reading, written = _final_reading(run, steps)  # the best check's weights put back, when it is not the last step
    after = run.evaluate()
    if config.train_control and reading is not None:
        _train_control(run, trained.tokens, given.batch_size, progress)
    verdict = run.judge.verdict(reading)
    run.accelerator.wait_for_everyone()
    run.config = dataclasses.replace(run.config, steps=steps)  # the steps it trained
    report = finetune_report(run, dst, (before, after), trained, verdict, written_step=written)
    state_dict = run.accelerator.get_state_dict(run.model)  # every process takes part (sharded weights)
    if run.accelerator.is_main_process:
        save(run, dst, report, state_dict)
        shutil.rmtree(run.state_dir, ignore_errors=True)
    run.accelerator.wait_for_everyone()
    return report

