"""A fine-tune, set up: load through the objective, extend, cut the data into samples, choose what trains,
and prepare model, optimizer and schedule under accelerate (:func:`setup`, giving a :class:`Run`).

The loop that trains it is :mod:`posextend.training.loop`; what it writes, :mod:`posextend.training.report`.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from posextend.errors import TrainingError
from posextend.files.atomic import write_file
from posextend.files.oserrors import output_errors
from posextend.files.checkpoint import Checkpoint
from posextend.resize.plan import Request
from posextend.scoring.by_position import EvalReport
from posextend.training.context import RunContext
from posextend.training.loading import AnchorOriginal, Loaded, anchor_original
from posextend.training.objectives.base import Objective
from posextend.training.options import FinetuneConfig

if TYPE_CHECKING:
    from posextend.training.saving import FileNames

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class Run(RunContext):
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
    anchor_original: AnchorOriginal = field(default_factory=AnchorOriginal)  # what the anchor term holds to
    adapter: Any = None  # train="lora": the peft model holding the adapter (:mod:`posextend.training.adapters`)

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


def setup(checkpoint: Checkpoint, dst: Path, data: Sequence[str | Path], config: FinetuneConfig,
           chosen: Objective) -> tuple[Run, Loaded]:
    """Load, extend, cut the data into samples, choose what trains, and prepare model, optimizer and
    schedule. ``config`` is resolved (:meth:`FinetuneConfig.resolved`); its ``lr`` is set here when None."""
    from accelerate.utils import set_seed

    from posextend.scoring.text import split

    docs = chosen.documents(data)
    loaded, length, old_len, extended, anchor = _load(chosen, checkpoint, config)
    decoder_length = _resize_decoder(loaded, config)  # None: the decoder shares the run's length
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
    fingerprint = config.fingerprint(src=checkpoint.directory, data=[str(d) for d in data], processes=accelerator.num_processes,
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
    adapter = _lora(loaded, tables, accelerator) if config.train == "lora" else None  # seeded: LoRA's init
    optimizer = _adamw([p for p in model.parameters() if p.requires_grad], config.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, functools.partial(lr_factor, steps=config.steps, schedule=config.schedule))
    prepared, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    run = Run(accelerator=accelerator, model=prepared, unwrapped=accelerator.unwrap_model(prepared),
              tokenizer=tokenizer, config=config, spec=loaded.spec, train_seqs=train_seqs,
              eval_seqs=eval_seqs[: config.eval_sequences], length=length, old_length=old_len,
              short_inputs_fixed=config.train == "new-rows", objective=chosen,
              reference=loaded.reference, state=chosen.State(),
              optimizer=optimizer, scheduler=scheduler, tables=tables, saved_rows=saved_rows, decoder_length=decoder_length,
              state_dir=dst.with_name(dst.name + ".state"), fingerprint=fingerprint, extended=extended,
              anchor_original=anchor, adapter=adapter)
    return run, loaded


def _lora(loaded: Loaded, tables: list[torch.nn.Parameter], accelerator) -> Any:
    """LoRA on the model that holds the tables, in place, with the tables and norms trainable."""
    from posextend.training.adapters import add_lora

    if accelerator.distributed_type.value in ("FSDP", "DEEPSPEED"):
        raise TrainingError("A LoRA run is merged into the model on one process, which sharded training (FSDP, "
                            "DeepSpeed) does not hold whole; use data parallel training, or train every parameter.")
    return add_lora(loaded.hf_model, tables)


def _load(chosen: Objective, checkpoint: Checkpoint, config: FinetuneConfig) -> tuple[Loaded, int, int, bool, AnchorOriginal]:
    """Load through the objective, settle what its anchor holds to while the table is as loaded, then
    extend it when ``config.length`` asks. Returns the loaded model, the run's length and old length,
    whether this run extended the table, and the anchor's reference."""
    length, old_length, init_head, source = config.length, config.old_length, config.init_head, config.source

    if source is not None and chosen.anchor is None:
        raise TrainingError(f"The {chosen.name} objective has no anchor term to hold to a source; "
                            "leave the source unset.")
    anchored = bool(chosen.anchor)
    # an original may replace the frozen copy of the checkpoint: load without making that copy
    may_swap = anchored and (source is not None or "posextend.source" in checkpoint.provenance)
    loaded = (chosen.with_anchor(0) if may_swap else chosen).load(checkpoint, init_head=init_head)
    current = loaded.usable
    extended = length is not None and length != current
    old_len = current if extended else (old_length or loaded.old_length or current)
    length = length if extended else current
    anchor = (anchor_original(checkpoint, source, old_length=old_len, length=length, extended=extended)
              if anchored else AnchorOriginal())
    if anchor.path is not None:  # the original, at its own length
        loaded.reference = chosen.read_reference(anchor.original, init_head=init_head)
    elif may_swap:  # no original to hold to: the checkpoint as loaded, before it is extended
        loaded.reference = chosen.copy_reference(loaded)
    loaded.files = _file_names(loaded, checkpoint)  # as loaded: before the table is extended or trained
    if extended:
        _resize(loaded, Request(length, strategy=config.strategy, group=loaded.spec.group if loaded.decoder else None),
                config.seed)
    return loaded, length, old_len, extended, anchor


def _file_names(loaded: Loaded, checkpoint: Checkpoint) -> FileNames:
    from posextend.training.saving import file_names

    with Checkpoint.open(checkpoint) as source:
        return file_names(loaded.model, loaded.hf_model, source.reader, source.config)


def _resize(loaded: Loaded, request: Request, seed: int) -> None:
    """Carry out ``request`` on the loaded model in place, and keep it: the written checkpoint follows it."""
    from posextend.resize.in_memory import resize_in_memory

    resize_in_memory(loaded.hf_model, request, seed)
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


def _resize_decoder(loaded: Loaded, config: FinetuneConfig) -> int | None:
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
        _resize(loaded, Request(want, strategy=config.strategy, group=decoder.spec.group), config.seed)
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

