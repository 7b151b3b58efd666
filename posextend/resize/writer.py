"""The one checkpoint writer, of ``resize-model`` and of the fine-tune's save: a source checkpoint's
files written again as a :class:`Change` makes them, every other byte copied.

Weights are written tensor by tensor (a file without a change is copied whole, by a few threads,
or hard-linked); ``config.json``, the tokenizer's, image processor's and sentence-transformers
settings are edited as JSON to follow the resize; every other file and folder is copied in the
same layout, except the model in other formats (exports, other weight files), which still holds
the old table. The model card is the caller's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from posextend.errors import PosExtendError
from posextend.files.checkpoint import Checkpoint
from posextend.files.copying import copy_file
from posextend.files.reader import BIN_INDEX, SAFE_INDEX, SAFE_SINGLE, CheckpointReader, prefetch_torch
from posextend.files.tensorfile import Entry, TensorData, write_safetensors
from posextend.resize.plan import GroupPlan, ImageSize
from posextend.files.sources import ST_CONFIG, TOKENIZER_FILES, json_int
from posextend.families.specs import IMAGE_COUNT_FIELD
from posextend.families.configs import get_path, set_path

log = logging.getLogger(__name__)

# Weight files in other formats would still hold the old table: the resized model's own are not copied
# (another module's, a sentence-transformers Dense layer's say, are).
_OTHER_WEIGHTS = (".bin", ".safetensors", ".h5", ".msgpack", ".onnx", ".gguf", ".pt", ".pth", ".ckpt", ".ot")
# Exports of the model for other runtimes hold the old table too: left out wherever they sit, and a
# folder of them (sentence-transformers' onnx/ and openvino/) whole.
EXPORT_DIRS = {"onnx": "ONNX", "openvino": "OpenVINO"}

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
    - ``config``: fields of ``config.json`` set besides the plans' (a fine-tune's new head: its labels).
    """

    tensors: Mapping[str, tuple[tuple[int, ...], TensorData]] = field(default_factory=dict)
    added: tuple[tuple[Entry, TensorData], ...] = ()
    dropped: frozenset[str] = frozenset()
    plans: tuple[GroupPlan, ...] = ()
    metadata: Mapping[str, str] = field(default_factory=dict)
    st_max_seq_length: int | None = None
    config: Mapping[str, Any] = field(default_factory=dict)


COPY_THREADS = 4  # whole-file copies at once: the kernel's copy of a file runs on one core


class _Cancelled(Exception):
    """Raised in a copying thread when the resize has failed elsewhere."""


def write_checkpoint(source: Checkpoint, out: Path, change: Change, *, link: bool = False,
                      progress: Callable[[int, int], None] | None = None) -> Written:
    """Write into ``out`` the checkpoint ``source`` as ``change`` makes it: the one writer of ``resize-model``
    and of the fine-tune's save.

    The weights of the model's folder (``source.reader``'s) are written tensor by tensor: those ``change`` makes,
    new ones after; every other tensor's bytes are copied, and files without a change are copied whole (or
    hard-linked with ``link``). Every other file of the source follows, in the same layout: ``config.json``
    (``source.config``) and the tokenizer's, processor's and sentence-transformers settings edited
    by ``change.plans``. The model card is the caller's. ``progress(done_bytes, total_bytes)`` as in
    :func:`resize_checkpoint`.
    """
    written = Written()
    model_out = out / source.transformer_dir  # out itself, or an older ST folder's 0_Transformer/
    model_out.mkdir(exist_ok=True)
    _write_weights(source.reader, model_out, change, written, link, progress)
    _copy_other_files(source, out, change, written)
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
                ) -> dict[Path, list[tuple[Entry, TensorData]]]:
    """Per source file, each kept tensor's output entry and how to make it (None: copy its bytes), and the
    added tensors in the last file. Within a file, copied bytes come first and new tensors last
    (safetensors allows any order), so the copy runs while torch is still being imported."""

    def plan(entry: Entry) -> tuple[Entry, TensorData]:
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


