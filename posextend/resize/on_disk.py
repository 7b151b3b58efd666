"""File-to-file surgery: resize the position table(s) of a checkpoint on disk, and verify the result.

The model is never instantiated. Tensors are addressed by name; the table(s) and
length-dependent buffers are rebuilt, and :mod:`posextend.resize.writer` writes them with every other
tensor's bytes passed through, shards that hold nothing to change copied whole (or hard-linked),
``config.json`` and ``tokenizer_config.json`` edited as JSON; the result appears at ``dst``
only when complete and checked. The checkpoint, resolved once: :mod:`posextend.files.checkpoint`;
what it holds: :mod:`posextend.resize.inspection`; the report and model card: :mod:`posextend.resize.report`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from posextend.errors import CorruptCheckpointError, InvalidLengthError, StrategyError
from posextend.files.checkpoint import Checkpoint
from posextend.files.atomic import atomic_output
from posextend.files.reader import CheckpointReader, nonfinite_count
from posextend.files.tensorfile import ByteRanges, Entry, TensorData
from posextend.files.sources import check_destination, json_int, read_config
from posextend.families.renames import names_on_load
from posextend.families.specs import Layout
from posextend.families.twin import layout_class
from posextend.tables.strategies import get_strategy
from posextend.resize.options import ResizeOptions
from posextend.resize.plan import GroupPlan, ImageSize, plan_resize
from posextend.resize.report import ResizeReport, model_card, resize_report
from posextend.resize.size import check_output_size
from posextend.resize.writer import Change, write_checkpoint

log = logging.getLogger(__name__)


def resize_checkpoint(
    src: str | Path | Checkpoint,
    dst: str | Path,
    new_length: int | None = None,
    strategy: str | None = None,
    *,
    image_size: int | ImageSize | None = None,
    seed: int | None = None,
    overwrite: bool = False,
    allow_shrink: bool = False,
    link: bool = False,
    table: str | Sequence[str] | None = None,
    verify: bool | None = None,
    st_max_seq_length: int | None = None,
    revision: str | None = None,
    allow_same: bool = False,
    allow_large: bool = False,
    progress: Callable[[int, int], None] | None = None,
    **params: Any,
) -> ResizeReport:
    """Write a copy of checkpoint ``src`` at ``dst`` with ``new_length`` usable positions and/or
    image grids for ``image_size``.

    Only the position table(s) and the buffers that follow the length change; every
    other tensor's bytes are copied as they are. ``src`` is never modified, and ``dst``
    appears only when complete.

    Args:
        src: the checkpoint: a folder (transformers or sentence-transformers), a hub id in the
            local Hugging Face cache, or a :class:`~posextend.files.checkpoint.Checkpoint`.
        dst: the output folder; it must not exist (see ``overwrite``) and must not be ``src``
            or inside it.
        new_length: usable positions of the table(s) of positions (text): what the tokenizer's
            ``model_max_length`` becomes; reserved rows (RoBERTa's padding rows, OPT's offset)
            are added for you.
        strategy: how new rows are made (:func:`~posextend.tables.strategies.available_strategies`);
            it applies to the tables whose grid rank it handles, the others get their rank's
            default (``tile`` for positions, ``bicubic`` for image grids).
        image_size: pixels, ``448`` or ``(height, width)``, for an image-patch grid (ViT,
            DINOv2, CLIP's vision tower); ``config.json``'s ``image_size`` and the image
            processor's ``size``/``crop_size`` follow it.
        seed: seeds a strategy that draws random rows (default: drawn, and reported in
            ``report.seed`` and the model card).
        overwrite: replace ``dst`` if it exists (the old folder is swapped out only once the
            new one is complete).
        allow_shrink: allow a ``new_length`` below the current one (rows are dropped).
        link: hard-link the weight files that need no change instead of copying them (copied
            where the destination is on another file system).
        table: which tables, for a model with several lengths (``"encoder"``, ``"decoder"``,
            ``"text"``; see ``inspect_checkpoint(src).groups``), or several, each given ``new_length``
            (``("encoder", "decoder")``). Not needed with one length.
        verify: check the output against a twin of its written config (shapes, a forward
            pass at the full new length or image size) before it appears. Default: for a
            family observed on a twin (no written spec) and for every image grid; ``True`` for any family.
        st_max_seq_length: what a sentence-transformers model's ``max_seq_length`` becomes
            (default: the new length).
        revision: for a ``src`` that is a Hugging Face Hub id (downloaded into the Hugging Face
            cache, only the files a resize needs): the branch, tag or commit (default: main).
        allow_same: write a copy even when every table keeps its size (the length or image size
            asked for is the current one); otherwise that is refused and nothing is written.
        allow_large: write new tables over 4 times the size of every other weight together (and
            over 1 GiB), far past what the model can use; otherwise that is refused
            (:class:`~posextend.errors.LargeOutputError`, stating the size) and nothing is written.
        progress: called as ``progress(done_bytes, total_bytes)`` while writing (one call at a
            time, possibly from the threads that copy whole files).
        **params: the strategy's parameters (``std="matched"`` for ``random``, ``keep=20`` for ``kps``).

    Returns:
        What was done: lengths, tables, files written and copied, whether the output was
        verified; ``print(report)`` shows the summary the command line prints.

    Raises:
        PosExtendError: a subclass saying what to fix: the source is missing or damaged, the
            family has no learned table to resize, the length or strategy does not fit, or
            ``dst`` exists, or its file system has less free space than the output needs (known
            from the plan before anything is written). Nothing is written then.

    Examples:
        >>> report = posextend.resize_checkpoint("openai-community/gpt2", "gpt2-4k", 4096,
        ...                                      "interpolate", seed=0)
        >>> report.old_length, report.new_length
        (1024, 4096)
        >>> vit = "google/vit-base-patch16-224"
        >>> posextend.resize_checkpoint(vit, "vit-448", image_size=448).new_grid
        [28, 28]
    """
    start = time.perf_counter()
    table = table if table is None or isinstance(table, str) else tuple(table) or None
    options = ResizeOptions(new_length=new_length, image_size=image_size, strategy=strategy, seed=seed, params=params,
                            overwrite=overwrite, allow_shrink=allow_shrink, link=link, table=table, verify=verify,
                            st_max_seq_length=st_max_seq_length, revision=revision, allow_same=allow_same,
                            allow_large=allow_large)
    dst = Path(dst).expanduser()
    with Checkpoint.open(src, revision=revision) as source:
        reader, config = source.reader, source.config
        plans = plan_resize(config, source.shapes, options.request())
        check_destination(source.directory, dst, overwrite=overwrite)
        _check_request(reader, plans, new_length, st_max_seq_length)
        if not allow_same:
            _check_changes(source, plans, st_max_seq_length)
        check_output_size(source, dst, plans, allow_large=allow_large, link=link)
        options = options.resolved()
        report = resize_report(source, dst, plans, options)
        change = dataclasses.replace(resize_change(reader, config, plans, options.seed), metadata=report.provenance(),
                                     st_max_seq_length=st_max_seq_length)
        with atomic_output(dst, overwrite=overwrite) as tmp:
            written = write_checkpoint(source, tmp, change, link=link, progress=progress)
            report.record(written)
            for plan in plans:
                if verify or (verify is None and (plan.spec.covered_by == "probed" or plan.spec.grid)):
                    _verify(tmp / report.transformer_dir, plan, reader)
                    report.verified = True
            card = source.directory / "README.md"
            (tmp / "README.md").write_text(model_card(report, card.read_text(errors="replace") if card.is_file() else ""))
        report.seconds = time.perf_counter() - start
        log.info("Resized %s: %d -> %d positions (%s) in %.2fs", source.directory, report.old_length,
                 report.new_length, report.strategy, report.seconds)
        return report


def _check_request(reader: CheckpointReader, plans: list[GroupPlan], new_length: int | None,
                   st_max_seq_length: int | None) -> None:
    """Refuse a sentence-transformers length beyond the new one, and source tables that are not as the
    config says; log the families observed on a twin."""
    for plan in plans:
        if plan.spec.covered_by == "probed":
            log.info("No spec for model type %r: observed on a twin: %s", plan.spec.model_type, ", ".join(plan.spec.tables))
    if st_max_seq_length is not None and (new_length is None or not 0 < st_max_seq_length <= new_length):
        raise InvalidLengthError(
            f"The sentence-transformers max_seq_length must be between 1 and the new length {new_length}, "
            f"got {st_max_seq_length}."
        )
    for plan in plans:
        _check_source_tables(reader, plan.layout)


def _check_changes(source: Checkpoint, plans: list[GroupPlan], st_max_seq_length: int | None) -> None:
    """Refuse a resize that changes no table: the length (and image size) asked for are the current ones."""
    if any(plan.changes(source.config) for plan in plans):
        return
    has = " and ".join(f"{p.new_usable} usable positions" if not p.spec.grid else
                       f"an image size of {p.target[0]}x{p.target[1]} pixels" for p in plans)
    current, wanted = json_int(source.st_config, "max_seq_length"), st_max_seq_length or plans[0].new_usable
    st = (f" (its only change: the sentence-transformers max_seq_length, {current} -> {wanted})"
          if current is not None and current != wanted and not plans[0].spec.grid else "")
    raise InvalidLengthError(f"{source.directory} already has {has}: the resize would change no table, so nothing was "
                             f"written. To write a copy anyway{st}, pass allow_same=True.")


def resize_change(reader: CheckpointReader, config: Mapping[str, Any], plans: list[GroupPlan], seed: int) -> Change:
    """What resizing ``reader``'s files by ``plans`` changes in them: each group's tables and buffers, the
    obsolete tensors left out, and the plans the config follows (provenance is the caller's)."""
    tensors = {name: made for plan in plans for name, made in _changed_tensors(reader, config, plan, seed).items()}
    return Change(tensors, dropped=frozenset(d for plan in plans for d in plan.layout.dropped), plans=tuple(plans))


def _changed_tensors(
    reader: CheckpointReader, config: Mapping[str, Any], plan: GroupPlan, seed: int,
) -> dict[str, tuple[tuple[int, ...], TensorData]]:
    """Each table and buffer of ``plan``: its written shape and how to make it."""
    strat = get_strategy(plan.strategy)
    layout, out = plan.layout, {}
    for name in layout.tables:
        entry = reader.entries[name]
        if strat.rows and reader.format == "safetensors":  # a row strategy: copy the rows' bytes
            make: TensorData = row_byte_ranges(entry, layout.reserved, strat.rows(layout.usable, plan.new_usable), plan.new_usable)
        else:
            make = (lambda n=name: plan.resize(reader.get(n), seed=seed, context=config))
        out[name] = (plan.table_shape(entry.shape), make)
    value = plan.buffer_value(config)
    for name in layout.buffers:
        rule = plan.spec.buffer_rule(name)
        out[name] = (rule.new_shape(reader.entries[name].shape, value),
                     lambda n=name, r=rule: r.rebuild(reader.get(n), value))
    return out


def _check_source_tables(reader: CheckpointReader, layout: Layout) -> None:
    """Refuse a source whose table already holds NaN or Inf: no strategy can make it right."""
    for name in layout.tables:
        entry = reader.entries[name]
        bad = nonfinite_count(entry) if reader.format == "safetensors" else None
        if bad is None:
            import torch

            bad = int((~torch.isfinite(reader.get(name).float())).sum())
        if bad:
            raise CorruptCheckpointError(
                f"The source's position table {name} already holds {bad} NaN/Inf value(s): the source "
                "checkpoint is damaged. Re-download or re-save it; nothing was written."
            )


def _verify(out_dir: Path, plan: GroupPlan, reader: CheckpointReader) -> None:
    """Check the written files against a twin of the written config (see :func:`posextend.families.probe.verify`)."""
    from posextend.families.probe import verify, verify_grid

    with CheckpointReader(out_dir) as written:
        names = frozenset(written.entries)
        # the twin is of the class the written names belong to; bare names of a headed-only family get its prefix
        config = read_config(out_dir)
        cls, add = layout_class(config, names)
        model_name = _model_names(names | frozenset(reader.entries), plan.layout.tables, config, cls, add)
        shapes = {model_name[n]: e.shape for n, e in written.entries.items()}
    source = {model_name[n]: e.shape for n, e in reader.entries.items()}
    tables = [model_name[t] for t in plan.layout.tables]
    if plan.spec.grid:
        verify_grid(out_dir, plan.spec, tables, shapes, source, plan.target, plan.new_rows, cls)
    else:
        verify(out_dir, plan.spec, tables, shapes, source, plan.new_usable, plan.layout.reserved, cls)


def _model_names(names: frozenset[str], tables: tuple[str, ...], config: Mapping[str, Any], cls: type | None,
                 add: str) -> dict[str, str]:
    """Each file name under the name a twin of ``cls`` gives its tensor: ``add`` before it, or, where a table's
    name is not the twin's (the family renames on loading), the name transformers' own conversion mapping
    loads it as."""
    from posextend.families.twin import meta_shapes

    out = {n: add + n for n in names}
    expected = meta_shapes(config, cls)  # cached: the verification reads it too
    if all(out[t] in expected for t in tables):
        return out
    out.update({file: model for model, file in names_on_load(names, config).items() if model in expected})
    return out


def row_byte_ranges(entry: Entry, reserved: int, rows: list[int], new_length: int) -> ByteRanges:
    """Byte ranges of a table made of its ``reserved`` leading rows, then usable rows ``rows``."""
    usable = entry.shape[0] - reserved
    if len(rows) != new_length or any(not 0 <= r < usable for r in rows):
        raise StrategyError(f"A row strategy must pick {new_length} rows in 0..{usable - 1}; it picked {len(rows)}.")
    row_bytes = entry.nbytes // entry.shape[0]
    pieces = [(0, reserved)] if reserved else []
    for r in rows:  # consecutive rows become one range
        first = reserved + r
        if pieces and pieces[-1][1] == first:
            pieces[-1] = (pieces[-1][0], first + 1)
        else:
            pieces.append((first, first + 1))
    return tuple((entry.file, entry.start + a * row_bytes, entry.start + b * row_bytes) for a, b in pieces)
