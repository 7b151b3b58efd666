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
from posextend.training.objectives.base import default_objective, get_objective
from posextend.training.options import FinetuneConfig
from posextend.training.report import FinetuneReport, finetune_report, save
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


@functools.lru_cache(maxsize=8)
def _epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))


def batch_positions(k: int, batch_size: int, processes: int = 1, process: int = 0) -> range:
    """Global sample numbers of micro-batch ``k`` on process number ``process``.

    Sample ``p`` is sequence ``order(epoch = p // n)[p % n]``; its random choices (masks) are
    drawn from a generator seeded by ``(seed, p)``. So a run is the same function of its
    global batch whatever the number of processes, and resumes on any number of them.
    """
    start = (k * processes + process) * batch_size
    return range(start, start + batch_size)


def batch_indices(k: int, batch_size: int, n: int, seed: int, processes: int = 1, process: int = 0) -> torch.Tensor:
    """Sequence indices of micro-batch ``k`` on process number ``process``: a pure function of its arguments."""
    return torch.stack([_epoch_order(n, seed, p // n)[p % n] for p in batch_positions(k, batch_size, processes, process)])



def _micro_loss(run: Run, k: int) -> tuple[torch.Tensor, int]:
    """Loss of micro-batch ``k`` on this process, scaled so that the processes' gradients average
    to the gradient of the mean over the *global* batch's items (tokens, or pairs); and its tokens."""
    acc = run.accelerator
    positions = batch_positions(k, run.config.batch_size, acc.num_processes, acc.process_index)
    batch = run.train_seqs[batch_indices(k, run.config.batch_size, len(run.train_seqs), run.config.seed, acc.num_processes,
                                         acc.process_index)]
    loss, count = run.objective.loss(run, positions, batch)
    if acc.num_processes > 1:
        total = int(acc.reduce(torch.tensor([count], device=acc.device), "sum").item())
        loss = loss * (count * acc.num_processes / max(total, 1)) if count else loss * 0.0
    return loss, int((batch >= 0).sum())  # the tokens it holds (samples of pairs pad with -1)


def _loop(
    run: Run, start_step: int, steps: int, *, eval_every: int, save_every: int,
    progress: Callable[[int, int, float, float], None] | None,
) -> tuple[list[float], list[tuple[int, float]], int, float]:
    """The shared training loop: accumulation, NaN, Ctrl-C, state saving, progress. Returns
    the losses, the held-out losses, the tokens seen by every process, and the seconds."""
    acc = run.accelerator
    losses: list[float] = []
    eval_losses: list[tuple[int, float]] = []
    tokens = 0
    t0 = time.perf_counter()
    run.model.train()  # gradient checkpointing applies only in training mode (dropout is the objective's choice)
    with _stop_at_step_boundary() as stop_requested:
        for step in range(start_step, steps):
            step_loss = 0.0
            for micro in range(run.config.grad_accum):
                with acc.accumulate(run.model):
                    loss, n = _micro_loss(run, step * run.config.grad_accum + micro)
                    bad = acc.reduce(torch.tensor([0.0 if torch.isfinite(loss) else 1.0], device=acc.device), "sum")
                    if bad.item():
                        run.save_state(step)
                        raise TrainingError(
                            f"The loss became {loss.item()} at step {step}; training stopped. The last good state "
                            f"(step {step}) is in {run.state_dir}: lower the lr (lr={run.config.lr / 3:.2g}) or use mixed_precision=bf16, then resume=True."
                        )
                    acc.backward(loss)
                    run.optimizer.step()
                    run.scheduler.step()
                    run.optimizer.zero_grad()
                step_loss += loss.item() / run.config.grad_accum
                tokens += n * acc.num_processes
            if run.saved_rows:
                with torch.no_grad():
                    for t, rows in zip(run.tables, run.saved_rows):
                        t[: len(rows)] = rows
            losses.append(step_loss)
            if progress and acc.is_main_process:
                progress(step + 1, steps, step_loss, tokens / max(time.perf_counter() - t0, 1e-9))
            if eval_every and (step + 1) % eval_every == 0 and step + 1 < steps:
                mid = run.evaluate()
                eval_losses.append((step + 1, mid.loss))
                log.info("step %d: held-out loss %.4f (perplexity %.2f)", step + 1, mid.loss, mid.perplexity)
            if save_every and (step + 1) % save_every == 0:
                run.save_state(step + 1)
            if stop_requested():
                run.save_state(step + 1)
                raise TrainingError(
                    f"Interrupted after step {step + 1}; state saved in {run.state_dir}: rerun with resume=True to continue."
                )
    return losses, eval_losses, tokens, time.perf_counter() - t0


def _resume_step(run: Run) -> int:
    meta = run.state_dir / "posextend.json"
    if not meta.is_file():
        raise TrainingError(f"Nothing to resume: no saved state at {run.state_dir}; start without resume=True.")
    info = json.loads(meta.read_text())
    if info["fingerprint"] != run.fingerprint:
        raise TrainingError(
            f"Cannot resume: the state in {run.state_dir} was saved by a run with other settings "
            "(source, data, length, train mode, lr, global batch, seed); use the same ones or remove it."
        )
    run.accelerator.load_state(str(run.state_dir))
    log.info("Resuming at step %d from %s", info["step"], run.state_dir)
    return info["step"]


def finetune(
    src: str | Path,
    dst: str | Path,
    data: Sequence[str | Path],
    *,
    progress: Callable[[int, int, float, float], None] | None = None,
    **options: Any,
) -> FinetuneReport:
    """Extend (optionally) and fine-tune ``src``, evaluate before and after, save to ``dst``.

    ``options`` are :class:`~posextend.training.options.FinetuneConfig`'s fields (``length``, ``steps``, ``train``,
    ``lr``, ``objective``, ``anchor``, ``seed`` …); those left out take the objective's defaults
    (:mod:`posextend.training.objectives`: 200 steps for language models, 60 for ``contrastive``; lr and
    schedule by ``train``: with ``all``, causal LMs 1e-3 × min(1, 192 / width) from
    ``interpolate``, contrastive 5e-5, both with a cosine decay; ``tile`` and a constant lr
    otherwise). ``anchor``: the weight of the objective's term that keeps the source model's
    outputs on inputs within the old length (causal 1, contrastive 2, seq2seq 0; 0 turns it off and saves
    the frozen copy of the source it needs).
    ``source``: the original model the anchor holds to, for a checkpoint extended earlier (its
    outputs on inputs within the old length are the ones to keep). Default: the original its
    provenance records, when that is still there and fits (same model type, the recorded old
    length); else the checkpoint as loaded, with one logged line (``report.anchor_note``).
    ``train``: ``new-rows`` trains only the rows beyond the old length (everything else,
    the old rows included, stays bit-identical), ``positions`` the whole table, ``all``
    every parameter. ``progress(step, steps, loss, tokens_per_second)`` is called per step
    (on the main process). Resumable state lives in ``DST.state/`` (``save_every``, Ctrl-C,
    non-finite loss). ``batch_size`` is per process: under ``torchrun`` / ``accelerate launch``
    with N processes the global batch is N × ``batch_size``, and the result equals a
    one-process run with that batch (tested).

    Example::

        >>> report = posextend.finetune("gpt2", "gpt2-2k", ["corpus/"], length=2048, steps=500)
        >>> report.before.perplexity, report.after.perplexity
    """
    checkpoint = Checkpoint.resolve(src)  # the one resolution of src: passed down, its facts read once
    given = FinetuneConfig.of(options)
    chosen = get_objective(given.objective or default_objective(checkpoint))
    if given.anchor is not None:
        chosen = chosen.with_anchor(given.anchor)
    config = given.resolved(chosen)
    dst = Path(dst).expanduser()
    check_destination(checkpoint.directory, dst, overwrite=config.overwrite)
    run, loaded = setup(checkpoint, dst, data, config, chosen)
    config = run.config  # with its lr
    before = None if config.resume else run.evaluate()
    start_step = _resume_step(run) if config.resume else 0
    losses, eval_losses, tokens, seconds = fit_in_memory(run, loaded.hf_model, functools.partial(
        _loop, run, start_step, config.steps, eval_every=config.eval_every, save_every=config.save_every, progress=progress))
    after = run.evaluate()
    run.accelerator.wait_for_everyone()
    report = finetune_report(run, dst, (before, after), (losses, eval_losses), tokens, seconds)
    state_dict = run.accelerator.get_state_dict(run.model)  # every process takes part (sharded weights)
    if run.accelerator.is_main_process:
        save(run, dst, report, checkpoint, loaded, state_dict)
        shutil.rmtree(run.state_dir, ignore_errors=True)
    run.accelerator.wait_for_everyone()
    return report