def _copy_other_files(source: Checkpoint, out_dir: Path, change: Change, written: Written) -> None:
    """Copy config, tokenizer, image processor and every other non-weight file, editing lengths as JSON.

    The model's own files sit in ``source.transformer_dir`` (the root, or an older sentence-transformers
    folder's ``0_Transformer/``); every other file and folder is copied as it is, in the same layout.
    Copies of the model in other formats (its weights in other formats, ONNX and OpenVINO exports) still
    hold the old table: they are left out and listed in ``written.files_skipped``.
    """
    src, config = source.directory, source.config
    updates = {**{k: v for plan in change.plans for k, v in plan.config_updates(config).items()}, **change.config}
    text = next((p for p in change.plans if not p.spec.grid), None)
    image = next((p for p in change.plans if p.spec.grid), None)
    model = Path(source.transformer_dir)  # relative to src and out_dir; Path("") is the root
    stated = json_int(src / model / "tokenizer_config.json", "model_max_length")
    tokenizer = tokenizer_plan(change.plans, config, stated)
    st_file = source.st_config
    for path, rel, left_out in _other_files(source):
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
        elif rel == model / "tokenizer_config.json" and tokenizer:
            _write_json(target, {**json.loads(path.read_text()), "model_max_length": tokenizer.new_usable})
        elif rel == model / PROCESSOR_CONFIG and image:
            old = image.spec.grid.sizes(config)[0]
            _write_json(target, processor_config(json.loads(path.read_text()), old, image.target, _counts(image, config)))
        elif rel == model / "processor_config.json" and image:  # a multimodal processor's own image-token count
            counts = _counts(image, config)
            data = with_counts(json.loads(path.read_text()), counts)
            if isinstance(data.get("image_processor"), Mapping):  # transformers 5 keeps the image settings here too
                data["image_processor"] = processor_config(data["image_processor"], image.spec.grid.sizes(config)[0],
                                                           image.target, counts)
            _write_json(target, data)
        elif st_file is not None and path == st_file and text:
            written.st_max_seq_length = change.st_max_seq_length or text.new_usable
            _write_json(target, {**json.loads(path.read_text()), "max_seq_length": written.st_max_seq_length})
        elif rel != Path("README.md"):
            shutil.copy2(path, target)
    has_tokenizer = any((src / model / name).is_file() for name in TOKENIZER_FILES)
    if tokenizer and has_tokenizer and not (src / model / "tokenizer_config.json").is_file():
        _write_json(out_dir / model / "tokenizer_config.json", {"model_max_length": tokenizer.new_usable})
    if change.st_max_seq_length is not None and written.st_max_seq_length is None:
        log.warning("A sentence-transformers max_seq_length was given, but %s has no %s: nothing to set.",
                    src / model, ST_CONFIG)


def tokenizer_plan(plans: tuple[GroupPlan, ...], config: Mapping[str, Any], stated: int | None) -> GroupPlan | None:
    """The plan of positions the tokenizer's ``model_max_length`` follows (None: it is copied as it is).

    The plan whose old length the tokenizer ``stated``; where it stated none's, the first plan of positions,
    unless it stated the length of a group left as it is (LED's encoder, when only its decoder grows).
    """
    text = [p for p in plans if not p.spec.grid]
    same = next((p for p in text if p.layout.usable == stated), None)
    if same is not None or not text or stated is None or text[0].spec.group == "model":  # "model": one length
        return same or (text[0] if text else None)
    from posextend.families.lookup import all_specs

    try:
        kept = [s for s in all_specs(config) if s.rank == 1 and s.group not in {p.spec.group for p in text}]
        if any(s.usable_from_config(config) == stated for s in kept):
            return None
    except PosExtendError:  # the groups were found once already; without them, as before
        pass
    return text[0]


def _other_files(source: Checkpoint) -> Iterator[tuple[Path, Path, tuple[str, str] | None]]:
    """Each file and folder of ``source`` but its weights (hidden ones aside): its path, its path relative to
    the source, and, for the source model in another format that is not copied, what :func:`_left_out` says."""
    src, model = source.directory, Path(source.transformer_dir)
    weight_files = {f.resolve() for f in source.reader.files}
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if any(part.startswith(".") and part != ".gitattributes" for part in rel.parts):
            continue
        if path.resolve() in weight_files or (rel.parent == model and rel.name in (SAFE_INDEX, BIN_INDEX)):
            continue  # written by _write_weights
        yield path, rel, _left_out(rel, model, path.is_dir())


def copied_bytes(source: Checkpoint) -> int:
    """Bytes of the files the writer writes beside the weights (configs, tokenizer, modules), as the source
    has them (the edited JSON files differ by a few bytes); the model card aside."""
    return sum(path.stat().st_size for path, rel, left_out in _other_files(source)
               if left_out is None and rel != Path("README.md") and path.is_file())


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
