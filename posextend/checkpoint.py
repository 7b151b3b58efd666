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
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import __version__
from .errors import CorruptCheckpointError, DestinationError, InvalidLengthError, SourceError, StrategyError
from .io import (
    BIN_INDEX, SAFE_INDEX, SAFE_SINGLE, ByteRanges, CheckpointReader, Entry, Source, atomic_output, copy_file,
    nonfinite_count, prefetch_torch, write_safetensors,
)
from .lookup import all_specs, spec_for
from .specs import ArchitectureSpec, Layout
from .strategies import check_params, get_strategy, resize_table
from .twin import get_path, set_path

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# Weight files in other formats would still hold the old table: they are not copied.
_OTHER_WEIGHTS = (".bin", ".safetensors", ".h5", ".msgpack", ".onnx", ".gguf", ".pt", ".pth", ".ckpt", ".ot")
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
    config_lengths: dict[str, int]


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
        }


# ----------------------------------------------------------------------------- helpers


def resolve_source(src: str | Path) -> Path:
    """A local checkpoint directory, or a hub id already present in the local HF cache."""
    path = Path(src).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.exists():
        raise SourceError(f"{src} is a file; give the checkpoint's directory (the one holding config.json).")
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


def check_length(new_length: int, old_length: int, *, allow_shrink: bool) -> None:
    if not isinstance(new_length, int) or isinstance(new_length, bool) or new_length <= 0:
        raise InvalidLengthError(f"The new length must be a positive number of positions, got {new_length!r}.")
    if new_length < old_length and not allow_shrink:
        raise InvalidLengthError(
            f"The new length {new_length} is below the current {old_length}: positions from "
            f"{new_length} on would be cut. To shrink on purpose, pass --shrink (allow_shrink=True)."
        )


def check_destination(src: Path, dst: Path, *, overwrite: bool) -> None:
    src, dst = src.resolve(), dst.resolve()
    if dst == src or src in dst.parents:
        raise DestinationError(f"The destination {dst} is the source or inside it; choose a directory outside {src}.")
    if dst in src.parents:
        raise DestinationError(f"The destination {dst} contains the source {src}; choose another directory.")
    if (dst.exists() or dst.is_symlink()) and not overwrite:
        raise DestinationError(f"{dst} already exists; pass --overwrite (overwrite=True) to replace it.")


def _json_int(path: Path, key: str) -> int | None:
    if path.is_file():
        try:
            value = json.loads(path.read_text()).get(key)
            return value if isinstance(value, int) else None
        except ValueError:
            return None
    return None


ST_CONFIG = "sentence_bert_config.json"  # sentence-transformers: encode() truncates to its max_seq_length


@contextlib.contextmanager
def _opened(
    src: str | Path, table: str | None = None,
) -> Iterator[tuple[Path, dict[str, Any], CheckpointReader, ArchitectureSpec, Layout]]:
    """Resolve, read the config, open the weights lazily and locate the position table(s)."""
    directory = resolve_source(src)
    config = read_config(directory)
    reader = CheckpointReader(directory)
    try:
        shapes = {name: entry.shape for name, entry in reader.entries.items()}
        spec = spec_for(config, table=table)
        if spec.covered_by == "probed":
            log.info("No spec for model type %r: observed on a twin: %s", spec.model_type, ", ".join(spec.tables))
        yield directory, config, reader, spec, spec.locate(shapes, config)
    finally:
        reader.close()


def read_position_table(src: str | Path, table: str | None = None) -> torch.Tensor:
    """The usable rows of a checkpoint's (first) position table, read by name only."""
    with _opened(src, table) as (_, _, reader, _, layout):
        return reader.get(layout.tables[0])[layout.reserved :]


# ------------------------------------------------------------------------------- public


