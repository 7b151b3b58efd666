"""File-to-file surgery: inspect and resize the position table(s) of a checkpoint on disk.

The model is never instantiated. Tensors are addressed by name; the table(s) and
length-dependent buffers are rebuilt, and :mod:`posextend.resize.writer` writes them with every other
tensor's bytes passed through, shards that hold nothing to change copied whole (or hard-linked),
``config.json`` and ``tokenizer_config.json`` edited as JSON; the result appears at ``dst``
only when complete and checked. Where a checkpoint's parts are: :mod:`posextend.files.sources`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from posextend.version import __version__
from posextend.errors import CorruptCheckpointError, InvalidLengthError, StrategyError
from posextend.files.io import ByteRanges, CheckpointReader, Entry, Source, atomic_output, nonfinite_count
from posextend.families.lookup import all_specs, spec_for
from posextend.resize.plan import GroupPlan, ImageSize, Request, plan_resize
from posextend.files.sources import check_destination, json_int, opened, read_config, resolve_source, st_config, transformer_dir
from posextend.families.renames import names_on_load
from posextend.families.specs import Layout, table_rows as rows_of
from posextend.tables.strategies import get_strategy
from posextend.families.configs import get_path
from posextend.families.twin import layout_class
from posextend.resize.writer import Change, Written, write_checkpoint

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TableInfo:
    name: str
    rows: int
    dim: int
    dtype: str


@dataclass(frozen=True)
class GroupInfo:
    """One position length of a model: the tables one config field sizes."""

    group: str
    tables: list[TableInfo]
    usable: int
    reserved: int
    config_lengths: dict[str, Any]
    grid: list[int] = field(default_factory=list)  # [L] for positions, [H, W] patches for an image grid
    patch_size: list[int] | None = None  # image grids: [height, width] of a patch


@dataclass(frozen=True)
class CheckpointInfo:
    """What ``posextend inspect`` reports about a checkpoint (the first group's numbers at the top)."""

    path: str
    model_type: str
    architectures: list[str]
    spec: str  # the spec's model type, or "probed" (observed on a twin)
    covered_by: str  # "spec" or "probed"
    weights_format: str
    weight_files: list[str]
    tables: list[TableInfo]
    usable: int
    reserved: int
    config_lengths: dict[str, int]
    buffers: list[str]
    tokenizer_max_length: int | None
    st_max_seq_length: int | None = None  # sentence-transformers' max_seq_length, when present
    groups: list[GroupInfo] = field(default_factory=list)
    transformer_dir: str = ""  # where the model sits in ``path``: "" at its root, "0_Transformer" in an older ST folder
    layout: str = ""  # "headed" (names under the base model's prefix) or "bare" (the base model's own names)
    layout_class: str = ""  # the transformers class whose names the weights hold (MPNetModel for a bare MPNet)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class ResizeReport:
    """What ``resize_checkpoint`` did."""

    src: str
    dst: str
    model_type: str
    strategy: str
    params: dict[str, Any]
    seed: int
    old_length: int
    new_length: int
    reserved: int
    tables: list[str]
    buffers: list[str]
    dropped: list[str] = field(default_factory=list)
    covered_by: str = "spec"
    verified: bool = False
    st_max_seq_length: int | None = None
    files_rewritten: list[str] = field(default_factory=list)
    files_copied: list[str] = field(default_factory=list)
    files_skipped: list[str] = field(default_factory=list)
    bytes_written: int = 0
    seconds: float = 0.0
    old_image_size: list[int] | None = None  # image grids: [height, width] in pixels
    new_image_size: list[int] | None = None
    old_grid: list[int] | None = None  # image grids: [H, W] patches
    new_grid: list[int] | None = None
    strategies: dict[str, str] = field(default_factory=dict)  # group -> strategy, when several groups
    transformer_dir: str = ""  # where the resized model sits in src and dst ("0_Transformer" in an older ST folder)

    def record(self, written: Written) -> None:
        """Take the writer's account of the files (:class:`Written`)."""
        for f in dataclasses.fields(written):
            setattr(self, f.name, getattr(written, f.name))

    def provenance(self) -> dict[str, str]:
        """String metadata recorded in the safetensors header and index."""
        return {
            "posextend.version": __version__,
            "posextend.source": self.src,
            "posextend.strategy": self.strategy,
            "posextend.params": json.dumps(self.params, sort_keys=True),
            "posextend.seed": str(self.seed),
            "posextend.old_length": str(self.old_length),
            "posextend.new_length": str(self.new_length),
            "posextend.tables": ",".join(self.tables),
            **({"posextend.old_image_size": "x".join(map(str, self.old_image_size)),
                "posextend.new_image_size": "x".join(map(str, self.new_image_size))} if self.new_image_size else {}),
            **({"posextend.strategies": json.dumps(self.strategies, sort_keys=True)} if len(self.strategies) > 1 else {}),
        }


def read_position_table(src: str | Path, table: str | None = None, *, grid: bool = False) -> torch.Tensor:
    """The usable rows ``[N, D]`` of a checkpoint's (first) position table, read by name only.

    ``table`` names a group (``"vision"``); ``grid=True`` gives an image grid's rows as ``[H, W, D]``.
    """
    with opened(src) as (_, config, reader, shapes):
        layout = spec_for(config, table=table).locate(shapes, config)
        rows = reader.get(layout.tables[0])
        rows = rows.reshape(rows.shape[-2], rows.shape[-1])[layout.reserved :]
        return rows.reshape(*layout.grid, rows.shape[-1]) if grid else rows


# ------------------------------------------------------------------------------- public


def inspect_checkpoint(src: str | Path) -> CheckpointInfo:
    """Describe a checkpoint's position table(s) without loading the model.

    Example::

        >>> info = posextend.inspect_checkpoint("all-MiniLM-L6-v2")
        >>> info.usable, info.tables[0].name
        (512, 'embeddings.position_embeddings.weight')
    """
    directory = resolve_source(src)
    where = transformer_dir(directory)
    model_dir = directory / where
    config = read_config(model_dir)
    with CheckpointReader(model_dir) as reader:
        shapes = {name: entry.shape for name, entry in reader.entries.items()}
        groups = []
        for spec in all_specs(config):
            layout = spec.locate(shapes, config)
            tables = [TableInfo(n, rows_of(shapes[n]), shapes[n][-1], reader.entries[n].dtype) for n in layout.tables]
            keys = (*spec.length_keys, spec.grid.patch_key) if spec.grid else spec.length_keys
            lengths = {k: v for k in keys if (v := get_path(config, k)) is not None}
            patch = list(spec.grid.sizes(config)[1]) if spec.grid else None
            groups.append((spec, layout, GroupInfo(spec.group, tables, layout.usable, layout.reserved, lengths,
                                                   list(layout.grid), patch)))
        spec, layout, first = groups[0]
        return CheckpointInfo(
            path=str(directory),
            model_type=config.get("model_type", ""),
            architectures=list(config.get("architectures") or []),
            spec="probed" if spec.covered_by == "probed" else spec.model_type,
            covered_by=spec.covered_by,
            weights_format=reader.format + (" (sharded)" if reader.sharded else ""),
            weight_files=[(PurePosixPath(where) / f.name).as_posix() for f in reader.files],
            tables=first.tables,
            usable=layout.usable,
            reserved=layout.reserved,
            config_lengths=first.config_lengths,
            buffers=list(layout.buffers),
            tokenizer_max_length=json_int(model_dir / "tokenizer_config.json", "model_max_length"),
            st_max_seq_length=json_int(st_config(model_dir), "max_seq_length"),
            groups=[g for _, _, g in groups],
            transformer_dir=where,
            layout=layout.kind,
            layout_class=layout_class(config, frozenset(shapes))[0].__name__,
        )


def resize_checkpoint(
    src: str | Path,
    dst: str | Path,
    new_length: int | None = None,
    strategy: str | None = None,
    *,
    image_size: int | ImageSize | None = None,
    seed: int | None = None,
    overwrite: bool = False,
    allow_shrink: bool = False,
    link: bool = False,
    table: str | None = None,
    verify: bool | None = None,
    st_max_seq_length: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    **params: Any,
) -> ResizeReport:
    """Write a copy of checkpoint ``src`` at ``dst`` with ``new_length`` usable positions and/or
    image grids for ``image_size``.

    Only the position table(s) and the buffers that follow the length change; every
    other tensor's bytes are copied as they are. ``src`` is never modified, and ``dst``
    appears only when complete. ``progress(done_bytes, total_bytes)`` is called while
    writing (one call at a time, possibly from the threads that copy whole shards).
    ``link=True`` hard-links shards that need no change instead of copying them.

    Args:
        new_length: usable positions of the table(s) of positions (text).
        strategy: applies to the tables whose grid rank it handles; the others get their
            rank's default (``tile`` for positions, ``bicubic`` for image grids).
        image_size: pixels, ``448`` or ``(height, width)``, for an image-patch grid (ViT,
            DINOv2, CLIP's vision tower); ``config.json``'s ``image_size`` and the image
            processor's ``size``/``crop_size`` follow it.
        table: which tables, for a model with several lengths (``"encoder"``, ``"decoder"``,
            ``"text"``; see ``inspect_checkpoint(src).groups``). Not needed with one length.
        verify: check the output against a twin of its written config (shapes, a forward
            pass at the full new length or image size) before it appears. Default: for a
            family observed on a twin (no written spec) and for every image grid; ``True`` for any family.
        st_max_seq_length: what a sentence-transformers model's ``max_seq_length`` becomes
            (default: the new length).

    Example::

        >>> report = posextend.resize_checkpoint("gpt2", "gpt2-4k", 4096, "interpolate", seed=0)
        >>> report.old_length, report.new_length
        (1024, 4096)
        >>> posextend.resize_checkpoint("vit-base", "vit-448", image_size=448).new_grid
        [28, 28]
    """
    start = time.perf_counter()
    dst = Path(dst).expanduser()
    with opened(src) as (directory, config, reader, shapes):
        plans = plan_resize(config, shapes, Request(new_length, image_size, strategy, params, table, allow_shrink))
        check_destination(directory, dst, overwrite=overwrite)
        _check_request(reader, plans, new_length, st_max_seq_length)
        seed = secrets.randbits(63) if seed is None else seed
        report = resize_report(directory, dst, plans, config, seed)
        change = dataclasses.replace(resize_change(reader, config, plans, seed), metadata=report.provenance(),
                                     st_max_seq_length=st_max_seq_length)
        with atomic_output(dst, overwrite=overwrite) as tmp:
            written = write_checkpoint(directory, tmp, reader, config, change, link=link, progress=progress)
            report.record(written)
            for plan in plans:
                if verify or (verify is None and (plan.spec.covered_by == "probed" or plan.spec.grid)):
                    _verify(tmp / report.transformer_dir, plan, reader)
                    report.verified = True
            card = directory / "README.md"
            (tmp / "README.md").write_text(model_card(report, card.read_text(errors="replace") if card.is_file() else ""))
        report.seconds = time.perf_counter() - start
        log.info("Resized %s: %d -> %d positions (%s) in %.2fs", directory, report.old_length, report.new_length,
                 report.strategy, report.seconds)
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


def resize_change(reader: CheckpointReader, config: Mapping[str, Any], plans: list[GroupPlan], seed: int) -> Change:
    """What resizing ``reader``'s files by ``plans`` changes in them: each group's tables and buffers, the
    obsolete tensors left out, and the plans the config follows (provenance is the caller's)."""
    tensors = {name: made for plan in plans for name, made in _changed_tensors(reader, config, plan, seed).items()}
    return Change(tensors, dropped=frozenset(d for plan in plans for d in plan.layout.dropped), plans=tuple(plans))


def _changed_tensors(
    reader: CheckpointReader, config: Mapping[str, Any], plan: GroupPlan, seed: int,
) -> dict[str, tuple[tuple[int, ...], Source]]:
    """Each table and buffer of ``plan``: its written shape and how to make it."""
    strat = get_strategy(plan.strategy)
    layout, out = plan.layout, {}
    for name in layout.tables:
        entry = reader.entries[name]
        if strat.rows and reader.format == "safetensors":  # a row strategy: copy the rows' bytes
            make: Source = table_rows(entry, layout.reserved, strat.rows(layout.usable, plan.new_usable), plan.new_usable)
        else:
            make = (lambda n=name: plan.resize(reader.get(n), seed=seed, context=config))
        out[name] = (plan.table_shape(entry.shape), make)
    value = plan.buffer_value(config)
    for name in layout.buffers:
        rule = plan.spec.buffer_rule(name)
        out[name] = (rule.new_shape(reader.entries[name].shape, value),
                     lambda n=name, r=rule: r.rebuild(reader.get(n), value))
    return out


def resize_report(directory: Path, dst: Path, plans: list[GroupPlan], config: Mapping[str, Any], seed: int) -> ResizeReport:
    """The report of a resize of ``directory`` by ``plans`` (on disk, or in memory before a fine-tune): the
    first group's numbers (positions before an image grid) at the top."""
    main = plans[0]
    report = ResizeReport(
        src=str(directory), dst=str(dst.resolve()), model_type=main.spec.model_type, strategy=main.strategy,
        params=dict(main.params), seed=seed, old_length=main.layout.usable, new_length=main.new_usable,
        reserved=main.layout.reserved, tables=[t for p in plans for t in p.layout.tables],
        buffers=[b for p in plans for b in p.layout.buffers], dropped=sorted({d for p in plans for d in p.layout.dropped}),
        covered_by=main.spec.covered_by, strategies={p.spec.group: p.strategy for p in plans},
        transformer_dir=transformer_dir(directory),
    )
    for plan in plans:
        if plan.spec.grid:
            report.old_image_size = list(plan.spec.grid.sizes(config)[0])
            report.new_image_size = list(plan.target)
            report.old_grid, report.new_grid = list(plan.layout.grid), list(plan.new_grid)
    return report


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


def table_rows(entry: Entry, reserved: int, rows: list[int], new_length: int) -> ByteRanges:
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


def model_card(report: ResizeReport, original: str = "", *, trained: bool = False) -> str:
    """A short model card stating how the checkpoint was made (``trained``: after a fine-tune)."""
    text = report.new_grid is None or len(report.strategies) > 1  # the top numbers are positions, not patches
    grew = report.new_length > report.old_length and not trained and text
    strategy = get_strategy(report.strategy)
    lines = [
        "---",
        "tags:",
        "- posextend",
        "---",
        "",
        f"# Position table extended with posextend {__version__}",
        "",
        f"- Source: `{report.src}`",
        f"- Usable positions: {report.old_length} → {report.new_length}"
        + (f" (plus {report.reserved} reserved rows)" if report.reserved else ""),
        *([f"- Image size: {'x'.join(map(str, report.old_image_size))} → {'x'.join(map(str, report.new_image_size))} "
           f"pixels (patch grid {'x'.join(map(str, report.old_grid))} → {'x'.join(map(str, report.new_grid))})"]
          if report.new_image_size else []),
        f"- Strategy: `{report.strategy}` — {strategy.description}",
        *([f"- Strategies by table group: {', '.join(f'{g} `{s}`' for g, s in report.strategies.items())}"]
          if len(report.strategies) > 1 else []),
        f"- Parameters: `{json.dumps(report.params, sort_keys=True)}`, seed {report.seed}",
        f"- Tables: {', '.join(f'`{t}`' for t in report.tables)}",
    ]
    if report.covered_by == "probed":
        lines.append("- Family: no written spec; tables, reserved rows and length field observed on a twin of its config")
    if report.verified:
        lines.append("- Verified: a twin built from the written config has the written shapes and runs at the full "
                     "length or image size")
    if report.st_max_seq_length is not None:
        lines.append(f"- sentence-transformers `max_seq_length`: {report.st_max_seq_length}")
    if report.transformer_dir:
        lines.append(f"- sentence-transformers Transformer module: `{report.transformer_dir}/`")
    if report.buffers:
        lines.append(f"- Length-dependent buffers rebuilt: {len(report.buffers)}")
    if report.dropped:
        lines.append(f"- Obsolete tensors left out: {len(report.dropped)} (e.g. `{report.dropped[0]}`)")
    if report.files_skipped:
        lines.append(f"- Left out: {', '.join(f'`{f}`' for f in report.files_skipped)}: the source model in other "
                     f"formats (exports such as ONNX or OpenVINO, other weight files) still has the old "
                     f"{report.old_length}-position table; export them again from this checkpoint")
    if grew:
        lines += [
            "",
            f"Positions {report.old_length}–{report.new_length - 1} have not been trained. "
            "Fine-tune briefly (`posextend finetune`) before relying on them.",
        ]
    if original.startswith("---"):  # drop the original's YAML front matter
        original = original.split("\n---", 1)[1].partition("\n")[2] if "\n---" in original[3:] else ""
    if original.strip():
        lines += ["", "## Original model card", "", original.strip()]
    return "\n".join(lines) + "\n"
