"""File-to-file surgery: resize the position table(s) of a checkpoint on disk.

The model is never instantiated. Tensors are addressed by name; the table(s) and
length-dependent buffers are rebuilt, every other tensor's bytes are passed through,
shards that hold nothing to change are copied whole (or hard-linked), ``config.json``
and ``tokenizer_config.json`` are edited as JSON, and the result appears at ``dst``
only when complete.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from . import __version__
from .errors import CorruptCheckpointError, DestinationError, InvalidLengthError, SourceError, StrategyError
from .io import (
    BIN_INDEX, SAFE_INDEX, SAFE_SINGLE, ByteRanges, CheckpointReader, Entry, Source, atomic_output, copy_file,
    nonfinite_count, prefetch_torch, write_safetensors,
)
from .lookup import all_specs, spec_for
from .plan import GroupPlan, ImageSize, Request, plan_resize
from .specs import IMAGE_COUNT_FIELD, Layout, names_on_load, table_rows as rows_of
from .strategies import get_strategy
from .twin import get_path, layout_class, set_path

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# Weight files in other formats would still hold the old table: the resized model's own are not copied
# (another module's, a sentence-transformers Dense layer's say, are).
_OTHER_WEIGHTS = (".bin", ".safetensors", ".h5", ".msgpack", ".onnx", ".gguf", ".pt", ".pth", ".ckpt", ".ot")
# Exports of the model for other runtimes hold the old table too: left out wherever they sit, and a
# folder of them (sentence-transformers' onnx/ and openvino/) whole.
EXPORT_DIRS = {"onnx": "ONNX", "openvino": "OpenVINO"}
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "merges.txt", "spiece.model",
                    "sentencepiece.bpe.model", "tokenizer.model")


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


@dataclass
class Written:
    """What the checkpoint writer did: weight files rewritten, copied whole, left out (the source model in
    other formats, which still holds the old table), bytes written, and the sentence-transformers
    ``max_seq_length`` it set."""

    files_rewritten: list[str] = field(default_factory=list)
    files_copied: list[str] = field(default_factory=list)
    files_skipped: list[str] = field(default_factory=list)
    bytes_written: int = 0
    st_max_seq_length: int | None = None


@dataclass(frozen=True)
class Change:
    """What a checkpoint written from a source changes in it; every other byte is the source's.

    - ``tensors``: by file name, the new shape and how to make it (a table, a buffer, a trained weight).
    - ``added``: tensors the source lacks (a freshly initialised head), written after its own.
    - ``dropped``: tensors left out (obsolete buffers).
    - ``plans``: the resize that ``config.json``, the tokenizer's and processor's settings and a
      sentence-transformers ``max_seq_length`` follow (none: they are copied as they are).
    - ``metadata``: provenance, added to every rewritten header and the index.
    """

    tensors: Mapping[str, tuple[tuple[int, ...], Source]] = field(default_factory=dict)
    added: tuple[tuple[Entry, Source], ...] = ()
    dropped: frozenset[str] = frozenset()
    plans: tuple[GroupPlan, ...] = ()
    metadata: Mapping[str, str] = field(default_factory=dict)
    st_max_seq_length: int | None = None


# ----------------------------------------------------------------------------- helpers


def resolve_source(src: str | Path) -> Path:
    """A local checkpoint directory, or a hub id already present in the local HF cache."""
    path = Path(src).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.exists():
        raise SourceError(f"{src} is a file; give the checkpoint's directory (the one holding config.json, or "
                          "a sentence-transformers folder's modules.json).")
    if str(src).count("/") == 1 and not str(src).startswith((".", "/", "~")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(str(src), local_files_only=True))
        except Exception:
            pass
    raise SourceError(f"{src} does not exist (and is not a model in the local Hugging Face cache).")


def read_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        raise SourceError(
            f"No config.json in {directory}: this is not a transformers checkpoint. "
            "Save the model with save_pretrained() first."
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SourceError(f"{path} is not valid JSON ({exc}).") from None
    if not isinstance(config, dict):
        raise SourceError(f"{path} does not hold a JSON object.")
    return config


MODULES = "modules.json"  # sentence-transformers: its modules in order, each with its folder


def transformer_dir(directory: Path) -> str:
    """Where the transformers model of checkpoint folder ``directory`` sits, relative to it.

    The one lookup every door uses (resize, inspect, fine-tune loading). ``""``: at the root (a
    transformers checkpoint, or a sentence-transformers folder whose ``modules.json`` gives the
    Transformer module the path ``""``). Older sentence-transformers folders keep the Transformer
    module in the folder ``modules.json`` names (``"0_Transformer"``, ``"0_BERT"``), with its
    config.json, weights, tokenizer and ``sentence_bert_config.json``; the root holds the other
    modules. The Transformer module is the first whose type is a ``Transformer``, else the first
    whose folder holds a transformers config.json (one with a ``model_type``; a Pooling or Dense
    module's config.json has none).

    Raises:
        SourceError: ``modules.json`` is unreadable or names a folder outside ``directory``; the
            Transformer module's folder has no config.json; no module is a transformers model; or a
            model sits both at the root and in the Transformer module's folder.

    Example::

        >>> transformer_dir(Path("all-MiniLM-L6-v2")), transformer_dir(Path("old-st-model"))
        ('', '0_Transformer')
    """
    path = directory / MODULES
    if not path.is_file():
        return ""
    try:
        modules = [(str(m.get("type") or ""), str(m.get("path") or "")) for m in json.loads(path.read_text())]
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise SourceError(f"{path} is not a valid sentence-transformers module list ({exc}); restore it from the "
                          "original model, or save the model again with SentenceTransformer.save().") from None
    folders = []
    for kind, where in modules:
        rel = PurePosixPath(where.replace("\\", "/"))
        if rel.is_absolute() or ".." in rel.parts:
            raise SourceError(f"{path} places a module at {where!r}, outside {directory}; a module's path must "
                              "name a folder inside the model folder. Restore modules.json from the original model.")
        folders.append((kind, rel.as_posix() if rel.parts else ""))
    found = next((f for kind, f in folders if kind.rsplit(".", 1)[-1] == "Transformer"), None)
    if found is None:
        found = next((f for _, f in folders if _is_transformers_config(directory / f / "config.json")), None)
    at_root = (directory / "config.json").is_file()
    if found is None and not at_root:
        raise SourceError(
            f"{directory} is a sentence-transformers folder, but none of its modules "
            f"({', '.join(f or '(root)' for _, f in folders) or 'none listed'}) is a transformers model (a folder "
            "with config.json): there is no learned position table to resize."
        )
    if not found:
        return ""
    if not (directory / found / "config.json").is_file():
        raise SourceError(f"{path} places the Transformer module in {found}/, but {found}/config.json is missing: "
                          "the folder is incomplete. Copy or download the whole model folder again.")
    if at_root:
        raise SourceError(
            f"{directory} holds a model at its root (config.json) and, as {MODULES} says, the sentence-transformers "
            f"Transformer module in {found}/: which one to resize is unclear. Remove the one you do not use, or give "
            f"{directory / found} to resize that model on its own."
        )
    return found


def check_destination(src: Path, dst: Path, *, overwrite: bool) -> None:
    src, dst = src.resolve(), dst.resolve()
    if dst == src or src in dst.parents:
        raise DestinationError(f"The destination {dst} is the source or inside it; choose a directory outside {src}.")
    if dst in src.parents:
        raise DestinationError(f"The destination {dst} contains the source {src}; choose another directory.")
    if (dst.exists() or dst.is_symlink()) and not overwrite:
        raise DestinationError(f"{dst} already exists; pass overwrite=True to replace it.")


def _json_int(path: Path | None, key: str) -> int | None:
    if path is not None and path.is_file():
        try:
            value = json.loads(path.read_text()).get(key)
            return value if isinstance(value, int) else None
        except ValueError:
            return None
    return None


def _is_transformers_config(path: Path) -> bool:
    try:
        return path.is_file() and "model_type" in json.loads(path.read_text())
    except (OSError, ValueError, TypeError):
        return False


ST_CONFIG = "sentence_bert_config.json"  # sentence-transformers: encode() truncates to its max_seq_length
# the names older sentence-transformers versions gave it; the first one present is the one read
ST_CONFIGS = (ST_CONFIG, "sentence_roberta_config.json", "sentence_distilbert_config.json",
              "sentence_camembert_config.json", "sentence_albert_config.json", "sentence_xlm-roberta_config.json",
              "sentence_xlnet_config.json")


def st_config(model_dir: Path) -> Path | None:
    """The sentence-transformers config (``max_seq_length``) of the Transformer module in ``model_dir``."""
    return next((model_dir / name for name in ST_CONFIGS if (model_dir / name).is_file()), None)


@contextlib.contextmanager
def opened(src: str | Path) -> Iterator[tuple[Path, dict[str, Any], CheckpointReader, dict[str, tuple[int, ...]]]]:
    """Resolve, read the config, open the weights lazily; yields the tensors' shapes by name too.

    The directory yielded is the one given; the config and the weights are those of its model, in
    :func:`transformer_dir` (``reader.dir``).
    """
    directory = resolve_source(src)
    model_dir = directory / transformer_dir(directory)
    config = read_config(model_dir)
    reader = CheckpointReader(model_dir)
    try:
        yield directory, config, reader, {name: entry.shape for name, entry in reader.entries.items()}
    finally:
        reader.close()


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
            tokenizer_max_length=_json_int(model_dir / "tokenizer_config.json", "model_max_length"),
            st_max_seq_length=_json_int(st_config(model_dir), "max_seq_length"),
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
        changed = {name: made for plan in plans for name, made in changed_tensors(reader, config, plan, seed).items()}
        report = resize_report(directory, dst, plans, config, seed)
        change = Change(changed, dropped=frozenset(report.dropped), plans=tuple(plans), metadata=report.provenance(),
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


def changed_tensors(
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
    """Check the written files against a twin of the written config (see :func:`posextend.probe.verify`)."""
    from .probe import verify, verify_grid

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
    from .twin import meta_shapes

    out = {n: add + n for n in names}
    expected = meta_shapes(config, cls)  # cached: the verification reads it too
    if all(out[t] in expected for t in tables):
        return out
    out.update({file: model for model, file in names_on_load(names, config).items() if model in expected})
    return out


COPY_THREADS = 4  # whole-file copies at once: the kernel's copy of a file runs on one core


class _Cancelled(Exception):
    """Raised in a copying thread when the resize has failed elsewhere."""


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


def write_checkpoint(directory: Path, out: Path, reader: CheckpointReader, config: dict[str, Any], change: Change, *,
                     link: bool = False, progress: Callable[[int, int], None] | None = None) -> Written:
    """Write into ``out`` the checkpoint ``directory`` as ``change`` makes it: the one writer of ``resize-model``
    and of the fine-tune's save.

    The weights of the model's folder (``reader``'s) are written tensor by tensor: those ``change`` makes,
    new ones after; every other tensor's bytes are copied, and files without a change are copied whole (or
    hard-linked with ``link``). Every other file of the source follows, in the same layout: ``config.json``
    (``config``, the source's) and the tokenizer's, processor's and sentence-transformers settings edited
    by ``change.plans``. The model card is the caller's. ``progress(done_bytes, total_bytes)`` as in
    :func:`resize_checkpoint`.
    """
    written = Written()
    model_out = out / transformer_dir(directory)  # out itself, or an older ST folder's 0_Transformer/
    model_out.mkdir(exist_ok=True)
    _write_weights(reader, model_out, change, written, link, progress)
    _copy_other_files(directory, out, reader, config, change, written)
    return written


def _write_weights(
    reader: CheckpointReader,
    out_dir: Path,
    change: Change,
    written: Written,
    link: bool,
    progress: Callable[[int, int], None] | None,
) -> None:
    """Write every tensor: those ``change`` makes (tables, buffers, trained weights) with their new shape,
    its added ones in the last file, the rest copied."""
    sources = dict(reader.by_file())
    plans = _file_plans(reader, sources, change)
    if any(callable(make) for items in plans.values() for _, make in items):
        prefetch_torch()  # a tensor is computed: import torch while the unchanged bytes are copied
    whole = {p: len(items) == len(sources[p]) and all(make is None for _, make in items) for p, items in plans.items()}
    total = sum(e.nbytes for items in plans.values() for e, _ in items)
    advance = _Advance(written, total, progress)
    out_names = _out_names(reader, plans)
    # Files without a changed tensor are copied whole (or linked) by a few threads, while this one
    # rewrites the others: the kernel's copy is CPU-bound (page cache to page cache), so copies
    # of several files at once use every core, and the rewrite meanwhile waits for torch's import.
    copies = [p for p in plans if whole[p]]
    pool = ThreadPoolExecutor(max_workers=max(1, min(len(copies), COPY_THREADS)), thread_name_prefix="posextend-copy")
    try:
        futures = [pool.submit(copy_file, p, out_dir / out_names[p], link=link, progress=advance) for p in copies]
        for path, items in plans.items():
            if not whole[path]:
                metadata = {**reader.metadata.get(path, {"format": "pt"}), **change.metadata}
                write_safetensors(out_dir / out_names[path], items, metadata, progress=advance)
                written.files_rewritten.append(out_names[path])
        for path, future in zip(copies, futures):
            future.result()
            written.files_copied.append(out_names[path])
    except BaseException:
        advance.cancelled.set()  # the copying threads stop at their next chunk, before the output is removed
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    if reader.sharded:
        weight_map = {e.name: out_names[path] for path, items in plans.items() for e, _ in items}
        metadata = {**reader.index_metadata, "total_size": total, **change.metadata}
        index = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _file_plans(reader: CheckpointReader, sources: Mapping[Path, list[Entry]], change: Change
                ) -> dict[Path, list[tuple[Entry, Source]]]:
    """Per source file, each kept tensor's output entry and how to make it (None: copy its bytes), and the
    added tensors in the last file. Within a file, copied bytes come first and new tensors last
    (safetensors allows any order), so the copy runs while torch is still being imported."""

    def plan(entry: Entry) -> tuple[Entry, Source]:
        if entry.name in change.tensors:  # same dtype, new shape
            shape, make = change.tensors[entry.name]
            return dataclasses.replace(entry, shape=shape), make
        if reader.format == "bin":
            return entry, lambda: reader.get(entry.name)
        return entry, None

    plans = {path: [plan(e) for e in entries if e.name not in change.dropped] for path, entries in sources.items()}
    plans[list(plans)[-1]] += change.added
    return {path: sorted(items, key=lambda item: callable(item[1])) for path, items in plans.items()}


def _out_names(reader: CheckpointReader, plans: Mapping[Path, list]) -> dict[Path, str]:
    """The output file of each source file: its own name, or safetensors names for a ``.bin`` checkpoint."""
    if reader.format != "bin":
        return {path: path.name for path in plans}
    return {path: SAFE_SINGLE if not reader.sharded else f"model-{number:05d}-of-{len(plans):05d}.safetensors"
            for number, path in enumerate(plans, start=1)}


class _Advance:
    """The writer's progress callback, called from the copying threads too: counts the bytes written into
    ``written`` and ``progress``; raises once ``cancelled`` is set, so a copy stops at its next chunk."""

    def __init__(self, written: Written, total: int, progress: Callable[[int, int], None] | None):
        self.written, self.total, self.progress = written, total, progress
        self.lock, self.cancelled = threading.Lock(), threading.Event()

    def __call__(self, n: int) -> None:
        if self.cancelled.is_set():
            raise _Cancelled
        with self.lock:
            self.written.bytes_written += n
            if self.progress:
                self.progress(self.written.bytes_written, self.total)


def processor_config(data: Mapping[str, Any], old: ImageSize, new: ImageSize,
                     counts: Mapping[int, int] | None = None) -> dict[str, Any]:
    """An image processor's settings for images of ``new`` (height, width) pixels instead of ``old``.

    ``crop_size`` and a ``size`` given as height/width become the new size; a ``size`` given by
    its shortest edge (CLIP: resize to 224, crop 224; DINOv2: 256, crop 224) scales with the
    image, unless the new size is not square (then both become the new height/width). An int
    (older processors) scales too. ``counts``: image-token counts that follow the patch grid, old ->
    new (see :func:`with_counts`).
    """
    out = with_counts(data, counts or {})
    for key in ("mask_size", "mask_pad_size"):  # SAM's masks, a quarter of the image a side: they scale with it
        if isinstance(out.get(key), Mapping):
            scale = {"height": new[0] / old[0], "width": new[1] / old[1]}
            out[key] = {k: round(v * scale.get(k, new[0] / old[0])) if type(v) is int else v
                        for k, v in out[key].items()}
    for key in ("size", "crop_size", "pad_size"):  # SAM pads every image to pad_size
        value = out.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            out[key] = round(value * new[0] / old[0]) if new[0] == new[1] else {"height": new[0], "width": new[1]}
        elif isinstance(value, Mapping):
            if "height" in value or "width" in value or new[0] != new[1]:
                rest = {k: v for k, v in value.items() if k not in ("height", "width", "shortest_edge", "longest_edge")}
                out[key] = {**rest, "height": new[0], "width": new[1]}
            else:  # shortest_edge (and longest_edge) scale with the side
                out[key] = {k: round(v * new[0] / old[0]) if k.endswith("_edge") and isinstance(v, int) else v
                            for k, v in value.items()}
    return out


def with_counts(data: Mapping[str, Any], counts: Mapping[int, int]) -> dict[str, Any]:
    """``data`` with every image-token count field (:data:`IMAGE_COUNT_FIELD`: PaliGemma's processor
    ``image_seq_length``) that holds an old count of ``counts`` (old -> new) set to the new one."""
    return {k: counts[v] if IMAGE_COUNT_FIELD.search(k) and type(v) is int and v in counts else v
            for k, v in data.items()}


def _counts(plan: GroupPlan, config: Mapping[str, Any]) -> dict[int, int]:
    """The image-token counts an image grid's plan changes in the config, old -> new."""
    return {get_path(config, path): value for path, value in plan.config_updates(config).items()
            if path != plan.spec.grid.image_key}


def updated_config(config: Mapping[str, Any], updates: Mapping[str, int]) -> dict[str, Any]:
    """``config`` with each (dotted) field in ``updates`` set."""
    out = dict(config)
    for path, value in updates.items():
        out = set_path(out, path, value)
    return out


PROCESSOR_CONFIG = "preprocessor_config.json"  # image processors: size / crop_size follow the image size


def _copy_other_files(src: Path, out_dir: Path, reader: CheckpointReader, config: dict[str, Any], change: Change,
                      written: Written) -> None:
    """Copy config, tokenizer, image processor and every other non-weight file, editing lengths as JSON.

    The model's own files sit in :func:`transformer_dir` (the root, or an older sentence-transformers
    folder's ``0_Transformer/``); every other file and folder is copied as it is, in the same layout.
    Copies of the model in other formats (its weights in other formats, ONNX and OpenVINO exports) still
    hold the old table: they are left out and listed in ``written.files_skipped``.
    """
    updates = {k: v for plan in change.plans for k, v in plan.config_updates(config).items()}
    text = next((p for p in change.plans if not p.spec.grid), None)
    image = next((p for p in change.plans if p.spec.grid), None)
    weight_files = {f.resolve() for f in reader.files}
    model = Path(transformer_dir(src))  # relative to src and out_dir; Path("") is the root
    st_file = st_config(src / model)
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if any(part.startswith(".") and part != ".gitattributes" for part in rel.parts):
            continue
        if path.resolve() in weight_files or (rel.parent == model and rel.name in (SAFE_INDEX, BIN_INDEX)):
            continue  # written by _write_weights
        left_out = _left_out(rel, model, path.is_dir())
        if left_out:
            entry, kind = left_out
            if entry not in written.files_skipped:
                written.files_skipped.append(entry)
                log.warning("Not copying %s: %s of the source model, which still holds the old table; export it "
                            "again from the output.", entry, f"an {kind} export" if kind != "weights" else
                            "its weights in another format")
            continue
        if path.is_dir():
            (out_dir / rel).mkdir(parents=True, exist_ok=True)  # empty module folders (2_Normalize/) too
            continue
        target = out_dir / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if rel == model / "config.json":
            _write_json(target, updated_config(config, updates))
        elif rel == model / "tokenizer_config.json" and text:
            _write_json(target, {**json.loads(path.read_text()), "model_max_length": text.new_usable})
        elif rel == model / PROCESSOR_CONFIG and image:
            old = image.spec.grid.sizes(config)[0]
            _write_json(target, processor_config(json.loads(path.read_text()), old, image.target, _counts(image, config)))
        elif rel == model / "processor_config.json" and image:  # a multimodal processor's own image-token count
            _write_json(target, with_counts(json.loads(path.read_text()), _counts(image, config)))
        elif st_file is not None and path == st_file and text:
            written.st_max_seq_length = change.st_max_seq_length or text.new_usable
            _write_json(target, {**json.loads(path.read_text()), "max_seq_length": written.st_max_seq_length})
        elif rel != Path("README.md"):
            shutil.copy2(path, target)
    has_tokenizer = any((src / model / name).is_file() for name in TOKENIZER_FILES)
    if text and has_tokenizer and not (src / model / "tokenizer_config.json").is_file():
        _write_json(out_dir / model / "tokenizer_config.json", {"model_max_length": text.new_usable})
    if change.st_max_seq_length is not None and written.st_max_seq_length is None:
        log.warning("A sentence-transformers max_seq_length was given, but %s has no %s: nothing to set.",
                    src / model, ST_CONFIG)


def _left_out(rel: Path, model: Path, is_dir: bool) -> tuple[str, str] | None:
    """``(entry, kind)`` when source path ``rel`` is not copied because it holds the model in another
    format, so with the old table: a folder of exports (``entry`` ``"onnx/"``, whole), an export file,
    or the model's own weights in another format (``model``: the model's folder). None: copy it."""
    folders = rel.parts if is_dir else rel.parts[:-1]
    for i, part in enumerate(folders):
        if part.lower() in EXPORT_DIRS:
            return PurePosixPath(*rel.parts[: i + 1]).as_posix() + "/", EXPORT_DIRS[part.lower()]
    name = rel.name.lower()
    if is_dir:
        return None
    if name.endswith((".onnx", ".onnx_data", ".onnx.data")):
        return rel.as_posix(), "ONNX"
    if name.startswith("openvino_model") and name.endswith((".xml", ".bin")):
        return rel.as_posix(), "OpenVINO"
    if rel.parent == model and name.endswith((*_OTHER_WEIGHTS, ".index.json")):
        return rel.as_posix(), "weights"
    return None


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


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
