"""Short fine-tune that adapts the new positions (accelerate: CPU, one GPU, many).

``finetune`` is setup (load through the objective, extend, cut the data into samples, choose
what trains), the shared loop (accumulation, resume, NaN, Ctrl-C, progress, distribution) and
saving through the atomic writer. What is trained and how it is scored is the objective's
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
import math
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from posextend.version import __version__
from posextend.resize.on_disk import ResizeReport, model_card, resize_change, resize_report
from posextend.training.context import RunContext
from posextend.errors import TrainingError
from posextend.scoring.by_position import EvalReport
from posextend.files.io import atomic_output, output_errors, write_file
from posextend.training.loading import AnchorSource, Loaded, anchor_source, is_sentence_transformer, provenance
from posextend.training.objectives.base import Objective, default_objective, get_objective
from posextend.training.options import FinetuneConfig
from posextend.resize.plan import Request, plan_resize
from posextend.files.sources import MODULES, check_destination, opened, resolve_source

if TYPE_CHECKING:
    from posextend.training.saving import FileNames

log = logging.getLogger(__name__)


@dataclass
class FinetuneReport:
    dst: str
    train: str
    objective: str
    steps: int
    old_length: int
    new_length: int
    lr: float
    batch_size: int
    grad_accum: int
    tokens: int
    seconds: float
    tokens_per_second: float
    losses: list[float] = field(default_factory=list)
    eval_losses: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out loss), with --eval-every
    before: EvalReport | None = None
    after: EvalReport | None = None
    processes: int = 1  # processes that trained together (tokens count all of them)
    main_process: bool = True  # False on the other processes of a distributed run (they print nothing)
    strategy: str | None = None  # how the table was extended before training (None: it came extended)
    anchor: float = 0.0  # the objective's anchor weight (0: none)
    schedule: str = "constant"
    anchor_source: str | None = None  # the original model the anchor held to (None: the checkpoint as loaded)
    anchor_note: str | None = None  # one line: why the anchor could not hold to the original model
    notes: list[str] = field(default_factory=list)  # the objective's lines about the run (Objective.notes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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


def batch_positions(k: int, batch_size: int, world: int = 1, rank: int = 0) -> range:
    """Global sample numbers of micro-batch ``k`` on process ``rank``.

    Sample ``p`` is sequence ``order(epoch = p // n)[p % n]``; its random choices (masks) are
    drawn from a generator seeded by ``(seed, p)``. So a run is the same function of its
    global batch whatever the number of processes, and resumes on any number of them.
    """
    start = (k * world + rank) * batch_size
    return range(start, start + batch_size)


def batch_indices(k: int, batch_size: int, n: int, seed: int, world: int = 1, rank: int = 0) -> torch.Tensor:
    """Sequence indices of micro-batch ``k`` on process ``rank``: a pure function of its arguments."""
    return torch.stack([_epoch_order(n, seed, p // n)[p % n] for p in batch_positions(k, batch_size, world, rank)])


@dataclass(kw_only=True)
class _Run(RunContext):
    """One fine-tune, set up: the objective's view of it (:class:`RunContext`, what the objective is handed)
    and what only the loop and the state files need."""

    objective: Objective
    optimizer: Any
    scheduler: Any
    tables: list[torch.nn.Parameter]
    saved_rows: list[torch.Tensor]  # new-rows: each table's rows that never change
    state_dir: Path
    fingerprint: str
    extended: bool = False  # the table was extended by this run (not by an earlier resize)
    reference: AnchorSource = field(default_factory=AnchorSource)  # what the anchor term holds to

    def evaluate(self) -> EvalReport:  # through the prepared model: sharded weights need every process
        return self.objective.evaluate(self)

    def save_state(self, step: int) -> None:
        with output_errors(self.state_dir):
            self.accelerator.save_state(str(self.state_dir))
            if self.accelerator.is_main_process:
                write_file(self.state_dir / "posextend.json", json.dumps({"step": step, "fingerprint": self.fingerprint}))


def make_accelerator(mixed_precision: str, grad_accum: int, *, unused_parameters: bool = False):
    """An Accelerator whose process group is the one the launcher started, or a one-line error.

    Without a GPU, processes started by ``torchrun`` / ``accelerate launch --multi_gpu`` form a
    CPU (gloo) group; accelerate alone would make each of them a separate one-process run.
    ``unused_parameters``: some trainable parameters get no gradient (a sentence-transformers
    model's unused pooler), which DistributedDataParallel must be told.
    """
    import os

    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, DistributedDataParallelKwargs

    launched = int(os.environ.get("WORLD_SIZE", "1"))
    cpu_group = launched > 1 and not torch.cuda.is_available()
    ddp = DistributedDataParallelKwargs(find_unused_parameters=unused_parameters)
    # split_batches: posextend addresses each process's samples itself (no accelerate dataloader), and a
    # prepared schedule must advance once per optimizer step; without it accelerate steps it once per
    # process, so under N processes the warm-up and the cosine decay would run N times too fast
    accelerator = Accelerator(mixed_precision=mixed_precision, gradient_accumulation_steps=grad_accum, cpu=cpu_group,
                              kwargs_handlers=[ddp], dataloader_config=DataLoaderConfiguration(split_batches=True))
    if accelerator.num_processes != launched:
        raise TrainingError(
            f"The launcher started {launched} processes (WORLD_SIZE) but accelerate formed a group of "
            f"{accelerator.num_processes}: each process would train alone and all would write the same output. "
            "Launch with torchrun --nproc_per_node N, or accelerate launch with a multi-process config."
        )
    return accelerator


def _setup(directory: Path, dst: Path, data: Sequence[str | Path], config: FinetuneConfig,
           chosen: Objective) -> tuple[_Run, Loaded]:
    """Load, extend, cut the data into samples, choose what trains, and prepare model, optimizer and
    schedule. ``config`` is resolved (:meth:`FinetuneConfig.resolved`); its ``lr`` is set here when None."""
    from accelerate.utils import set_seed

    from posextend.scoring.text import split

    docs = chosen.documents(data)
    loaded, length, old_len, extended, anchor = _load(chosen, directory, config)
    decoder_length = _extend_decoder(loaded, config)  # None: the decoder shares the run's length
    model, tokenizer = loaded.model, loaded.tokenizer
    if config.train == "new-rows" and old_len >= length:
        raise TrainingError(
            f"Training only new rows needs rows beyond the old length, but the model has {length} positions and its old length is "
            f"{old_len}: pass length=N above {length}, or old_length=N for a checkpoint extended elsewhere."
        )
    tokenizer.model_max_length = length
    train_seqs, eval_seqs = split(chosen.samples(tokenizer, docs, length))
    accelerator = make_accelerator(config.mixed_precision, config.grad_accum, unused_parameters=chosen.unused_parameters)
    if config.train == "new-rows" and accelerator.distributed_type.value in ("FSDP", "DEEPSPEED"):
        raise TrainingError(
            "Training only the new rows edits one table's gradients in place, which sharded training (FSDP, "
            "DeepSpeed) does not allow; train the positions or every parameter, or use data parallel training."
        )
    tables, keep = _trained_tables(loaded, old_len, decoder_length)
    config = config.with_lr(chosen, tables[0].shape[-1])
    # the run is a function of the global batch, so a resume may use another number of processes
    fingerprint = config.fingerprint(src=directory, data=[str(d) for d in data], processes=accelerator.num_processes,
                                     anchor_source=anchor.path)
    if anchor.note and accelerator.is_main_process:
        (log.info if anchor.exact else log.warning)("%s", anchor.note)
    for p in model.parameters():
        p.requires_grad_(config.train == "all")
    for t in tables:
        t.requires_grad_(True)
    saved_rows = _new_rows_only(tables, keep) if config.train == "new-rows" else []
    if config.gradient_checkpointing:
        loaded.hf_model.gradient_checkpointing_enable()
    set_seed(config.seed)
    optimizer = _adamw([p for p in model.parameters() if p.requires_grad], config.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, functools.partial(lr_factor, steps=config.steps, schedule=config.schedule))
    prepared, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    run = _Run(accelerator=accelerator, model=prepared, unwrapped=accelerator.unwrap_model(prepared),
               tokenizer=tokenizer, config=config, spec=loaded.spec, train_seqs=train_seqs,
               eval_seqs=eval_seqs[: config.eval_sequences], length=length, old_length=old_len,
               short_inputs_fixed=config.train == "new-rows", objective=chosen,
               source=loaded.source, state=chosen.State(),
               optimizer=optimizer, scheduler=scheduler, tables=tables, saved_rows=saved_rows, decoder_length=decoder_length,
               state_dir=dst.with_name(dst.name + ".state"), fingerprint=fingerprint, extended=extended,
               reference=anchor)
    return run, loaded


def _load(chosen: Objective, directory: Path, config: FinetuneConfig) -> tuple[Loaded, int, int, bool, AnchorSource]:
    """Load through the objective, settle what its anchor holds to while the table is as loaded, then
    extend it when ``config.length`` asks. Returns the loaded model, the run's length and old length,
    whether this run extended the table, and the anchor's reference."""
    length, old_length, init_head, source = config.length, config.old_length, config.init_head, config.source

    if source is not None and chosen.anchor is None:
        raise TrainingError(f"The {chosen.name} objective has no anchor term to hold to a source; "
                            "leave the source unset.")
    anchored = bool(chosen.anchor)
    # an original may replace the frozen copy of the checkpoint: load without making that copy
    may_swap = anchored and (source is not None or "posextend.source" in provenance(directory))
    loaded = (chosen.with_anchor(0) if may_swap else chosen).load(directory, init_head=init_head)
    current = loaded.usable
    extended = length is not None and length != current
    old_len = current if extended else (old_length or loaded.old_length or current)
    length = length if extended else current
    anchor = (anchor_source(directory, source, old_length=old_len, length=length, extended=extended)
              if anchored else AnchorSource())
    if anchor.path is not None:  # the original, at its own length
        loaded.source = chosen.read_reference(anchor.path, init_head=init_head)
    elif may_swap:  # no original to hold to: the checkpoint as loaded, before it is extended
        loaded.source = chosen.copy_reference(loaded)
    loaded.files = _file_names(loaded, directory)  # as loaded: before the table is extended or trained
    if extended:
        _extend(loaded, Request(length, strategy=config.strategy, table=loaded.spec.group if loaded.decoder else None),
                config.seed)
    return loaded, length, old_len, extended, anchor


def _file_names(loaded: Loaded, directory: Path) -> FileNames:
    from posextend.training.saving import file_names

    with opened(directory) as (_, config, reader, _shapes):
        return file_names(loaded.model, loaded.hf_model, reader, config)


def _extend(loaded: Loaded, request: Request, seed: int) -> None:
    """Carry out ``request`` on the loaded model in place, and keep it: the written checkpoint follows it."""
    from posextend.resize.in_memory import extend

    extend(loaded.hf_model, request, seed)
    loaded.requests.append(request)


def _trained_tables(loaded: Loaded, old_length: int, decoder_length: int | None
                    ) -> tuple[list[torch.nn.Parameter], list[int]]:
    """The tables that train beside (or instead of) every parameter, and each one's rows below the new
    ones: the run's, and an extended decoder's of its own length (LED)."""
    named = dict(loaded.model.named_parameters())
    tables = [named[n] for n in loaded.tables]
    keep = [old_length + loaded.reserved] * len(tables)
    decoder = loaded.decoder
    if decoder is not None and decoder_length is not None and decoder_length > decoder.usable:
        tables += [named[n] for n in decoder.tables]
        keep += [decoder.usable + decoder.reserved] * len(decoder.tables)
    return tables, keep


def _new_rows_only(tables: list[torch.nn.Parameter], keep: list[int]) -> list[torch.Tensor]:
    """Let only each table's rows from ``keep`` on learn (their gradient above is zeroed); the kept rows,
    which the loop writes back after each step (an optimizer may still move a row with zero gradient)."""
    for t, k in zip(tables, keep):
        t.register_hook(lambda g, k=k: torch.cat([torch.zeros_like(g[:k]), g[k:]]))
    return [t.detach()[:k].clone() for t, k in zip(tables, keep)]


def _extend_decoder(loaded: Loaded, config: FinetuneConfig) -> int | None:
    """Extend the decoder's own table to ``config.decoder_length`` (LED); the decoder's length after, or
    None for a family whose stacks share one length (the run's)."""
    want, decoder = config.decoder_length, loaded.decoder
    if decoder is None:
        if want is not None:
            raise TrainingError(
                f"{loaded.hf_model.config.model_type} has no decoder with a length of its own (its stacks share one, "
                "or it has one stack): leave the decoder's length unset; length=N sizes every table.")
        return None
    if want is not None and want != decoder.usable:
        _extend(loaded, Request(want, strategy=config.strategy, table=decoder.spec.group), config.seed)
    return want or decoder.usable


def _adamw(params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """AdamW without weight decay, fused where this torch supports it (Trainer's default too)."""
    try:
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True)
    except (RuntimeError, TypeError):  # an older torch, or a device without the fused kernel
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


def lr_factor(s: int, *, steps: int, schedule: str) -> float:
    """Linear warm-up over 10% of the steps, then constant or cosine down to 10%."""
    warmup = max(1, steps // 10)
    if s < warmup or schedule == "constant":
        return min(1.0, (s + 1) / warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup)))


def _micro_loss(run: _Run, k: int) -> tuple[torch.Tensor, int]:
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
    run: _Run, start_step: int, steps: int, *, eval_every: int, save_every: int,
    progress: Callable[[int, int, float, float], None] | None, fail_at_step: int | None,
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
                    if fail_at_step == step:
                        loss = loss * float("nan")
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


def _resume_step(run: _Run) -> int:
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
    fail_at_step: int | None = None,  # testing hook: make the loss non-finite at this step
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
    directory = resolve_source(src)
    given = FinetuneConfig.of(options)
    chosen = get_objective(given.objective or default_objective(directory))
    if given.anchor is not None:
        chosen = chosen.with_anchor(given.anchor)
    config = given.resolved(chosen)
    dst = Path(dst).expanduser()
    check_destination(directory, dst, overwrite=config.overwrite)
    run, loaded = _setup(directory, dst, data, config, chosen)
    config = run.config  # with its lr
    before = None if config.resume else run.evaluate()
    start_step = _resume_step(run) if config.resume else 0
    losses, eval_losses, tokens, seconds = _loop(run, start_step, config.steps, eval_every=config.eval_every,
                                                 save_every=config.save_every, progress=progress,
                                                 fail_at_step=fail_at_step)
    after = run.evaluate()
    run.accelerator.wait_for_everyone()
    report = _report(run, dst, (before, after), (losses, eval_losses), tokens, seconds)
    state_dict = run.accelerator.get_state_dict(run.model)  # every process takes part (sharded weights)
    if run.accelerator.is_main_process:
        _save(run, dst, report, directory, loaded, state_dict)
        shutil.rmtree(run.state_dir, ignore_errors=True)
    run.accelerator.wait_for_everyone()
    return report


def _report(run: _Run, dst: Path, evaluations: tuple[EvalReport | None, EvalReport],
            losses: tuple[list[float], list[tuple[int, float]]], tokens: int, seconds: float) -> FinetuneReport:
    """The fine-tune's report: its options, throughput, losses (held-out ones at steps 0 and the last
    included) and the before/after evaluations."""
    (before, after), (train_losses, eval_losses), config = evaluations, losses, run.config
    return FinetuneReport(
        dst=str(dst.resolve()), train=config.train, objective=run.objective.name, steps=config.steps,
        old_length=run.old_length, new_length=run.length, lr=config.lr,
        batch_size=config.batch_size, grad_accum=config.grad_accum, tokens=tokens, seconds=seconds,
        tokens_per_second=tokens / max(seconds, 1e-9), losses=train_losses,
        eval_losses=([(0, before.loss)] if before else []) + eval_losses + [(config.steps, after.loss)],
        before=before, after=after, processes=run.accelerator.num_processes,
        main_process=run.accelerator.is_main_process, strategy=config.strategy if run.extended else None,
        anchor=run.objective.anchor or 0.0, schedule=config.schedule,
        anchor_source=str(run.reference.path) if run.reference.path else None, anchor_note=run.reference.note,
        notes=run.objective.notes(run),
    )


def _save(run: _Run, dst: Path, report: FinetuneReport, src: Path, loaded: Loaded,
          state_dict: dict[str, torch.Tensor]) -> None:
    """The fine-tuned model, written by the checkpoint writer of ``resize-model`` into the source's files and
    layout (:mod:`posextend.training.saving`), with provenance and a model card.

    ``state_dict``: the trained model's full weights (gathered when sharded across processes: FSDP, DeepSpeed).
    """
    from posextend.training.saving import changes, write_trained

    seed = run.config.seed
    with opened(src) as (directory, config, reader, shapes):
        plans = [plan for request in loaded.requests for plan in plan_resize(config, shapes, request)]
        resized = resize_change(reader, config, plans, seed)
        trained, added = changes(state_dict, run.unwrapped, loaded.files, reader)
        resize = resize_report(directory, dst, plans, config, seed) if plans else None
        change = dataclasses.replace(resized, tensors={**resized.tensors, **trained}, added=added,
                                     metadata=_provenance(run, report, directory, resize))
        with atomic_output(dst, overwrite=run.config.overwrite) as tmp:
            written = write_trained(directory, tmp, change, config, reader, type(loaded.hf_model))
            _save_modules(loaded, directory, tmp, run.config.train)
            if resize is not None:
                resize.record(written)
            (tmp / "README.md").write_text(_card(report, resize, directory))
            if report.before or report.after:
                (tmp / "posextend_eval.json").write_text(json.dumps(
                    {"before": report.before and report.before.to_dict(), "after": report.after.to_dict()}, indent=2))
    log.info("Saved %s: %d tensors trained, %d added, the rest copied from %s", dst, len(trained), len(added), directory)


def _provenance(run: _Run, report: FinetuneReport, directory: Path, resize: ResizeReport | None) -> dict[str, str]:
    """The output's provenance: the resize the run made (or the original recorded before it, or the
    checkpoint itself), its lengths, and the fine-tune."""
    finetune = {"posextend.finetune": json.dumps({"train": report.train, "steps": report.steps, "lr": report.lr,
                                                   "tokens": report.tokens})}
    if resize is not None:
        return {**resize.provenance(), **finetune}
    recorded = provenance(directory).get("posextend.source", str(directory))
    return {"posextend.version": __version__,
            "posextend.source": str(run.reference.path) if run.reference.path else recorded,
            "posextend.old_length": str(report.old_length), "posextend.new_length": str(report.new_length), **finetune}


def _save_modules(loaded: Loaded, directory: Path, out: Path, train: str) -> None:
    """A sentence-transformers model's modules beyond the Transformer that trained (a Dense layer, when every
    parameter trains): saved by the module's own ``save`` over its copied folder."""
    if train != "all" or loaded.model is loaded.hf_model or not is_sentence_transformer(directory):
        return
    for entry in json.loads((directory / MODULES).read_text()):
        module = loaded.model[int(entry["idx"])]
        if getattr(module, "auto_model", None) is not loaded.hf_model and any(True for _ in module.parameters()):
            module.save(str(out / entry["path"]))


def _card(report: FinetuneReport, resize: ResizeReport | None, directory: Path) -> str:
    """The output's model card: the resize the run made (and the source's card under it), or the source's
    card as it is; then the fine-tune."""
    source = directory / "README.md"
    original = source.read_text(errors="replace") if source.is_file() else ""
    if resize is not None:
        head = model_card(resize, original, trained=True).rstrip()
    else:
        head = original.rstrip() or f"---\ntags:\n- posextend\n---\n\n# Fine-tuned with posextend {__version__}"
    lines = [head, "", "## Fine-tune", "",
             f"- Trained: `{report.train}` for {report.steps} steps ({report.tokens} tokens, lr {report.lr}) "
             f"at {report.new_length} positions (old length {report.old_length})"]
    for label, ev in (("before", report.before), ("after", report.after)):
        if ev is not None and math.isfinite(getattr(ev, ev.score)):
            lines.append(f"- Held-out {ev.metric} {label}: {getattr(ev, ev.score):.3f}")
    lines += [f"- {note}" for note in report.notes]
    return "\n".join(lines) + "\n"