def inspect_checkpoint(src: str | Path) -> CheckpointInfo:
    """Describe a checkpoint's position table(s) without loading the model.

    Example::

        >>> info = posextend.inspect_checkpoint("all-MiniLM-L6-v2")
        >>> info.usable, info.tables[0].name
        (512, 'embeddings.position_embeddings.weight')
    """
    directory = resolve_source(src)
    config = read_config(directory)
    with CheckpointReader(directory) as reader:
        shapes = {name: entry.shape for name, entry in reader.entries.items()}
        groups = []
        for spec in all_specs(config):
            layout = spec.locate(shapes, config)
            tables = [TableInfo(n, shapes[n][0], shapes[n][1], reader.entries[n].dtype) for n in layout.tables]
            lengths = {k: v for k in spec.length_keys if (v := get_path(config, k)) is not None}
            groups.append((spec, layout, GroupInfo(spec.group, tables, layout.usable, layout.reserved, lengths)))
        spec, layout, first = groups[0]
        return CheckpointInfo(
            path=str(directory),
            model_type=config.get("model_type", ""),
            architectures=list(config.get("architectures") or []),
            spec="probed" if spec.covered_by == "probed" else spec.model_type,
            covered_by=spec.covered_by,
            weights_format=reader.format + (" (sharded)" if reader.sharded else ""),
            weight_files=[f.name for f in reader.files],
            tables=first.tables,
            usable=layout.usable,
            reserved=layout.reserved,
            config_lengths=first.config_lengths,
            buffers=list(layout.buffers),
            tokenizer_max_length=_json_int(directory / "tokenizer_config.json", "model_max_length"),
            st_max_seq_length=_json_int(directory / ST_CONFIG, "max_seq_length"),
            groups=[g for _, _, g in groups],
        )


