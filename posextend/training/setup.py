"""A fine-tune, set up: load through the objective, extend, cut the data into samples, choose what trains,
and prepare model, optimizer and schedule under accelerate (:func:`setup`, giving a :class:`Run`).

The loop that trains it is :mod:`posextend.training.loop`; what it writes, :mod:`posextend.training.report`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from posextend.data.heldout import held_out_note
from posextend.errors import TrainingError
from posextend.files.checkpoint import Checkpoint
from posextend.resize.plan import Request
from posextend.scoring.by_position import EvalReport
from posextend.scoring.verdict import Reading
from posextend.training.adapters import add_lora, keep_rows, param_groups
from posextend.training.batches import batch_rows
from posextend.training.best import BestWeights
from posextend.training.budget import Budget, Judge, Schedule
from posextend.training.context import RunContext, Samples
from posextend.training.loading import AnchorOriginal, Loaded, find_original, image_grid
from posextend.training.objectives.base import Objective
from posextend.training.options import FinetuneConfig
from posextend.training.sizes import Sizes, run_sizes

if TYPE_CHECKING:
    from posextend.training.saving import FileNames

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Trainable:
    """What trains and how (:func:`_trainable`): the trained ``tables`` beside every parameter or alone, each one's
    ``saved_rows`` (new-rows: the rows that never change, written back after each step), LoRA's ``adapter``, the
    ``optimizer``, its lr ``scheduler`` and the ``schedule`` that gives its factor by step."""

    tables: list[torch.nn.Parameter]
    saved_rows: list[torch.Tensor]
    adapter: Any  # train="lora": the adapter on the model (:class:`posextend.training.adapters.Lora`); else None
    optimizer: Any
    scheduler: Any
    schedule: Schedule


@dataclass(kw_only=True)
class Run(RunContext):
    """One fine-tune, set up: the objective's view of it (:class:`RunContext`, what the objective is handed)
    and what only the loop, the report and the save need."""

    objective: Objective
    checkpoint: Checkpoint  # the source, resolved once: the save writes into its files and layout
    loaded: Loaded  # as loaded (its transformers model, where its tensors sit in the files), with the resizes' plans
    trainable: Trainable
    state_dir: Path
    fingerprint: str
    anchor_original: AnchorOriginal = field(default_factory=AnchorOriginal)  # what the anchor term holds to
    judge: Judge = field(default_factory=lambda: Judge(Budget("0 steps", steps=0), early=False))  # steps, checks, verdict
    train_documents: Sequence[Any] = ()  # the documents the training samples were cut from (a control trains on them)
    held_out_note: str = ""  # what the verdict is judged on (:func:`posextend.data.heldout.held_out_note`)
    window_note: str = ""  # why the window anchor has the weight it has, when the run chose it (:func:`_window_anchor`)
    best_weights: BestWeights | None = None  # the best check's weights, when the run writes them (a budget)

    extended = property(lambda self: self.sizes.resized,
                        doc="The run extended the table (its length or image grid), not an earlier resize.")

    def evaluate(self) -> EvalReport:  # through the prepared model: sharded weights need every process
        return self.objective.evaluate(self)

    def save_state(self, step: int) -> None:
        from posextend.training.saving import save_state

        save_state(self.accelerator, self.state_dir, step=step, fingerprint=self.fingerprint,
                   planned=self.trainable.schedule.steps)


def make_accelerator(mixed_precision: str, grad_accum: int, *, unused_parameters: bool = False):
    """An Accelerator whose process group is the one the launcher started, or a one-line error.

    Without a GPU, processes started by ``torchrun`` / ``accelerate launch --multi_gpu`` form a
    CPU (gloo) group; accelerate alone would make each of them a separate one-process run.
    ``mixed_precision``: ``auto`` is the launcher's (``accelerate launch --mixed_precision``, or its config
    file) when it gives one, else bf16 autocast on the device accelerate picks when it computes bf16
    natively, else none (:func:`precision_for`); any other value is used as it is.
    ``unused_parameters``: some trainable parameters get no gradient (a sentence-transformers
    model's unused pooler), which DistributedDataParallel must be told.
    """
    import os

    from accelerate import Accelerator, PartialState
    from accelerate.utils import DataLoaderConfiguration, DistributedDataParallelKwargs

    launched = int(os.environ.get("WORLD_SIZE", "1"))
    cpu_group = launched > 1 and not torch.cuda.is_available()
    launcher = os.environ.get("ACCELERATE_MIXED_PRECISION")  # accelerate launch's --mixed_precision or config file
    if mixed_precision == "auto" and launcher:
        if launcher not in ("no", "fp16", "bf16"):
            raise TrainingError(f"The launcher asks for {launcher} precision, which posextend does not train in: "
                                "launch with no, fp16 or bf16.")
        mixed_precision = launcher
        log.info("Mixed precision: %s (the launcher's)", mixed_precision)
    elif mixed_precision == "auto":  # for the device accelerate picks (the state it sets up is the Accelerator's)
        mixed_precision = precision_for(mixed_precision, PartialState(cpu=cpu_group).device)
        log.info("Mixed precision: %s (auto)", mixed_precision)
    _state_for(mixed_precision)
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


def _state_for(mixed_precision: str) -> None:
    """accelerate keeps one ``AcceleratorState`` per process and refuses a second precision in it: a run after
    one in another precision (a notebook, a test session: ``auto`` is bf16 on some CPUs) starts it afresh. The
    process group (``PartialState``) stays."""
    from accelerate.state import AcceleratorState

    if AcceleratorState._shared_state.get("_mixed_precision") not in (None, mixed_precision):
        AcceleratorState._reset_state()


def precision_for(mixed_precision: str, device: torch.device) -> str:
    """The precision accelerate is given for ``mixed_precision`` on ``device``: ``auto`` is ``bf16`` where the
    device computes bf16 natively (a CUDA device of Ampere or later; a CPU with AVX512-BF16 or AMX,
    :func:`cpu_has_native_bf16`), else ``no`` (emulated bf16 is slower than fp32); any other value as it is."""
    if mixed_precision != "auto":
        return mixed_precision
    if device.type == "cpu":
        return "bf16" if cpu_has_native_bf16() else "no"
    if device.type != "cuda":
        return "no"
    try:
        native = torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # torch < 2.4, whose answer is native support only
        native = torch.cuda.is_bf16_supported()
    return "bf16" if native else "no"


def cpu_has_native_bf16() -> bool:
    """The CPU has bf16 matrix instructions (x86 AVX512-BF16 or AMX tiles), so bf16 autocast is faster than
    fp32 there (measured: 1.4x a MiniLM step at 2048 tokens, 1.1-1.2x the quality grid's GPT-2s); without
    them PyTorch emulates bf16, which is slower."""
    checks = (getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
    return any(check is not None and check() for check in checks)


def setup(checkpoint: Checkpoint, dst: Path, data: Sequence[str | Path], config: FinetuneConfig,
          objective: Objective, *, documents: tuple[Sequence[Any], Sequence[Any]] | None = None) -> Run:
    """Load, extend, cut the data into samples, choose what trains, and prepare model, optimizer and
    schedule. ``config`` is resolved (:meth:`FinetuneConfig.resolved`); its ``lr`` is set here when None.
    ``documents``: the data already split, ``(train, held_out)`` (a control trains on a run's own), in place of
    ``data``'s files.

    The objective's hooks, in the order a fine-tune calls them (setup here, then the loop, the report and the save):

    0. :func:`~posextend.training.loop.finetune`: ``accepts`` (each objective's, when none is named), ``with_anchor``
       (an anchor weight given; a window anchor's given weight likewise, else step 2);
    1. ``documents`` (the data, then ``eval_data``), ``for_data``; ``load`` (which calls ``load_model``,
       ``auto_class`` and ``check``; ``with_anchor(0)`` first when an original may replace its frozen copy), then ``read_reference`` (the original) or ``copy_reference``, and
       ``copy_reference`` or ``read_reference`` again for the baseline's unextended model when the anchor keeps none;
    2. ``size_processor``, ``split`` (unless the held-out data is given), ``samples`` (held-out, then training);
       ``window_anchor_for`` (a run that extends and gives no window anchor), ``with_window_anchor``;
       ``batch_size_for`` (through ``config.with_batch_size``, when no batch is given); ``default_lr`` (through ``config.with_lr``, when no lr is given), ``State``;
    3. ``baseline`` and ``baseline_name`` (a run that grows), ``count`` (one batch: tokens per step), ``control_name``;
    4. the loop (:mod:`posextend.training.loop`): ``evaluate``; ``reading`` at step 0; each step ``loss`` and ``count``
       per micro-batch; each check ``evaluate`` (``eval_every``), ``reading`` and ``control``; at the end ``reading``
       and ``control`` when the last check did not read them, ``evaluate``; the exact control (``train_control``):
       setup again, the loop, ``baseline``;
    5. the report: ``notes``, ``context_use``; the save: ``written_config``.
    """
    from accelerate.utils import set_seed

    docs = objective.documents(data) if documents is None else documents[0]
    given_held_out = (documents[1] if documents is not None else
                      objective.documents(config.eval_data) if config.eval_data else None)
    objective = objective.for_data(docs)
    loaded = _load(objective, checkpoint, config)
    sizes = run_sizes(loaded, config)
    anchor_original = _hold_to(objective, checkpoint, loaded, config, sizes)
    unextended = _unextended(objective, checkpoint, loaded, config, sizes)
    config = config.with_strategy(objective, sizes.grows_ranks | ({1} if config.decoder_length else set()))
    _extend(loaded, checkpoint, sizes, config)
    length = sizes.length
    if config.train == "new-rows" and length.old >= length.new:
        raise TrainingError(
            f"Training only new rows needs rows beyond the old length, but the model has {length.new} positions and "
            f"its old length is {length.old}: pass length=N above {length.new}, or old_length=N for a "
            "checkpoint extended elsewhere.")
    objective.size_processor(loaded.processor, sizes)
    samples = _samples(objective, loaded.processor, (docs, given_held_out), length.new, config)
    accelerator = make_accelerator(config.mixed_precision, config.grad_accum,
                                   unused_parameters=objective.unused_parameters)
    objective, config, window_note = _window_anchor(objective, config, unextended, loaded.processor, samples.held_out,
                                                    sizes)
    config = config.with_batch_size(objective, length.old, length.new)  # after the window anchor: it may read it
    tables, keep = _trained_tables(loaded, sizes)
    config = config.with_lr(objective, tables[0].shape[-1])
    # the run is a function of the global batch, so a resume may use another number of processes
    fingerprint = config.fingerprint(src=checkpoint.directory, data=[str(d) for d in data], processes=accelerator.num_processes,
                                     anchor_source=anchor_original.path, precision=accelerator.mixed_precision)
    if anchor_original.note and accelerator.is_main_process:
        (log.info if anchor_original.exact else log.warning)("%s", anchor_original.note)
    set_seed(config.seed)
    trainable = _trainable(loaded, config, objective, accelerator, (tables, keep))
    prepared, optimizer, scheduler = accelerator.prepare(loaded.model, trainable.optimizer, trainable.scheduler)
    run = Run.of(loaded, objective, config, sizes, samples, accelerator=accelerator, model=prepared,
                 objective=objective, checkpoint=checkpoint, loaded=loaded,
                 trainable=replace(trainable, optimizer=optimizer, scheduler=scheduler),
                 state_dir=dst.with_name(dst.name + ".state"), fingerprint=fingerprint, anchor_original=anchor_original,
                 train_documents=samples.train_documents, held_out_note=samples.note, window_note=window_note)
    baseline = _baseline(run, unextended)
    del unextended
    _, tokens = objective.count(batch_rows(0, config.batch_size, samples.train, config.seed, stream=objective.stream))
    run.judge = _judge(objective, config, baseline,
                       tokens_per_step=tokens * config.grad_accum * accelerator.num_processes,
                       control=dict(control_name=objective.control_name(run), old_length=length.old,
                                    extension=objective.extension, whole=objective.whole))
    trainable.schedule.steps = run.judge.steps or objective.steps
    if run.judge.keep_best:
        run.best_weights = BestWeights(prepared, run.state_dir)
    if accelerator.is_main_process and samples.note and baseline is not None:
        (log.warning if "tail" in samples.note else log.info)("The verdict's %s", samples.note)
    return run


def _trainable(loaded: Loaded, config: FinetuneConfig, objective: Objective, accelerator: Any,
               tables: tuple[list[torch.nn.Parameter], list[int]]) -> Trainable:
    """What trains and how: every parameter or the tables (``tables``: the trained tables and each one's kept
    rows), the kept rows of a new-rows run, LoRA's adapter, the optimizer and its lr schedule (its steps are the
    budget's, once known)."""
    model, (trained, keep) = loaded.model, tables
    if config.train == "new-rows" and accelerator.distributed_type.value in ("FSDP", "DEEPSPEED"):
        raise TrainingError(
            "Training only the new rows edits one table's gradients in place, which sharded training (FSDP, "
            "DeepSpeed) does not allow; train the positions or every parameter, or use data parallel training."
        )
    for p in model.parameters():
        p.requires_grad_(config.train == "all")
    for t in trained:
        t.requires_grad_(True)
    saved_rows = _new_rows_only(trained, keep) if config.train == "new-rows" else []
    if config.gradient_checkpointing:
        loaded.hf_model.gradient_checkpointing_enable()
    adapter = _lora(loaded, trained, accelerator) if config.train == "lora" else None  # seeded: LoRA's init
    schedule = Schedule(config.steps or objective.steps, config.schedule)
    optimizer = _adamw(param_groups(adapter, config.lr) if adapter else
                       [p for p in model.parameters() if p.requires_grad], config.lr)
    return Trainable(trained, saved_rows, adapter, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule),
                     schedule)


def _samples(objective: Objective, processor: Any, documents: tuple[Sequence[Any], Sequence[Any] | None], length: int,
             config: FinetuneConfig) -> Samples:
    """The documents split into training and held-out ones (unless ``documents`` gives the held-out ones), each part
    cut by the objective into samples (at most ``config.eval_sequences`` held out)."""
    from posextend.errors import DataError

    docs, given_held_out = documents
    train, held = ((docs, given_held_out) if given_held_out else
                   objective.split(docs, processor=processor, length=length, config=config))
    note = "" if given_held_out else held_out_note(docs, held)
    try:
        eval_samples = objective.samples(processor, held, length)
    except DataError as exc:
        raise DataError(f"The held-out text is too short: {exc}") from None
    return Samples(objective.samples(processor, train, length), eval_samples[: config.eval_sequences], train, held,
                   note)


def _judge(objective: Objective, config: FinetuneConfig, baseline: tuple[Reading, str] | None, *,
           tokens_per_step: int, control: dict[str, Any]) -> Judge:
    """How long the run trains: exactly ``steps`` when given; else ``budget`` (default :data:`DEFAULT_BUDGET`
    for a run with a baseline to beat), stopping early once its reading stops improving (unless the objective trains its whole
    budget); else the objective's steps."""
    from posextend.training.budget import parse_budget
    from posextend.training.options import DEFAULT_BUDGET

    if config.steps is not None:
        budget, early = Budget(f"{config.steps} steps", steps=config.steps), False
    elif config.budget is not None or baseline is not None:
        budget, early = parse_budget(config.budget or DEFAULT_BUDGET), baseline is not None and objective.early_stop
    else:
        budget, early = Budget(f"{objective.steps} steps", steps=objective.steps), False
    reading, name = baseline or (None, "")
    return Judge(budget, early, baseline=reading, baseline_name=name, margin=config.margin, tolerance=config.tolerance,
                 eval_every=config.eval_every, tokens_per_step=tokens_per_step,
                 keep_best=config.steps is None and reading is not None, **control)


def _window_anchor(objective: Objective, config: FinetuneConfig, unextended: torch.nn.Module | None, processor: Any,
                   held_out: Any, sizes: Sizes) -> tuple[Objective, FinetuneConfig, str]:
    """The objective and config with the window anchor's weight where none is given (where the run extends,
    :meth:`Objective.window_anchor_for`, which may read the source) and the line that says why; else as given."""
    if config.window_anchor is not None or objective.window_anchor is None or sizes.length.old >= sizes.length.new:
        return objective, config, ""  # given, no such term, or no new positions to hold (the term is not added)
    if unextended is None:  # no source to read: the objective's weight
        weight, note = objective.window_anchor, ""
    else:
        weight, note = objective.window_anchor_for(unextended, processor, held_out, sizes.length.old)
    if weight is None:
        return objective, config, note
    if note:
        log.info("%s", note)
    return objective.with_window_anchor(weight), replace(config, window_anchor=weight), note


def _baseline(run: Run, unextended: torch.nn.Module | None) -> tuple[Reading, str] | None:
    """The held-out data read without the extension, once, before training, and how it was read; None when
    there is nothing to compare (no extension, no original, or an objective that names no baseline)."""
    reading = None if unextended is None else run.objective.baseline(run, unextended)
    if reading is None:
        return None
    name = run.objective.baseline_name(run)
    if run.accelerator.is_main_process:
        log.info("Baseline (%s): far range %.4g, original range %.4g", name, reading.far, reading.original)
    return reading, name


def _lora(loaded: Loaded, tables: list[torch.nn.Parameter], accelerator) -> Any:
    """LoRA on the model that holds the tables, in place, with the tables and norms trainable."""
    if accelerator.distributed_type.value in ("FSDP", "DEEPSPEED"):
        raise TrainingError("A LoRA run is merged into the model on one process, which sharded training (FSDP, "
                            "DeepSpeed) does not hold whole; use data parallel training, or train every parameter.")
    return add_lora(loaded.hf_model, tables)


def _load(objective: Objective, checkpoint: Checkpoint, config: FinetuneConfig) -> Loaded:
    """Load through the objective, and observe where the loaded tensors sit in the checkpoint's files (before the
    table is extended or trained)."""
    if config.source is not None and objective.anchor is None:
        raise TrainingError(f"The {objective.name} objective has no anchor term to hold to a source; "
                            "leave the source unset.")
    loaded = (objective.with_anchor(0) if _may_swap(objective, checkpoint, config) else objective).load(
        checkpoint, init_head=config.init_head)
    loaded.files = _file_names(loaded, checkpoint)
    loaded.swap_head()  # a head the objective made for the data, now that the files say where the old one sits
    return loaded


def _hold_to(objective: Objective, checkpoint: Checkpoint, loaded: Loaded, config: FinetuneConfig, sizes: Sizes
             ) -> AnchorOriginal:
    """What the anchor holds to, settled while the table is as loaded: the original (its model read as
    ``loaded.reference``), else the checkpoint as loaded (its frozen copy, unless :meth:`Objective.load` made one)."""
    if not objective.anchor:
        return AnchorOriginal()
    anchor_original = find_original(checkpoint, config.source, old_length=sizes.length.old, length=sizes.length.new,
                                    extended=sizes.resized)
    if anchor_original.original is not None:  # the original, at its own length
        loaded.reference = objective.read_reference(anchor_original.original, init_head=config.init_head)
    elif _may_swap(objective, checkpoint, config):  # no original to hold to: the checkpoint as loaded, before it is extended
        loaded.reference = objective.copy_reference(loaded)
    return anchor_original


def _may_swap(objective: Objective, checkpoint: Checkpoint, config: FinetuneConfig) -> bool:
    """An anchored run that may hold to an original (given, or recorded in the provenance): the original would
    replace the frozen copy of the checkpoint, so it is loaded without one."""
    return bool(objective.anchor) and (config.source is not None or "posextend.source" in checkpoint.provenance)


def _unextended(objective: Objective, checkpoint: Checkpoint, loaded: Loaded, config: FinetuneConfig,
                sizes: Sizes) -> torch.nn.Module | None:
    """The model without the extension, which the baseline reads: the anchor's reference when the run keeps
    one, else the checkpoint as loaded (a run that extends it), else the original its provenance records;
    None when there is no extension, or no original to read."""
    if not sizes.grows:
        return None
    if loaded.reference is not None:
        return loaded.reference
    if sizes.resized:
        return objective.copy_reference(loaded)
    given = config.source if objective.anchor else None  # the anchor's original: without an anchor it goes unread
    original = find_original(checkpoint, given, old_length=sizes.length.old, length=sizes.length.new,
                             extended=False).original
    return objective.read_reference(original, init_head=config.init_head) if original else None


def _file_names(loaded: Loaded, checkpoint: Checkpoint) -> FileNames:
    from posextend.training.saving import file_names

    with checkpoint:  # the weights, released once read
        return file_names(loaded.model, loaded.hf_model, checkpoint.reader, checkpoint.config)


def _extend(loaded: Loaded, checkpoint: Checkpoint, sizes: Sizes, config: FinetuneConfig) -> None:
    """Resize the loaded model in place as ``sizes`` ask: its length and image grid, then an encoder-decoder's own
    decoder length (LED). Each resize is planned for the checkpoint's files once and kept (``loaded.plans``): the
    save writes what they say."""
    from posextend.resize.in_memory import resize_in_memory
    from posextend.resize.plan import plan_resize

    length, image, decoder = sizes.length, sizes.image, sizes.decoder
    requests = [Request(length.new if length.resized else None, strategy=config.strategy, params=config.params,
                        pixels=image.new if image and image.resized else None,
                        group=loaded.spec.group if loaded.decoder else None)] if sizes.resized else []
    if decoder is not None and decoder.resized:
        requests.append(Request(decoder.new, strategy=config.strategy, params=config.params,
                                group=loaded.decoder.spec.group))
    for request in requests:
        resize_in_memory(loaded.hf_model, request, config.seed)  # planned for the model's own names and classes
        with checkpoint:  # the shapes, from the weights' headers
            loaded.plans += plan_resize(checkpoint.config, checkpoint.shapes, request)


def _trained_tables(loaded: Loaded, sizes: Sizes) -> tuple[list[torch.nn.Parameter], list[int]]:
    """The tables that train beside (or instead of) every parameter, and each one's rows below the new
    ones: the run's, an extended decoder's of its own length (LED), and an image grid given a new size beside a
    text length (CLIP's vision tower)."""
    named = dict(loaded.model.named_parameters())
    tables = [named[n] for n in loaded.tables]
    keep = [sizes.length.old + loaded.reserved] * len(tables)
    grid = image_grid(loaded) if 2 in sizes.grows_ranks and loaded.spec.rank == 1 else None
    if grid is not None:
        tables += [named[n] for n in grid.tables]
        keep += [0] * len(grid.tables)  # every row of a resampled grid is new
    decoder = loaded.decoder
    if decoder is not None and sizes.decoder.new > sizes.decoder.old:
        tables += [named[n] for n in decoder.tables]
        keep += [decoder.usable + decoder.reserved] * len(decoder.tables)
    return tables, keep


def _new_rows_only(tables: list[torch.nn.Parameter], keep: list[int]) -> list[torch.Tensor]:
    """Let only each table's rows from ``keep`` on learn (their gradient above is zeroed); the kept rows,
    which the loop writes back after each step (an optimizer may still move a row with zero gradient)."""
    return [keep_rows(t, k) for t, k in zip(tables, keep)]


def fit_in_memory(run: Run, hf_model: torch.nn.Module, train: Callable[[], T]) -> T:
    """``train()`` (the loop, from its first step); when that first step runs out of GPU memory, once more with
    gradient checkpointing turned on (``hf_model``'s) and the cache emptied, after one logged line. Nothing
    has trained then, so the run is the one it would have been with checkpointing on from the start. An
    out-of-memory error in a later step, on several processes (they would not agree to retry), or with
    checkpointing on already is raised as a :class:`TrainingError` saying what to change."""
    acc, steps = run.accelerator, []
    accumulated = acc.step  # the accumulation counter a retry starts from again
    optimizer = getattr(run.trainable.optimizer, "optimizer", run.trainable.optimizer)  # accelerate's wrapper holds torch's
    count = getattr(optimizer, "register_step_post_hook", None)  # torch's optimizers (DeepSpeed's has none: no retry)
    hook = count(lambda *_: steps.append(1)) if count else None
    try:
        return train()
    except torch.cuda.OutOfMemoryError as exc:
        checkpointing = hf_model.is_gradient_checkpointing
        if hook is None or steps or acc.num_processes > 1 or checkpointing or not hf_model.supports_gradient_checkpointing:
            advice = [*([] if checkpointing else ["turn gradient checkpointing on"]),
                      *(["use bf16"] if acc.mixed_precision == "no" else []),
                      "lower the batch size (a larger grad_accum keeps the global batch)"]
            after = f" after {len(steps)} optimizer step(s)" if hook else ""
            raise TrainingError(f"Out of GPU memory{after} ({str(exc).splitlines()[0]}): {', or '.join(advice)}.") from exc
    finally:
        if hook:
            hook.remove()
    # out of the except block: the error, and the frames holding the step's activations, are gone
    run.trainable.optimizer.zero_grad()
    acc.step = accumulated
    hf_model.gradient_checkpointing_enable()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    log.warning("The first step did not fit in GPU memory: training with gradient checkpointing on (slower, less memory)")
    return train()


def _adamw(params: list[torch.nn.Parameter] | list[dict[str, Any]], lr: float) -> torch.optim.Optimizer:
    """AdamW without weight decay (``params``: parameters, or groups of them with their own lr): fused where
    this torch has the kernel (CUDA; CPU since torch 2.4, where its step took 14-20 ms against foreach's 91 ms
    for a 16M-parameter GPT-2 on one core; Trainer's default too), else foreach. It is made before accelerate
    moves the model to its device: parameters move in place, so the optimizer steps them there with that device's
    fused kernel."""
    try:
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True)
    except (RuntimeError, TypeError):  # an older torch, or a device without the fused kernel
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, foreach=True)