def resize_checkpoint(
    src: str | Path,
    dst: str | Path,
    new_length: int,
    strategy: str = "tile",
    *,
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
    """Write a copy of checkpoint ``src`` at ``dst`` with ``new_length`` usable positions.

    Only the position table(s) and the buffers that follow the length change; every
    other tensor's bytes are copied as they are. ``src`` is never modified, and ``dst``
    appears only when complete. ``progress(done_bytes, total_bytes)`` is called while
    writing (one call at a time, possibly from the threads that copy whole shards).
    ``link=True`` hard-links shards that need no change instead of copying them.

    Args:
        table: which tables, for a model with several lengths (``"encoder"``, ``"decoder"``,
            ``"text"``; see ``inspect_checkpoint(src).groups``). Not needed with one length.
        verify: check the output against a twin of its written config (shapes, a forward
            pass at the full new length) before it appears. Default: only for a family
            observed on a twin (no written spec); ``True`` for any family.
        st_max_seq_length: what a sentence-transformers model's ``max_seq_length`` becomes
            (default: the new length).

    Example::

        >>> report = posextend.resize_checkpoint("gpt2", "gpt2-4k", 4096, "interpolate", seed=0)
        >>> report.old_length, report.new_length
        (1024, 4096)
    """
    start = time.perf_counter()
    dst = Path(dst).expanduser()
    strat = check_params(strategy, params)
    with _opened(src, table) as (directory, config, reader, spec, layout):
        check_destination(directory, dst, overwrite=overwrite)
        check_length(new_length, layout.usable, allow_shrink=allow_shrink)
        if st_max_seq_length is not None and not 0 < st_max_seq_length <= new_length:
            raise InvalidLengthError(
                f"The sentence-transformers max_seq_length must be between 1 and the new length {new_length}, "
                f"got {st_max_seq_length}."
            )
        seed = secrets.randbits(63) if seed is None else seed
        _check_source_tables(reader, layout)

        def new_table(name: str) -> Source:
            if strat.rows and reader.format == "safetensors":  # a row strategy: copy the rows' bytes
                return table_rows(reader.entries[name], layout.reserved, strat.rows(layout.usable, new_length),
                                  new_length)
            return lambda: resize_table(reader.get(name), new_length, strategy, reserved=layout.reserved,
                                        seed=seed, params=params, context=config)

        new_tables = {name: new_table(name) for name in layout.tables}
        report = ResizeReport(
            src=str(directory), dst=str(dst.resolve()), model_type=spec.model_type, strategy=strategy,
            params=dict(params), seed=seed, old_length=layout.usable, new_length=new_length,
            reserved=layout.reserved, tables=list(layout.tables), buffers=list(layout.buffers),
            dropped=list(layout.dropped), covered_by=spec.covered_by,
        )
        with atomic_output(dst, overwrite=overwrite) as tmp:
            _write_weights(reader, tmp, spec, new_tables, spec.config_value(config, new_length), report, link, progress)
            _copy_other_files(directory, tmp, reader, spec, config, report, st_max_seq_length)
            if verify or (verify is None and spec.covered_by == "probed"):
                _verify(tmp, spec, report, reader)
            card = directory / "README.md"
            (tmp / "README.md").write_text(model_card(report, card.read_text(errors="replace") if card.is_file() else ""))
        report.seconds = time.perf_counter() - start
        log.info("Resized %s: %d -> %d positions (%s) in %.2fs", directory, report.old_length, new_length, strategy, report.seconds)
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


def _verify(out_dir: Path, spec: ArchitectureSpec, report: ResizeReport, reader: CheckpointReader) -> None:
    """Check the written files against a twin of the written config (see :func:`posextend.probe.verify`)."""
    from .probe import verify

    with CheckpointReader(out_dir) as written:
        shapes = {n: e.shape for n, e in written.entries.items()}
    source = {n: e.shape for n, e in reader.entries.items()}
    verify(out_dir, spec, report.tables, shapes, source, report.new_length, report.reserved)
    report.verified = True


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


def _write_weights(
    reader: CheckpointReader,
    out_dir: Path,
    spec: ArchitectureSpec,
    new_tables: dict[str, Source],
    buffer_length: int,
    report: ResizeReport,
    link: bool,
    progress: Callable[[int, int], None] | None,
) -> None:
    rules = {name: spec.buffer_rule(name) for name in report.buffers}
    new_rows = report.new_length + report.reserved

    def plan(entry: Entry) -> tuple[Entry, Source]:
        """The output entry and how to make it (None: copy the source bytes)."""
        name = entry.name
        if name in new_tables:  # same dtype, new number of rows
            return dataclasses.replace(entry, shape=(new_rows, *entry.shape[1:])), new_tables[name]
        if name in rules:
            rule = rules[name]
            shape = rule.new_shape(entry.shape, buffer_length)
            return dataclasses.replace(entry, shape=shape), lambda: rule.rebuild(reader.get(name), buffer_length)
        if reader.format == "bin":
            return entry, lambda: reader.get(name)
        return entry, None

    dropped = set(report.dropped)
    sources = dict(reader.by_file())
    # Within a file, copied bytes come first and new tensors last (safetensors allows any order),
    # so the copy runs while torch is still being imported.
    plans = {
        path: sorted((plan(e) for e in entries if e.name not in dropped), key=lambda item: callable(item[1]))
        for path, entries in sources.items()
    }
    if any(callable(make) for items in plans.values() for _, make in items):
        prefetch_torch()  # a tensor is computed: import torch while the unchanged bytes are copied
    whole = {p: len(items) == len(sources[p]) and all(make is None for _, make in items) for p, items in plans.items()}
    total = sum(e.nbytes for items in plans.values() for e, _ in items)
    done = 0
    lock, cancelled = threading.Lock(), threading.Event()

    def advance(n: int) -> None:  # called from the copying threads too
        nonlocal done
        if cancelled.is_set():
            raise _Cancelled
        with lock:
            done += n
            report.bytes_written = done
            if progress:
                progress(done, total)

    provenance = report.provenance()
    weight_map: dict[str, str] = {}
    out_names = {}
    for number, (path, items) in enumerate(plans.items(), start=1):
        if reader.format == "bin":
            out_names[path] = SAFE_SINGLE if not reader.sharded else f"model-{number:05d}-of-{len(plans):05d}.safetensors"
        else:
            out_names[path] = path.name
        weight_map.update({e.name: out_names[path] for e, _ in items})
    # Files without a changed tensor are copied whole (or linked) by a few threads, while this one
    # rewrites the others: the kernel's copy is CPU-bound (page cache to page cache), so copies
    # of several files at once use every core, and the rewrite meanwhile waits for torch's import.
    copies = [p for p in plans if whole[p]]
    pool = ThreadPoolExecutor(max_workers=max(1, min(len(copies), COPY_THREADS)), thread_name_prefix="posextend-copy")
    try:
        futures = [pool.submit(copy_file, p, out_dir / out_names[p], link=link, progress=advance) for p in copies]
        for path, items in plans.items():
            if not whole[path]:
                metadata = {**reader.metadata.get(path, {"format": "pt"}), **provenance}
                write_safetensors(out_dir / out_names[path], items, metadata, progress=advance)
                report.files_rewritten.append(out_names[path])
        for path, future in zip(copies, futures):
            future.result()
            report.files_copied.append(out_names[path])
    except BaseException:
        cancelled.set()  # the copying threads stop at their next chunk, before the output is removed
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    if reader.sharded:
        index = {"metadata": {"total_size": total, **provenance}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")


def updated_config(config: Mapping[str, Any], updates: Mapping[str, int]) -> dict[str, Any]:
    """``config`` with each (dotted) field in ``updates`` set."""
    out = dict(config)
    for path, value in updates.items():
        out = set_path(out, path, value)
    return out


def _copy_other_files(
    src: Path, out_dir: Path, reader: CheckpointReader, spec: ArchitectureSpec,
    config: dict[str, Any], report: ResizeReport, st_max_seq_length: int | None = None,
) -> None:
    """Copy config, tokenizer and every other non-weight file, editing lengths as JSON."""
    weight_files = {f.resolve() for f in reader.files}
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if any(part.startswith(".") and part != ".gitattributes" for part in rel.parts) or path.is_dir():
            continue
        if path.resolve() in weight_files or rel.name in (SAFE_INDEX, BIN_INDEX):
            continue
        if rel.name.endswith(_OTHER_WEIGHTS) or rel.name.endswith(".index.json"):
            report.files_skipped.append(str(rel))
            log.warning("Not copying %s: it holds weights in another format with the old table.", rel)
            continue
        target = out_dir / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if rel == Path("config.json"):
            _write_json(target, updated_config(config, spec.config_updates(config, report.new_length)))
        elif rel == Path("tokenizer_config.json"):
            _write_json(target, {**json.loads(path.read_text()), "model_max_length": report.new_length})
        elif rel.name == ST_CONFIG:
            report.st_max_seq_length = st_max_seq_length or report.new_length
            _write_json(target, {**json.loads(path.read_text()), "max_seq_length": report.st_max_seq_length})
        elif rel != Path("README.md"):
            shutil.copy2(path, target)
    has_tokenizer = any((src / name).is_file() for name in TOKENIZER_FILES)
    if has_tokenizer and not (src / "tokenizer_config.json").is_file():
        _write_json(out_dir / "tokenizer_config.json", {"model_max_length": report.new_length})
    if st_max_seq_length is not None and report.st_max_seq_length is None:
        log.warning("A sentence-transformers max_seq_length was given, but %s has no %s: nothing to set.", src, ST_CONFIG)


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def model_card(report: ResizeReport, original: str = "", *, trained: bool = False) -> str:
    """A short model card stating how the checkpoint was made (``trained``: after a fine-tune)."""
    grew = report.new_length > report.old_length and not trained
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
        f"- Strategy: `{report.strategy}` — {strategy.description}",
        f"- Parameters: `{json.dumps(report.params, sort_keys=True)}`, seed {report.seed}",
        f"- Tables: {', '.join(f'`{t}`' for t in report.tables)}",
    ]
    if report.covered_by == "probed":
        lines.append("- Family: no written spec; tables, reserved rows and length field observed on a twin of its config")
    if report.verified:
        lines.append("- Verified: a twin built from the written config has the written shapes and runs at the full length")
    if report.st_max_seq_length is not None:
        lines.append(f"- sentence-transformers `max_seq_length`: {report.st_max_seq_length}")
    if report.buffers:
        lines.append(f"- Length-dependent buffers rebuilt: {len(report.buffers)}")
    if report.dropped:
        lines.append(f"- Obsolete tensors left out: {len(report.dropped)} (e.g. `{report.dropped[0]}`)")
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
