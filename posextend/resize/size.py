"""The size of a resize's output, from its plan, before anything is written: :func:`check_output_size`.

A resize (or a fine-tune, which extends in memory and then writes) is refused before it writes a byte when
the destination's file system has less free space than the output needs, or when its new position tables
would be *large*: more than :data:`LARGE_FACTOR` times every other weight of the checkpoint together, and
more than :data:`LARGE_FLOOR` bytes. No family uses tables of that size (all-MiniLM-L6-v2, 90 MB of
weights, reaches it near 700,000 positions, GPT-2, 500 MB, near 650,000); a length typed with a few zeros
too many does. The caller may say that it is intended (``allow_large``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from posextend.errors import DestinationError, LargeOutputError, PosExtendError
from posextend.families.lookup import all_specs
from posextend.files.checkpoint import Checkpoint
from posextend.files.tensorfile import Entry
from posextend.resize.plan import GroupPlan, Request, plan_resize
from posextend.resize.writer import copied_bytes

LARGE_FACTOR = 4  # new tables larger than this many times every other weight ...
LARGE_FLOOR = 2**30  # ... and than this many bytes are large


@dataclass(frozen=True)
class OutputSize:
    """Bytes of a resize's output: ``total`` (the folder, the model card aside), ``tables`` (the new position
    tables) and ``rest`` (every other weight of the checkpoint, as the source has them)."""

    total: int
    tables: int
    rest: int

    @property
    def large(self) -> bool:
        """Whether the new tables are large (see the module's docstring)."""
        return self.tables > max(LARGE_FACTOR * self.rest, LARGE_FLOOR)


def output_size(source: Checkpoint, plans: Sequence[GroupPlan], dst: Path | None = None, *,
                link: bool = False) -> OutputSize:
    """The size of the checkpoint ``source`` resized by ``plans``, from the weights' headers and the plans'
    shapes (nothing is computed or read). With ``link``, weight files that hold nothing to change are
    hard-linked, not copied, where ``dst`` is on their file system: they take no space there."""
    entries, config = source.reader.entries, source.config
    new: dict[str, int] = {}  # the written bytes of each tensor the plans change (0: left out)
    tables = []
    for plan in plans:
        value = plan.buffer_value(config)
        for name in plan.layout.tables:
            new[name] = _nbytes(entries[name], plan.table_shape(entries[name].shape))
            tables.append(name)
        for name in plan.layout.buffers:
            new[name] = _nbytes(entries[name], plan.spec.buffer_rule(name).new_shape(entries[name].shape, value))
        new.update(dict.fromkeys(plan.layout.dropped, 0))
    weights = sum(new.get(name, entry.nbytes) for name, entry in entries.items())
    if link and dst is not None and source.reader.format == "safetensors":
        device = os.stat(_existing(dst)).st_dev
        changed = {entries[name].file for name in new}
        weights -= sum(f.stat().st_size for f in source.reader.files if f not in changed and f.stat().st_dev == device)
    rest = sum(entry.nbytes for name, entry in entries.items() if name not in tables)
    return OutputSize(weights + copied_bytes(source), sum(new[name] for name in tables), rest)


def check_output_size(source: Checkpoint, dst: Path, plans: Sequence[GroupPlan], *, allow_large: bool | None,
                      link: bool = False) -> OutputSize:
    """The size of the output (:func:`output_size`), once it is known to fit: refused when the file system of
    ``dst`` has less free space, or when the new tables are large and ``allow_large`` is not True (None: the
    caller offers no way to go on, as a fine-tune, which trains every position, does not).

    Raises:
        LargeOutputError: the new tables are large (its ``summary`` states their size).
        DestinationError: the destination's file system has less free space than the output needs.
    """
    size = output_size(source, plans, dst, link=link)
    if size.large and not allow_large:
        summary = (f"The new position table(s) would take {human_bytes(size.tables)}, "
                   f"{size.tables / max(size.rest, 1):,.0f} times the {human_bytes(size.rest)} of every other weight "
                   "of the checkpoint: far more positions than a model of this size can use.")
        then = ("To write them anyway, pass allow_large=True." if allow_large is False
                else "Choose a shorter length.")
        raise LargeOutputError(f"{summary} Nothing was written. {then}", summary=summary)
    free = shutil.disk_usage(_existing(dst)).free
    if size.total > free:
        raise DestinationError(
            f"Writing {dst} needs {human_bytes(size.total)}, but its file system has only {human_bytes(free)} free: "
            "free some space or choose a destination on another disk. Nothing was written.")
    return size


def check_extension_size(source: Checkpoint, dst: Path, length: int | None, *,
                         decoder_length: int | None = None) -> OutputSize | None:
    """Before a fine-tune extends ``source`` in memory to ``length`` usable positions (an encoder-decoder's
    encoder, and its decoder to ``decoder_length``, as LED) and writes it at ``dst``: :func:`check_output_size`
    of that resize, with no way on past large tables (a fine-tune trains on sequences of the full length).
    A checkpoint or length that cannot be planned is left to the fine-tune's own checks, which say what is
    wrong with it (None: not checked)."""
    try:
        groups = {spec.group for spec in all_specs(source.config) if spec.rank == 1}
        two = groups == {"encoder", "decoder"}  # the run's length is the encoder's; the decoder has its own
        requests = [Request(n, group=group if two else None, allow_shrink=True)
                    for n, group in ((length, "encoder"), (decoder_length if two else None, "decoder")) if n]
        plans = [plan for request in requests for plan in plan_resize(source.config, source.shapes, request)]
    except PosExtendError:
        return None
    return check_output_size(source, dst, plans, allow_large=None)


def human_bytes(n: int) -> str:
    """``n`` bytes in binary units: ``90.9 MiB``, ``153.6 GiB``."""
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    power = min(int(math.log(n, 1024)) if n > 0 else 0, len(units) - 1)
    return f"{n} B" if power == 0 else f"{n / 1024**power:.1f} {units[power]}"


def _nbytes(entry: Entry, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of ``entry``'s dtype with ``shape``."""
    return dataclasses.replace(entry, shape=shape).nbytes


def _existing(path: Path) -> Path:
    """``path``, or its nearest parent that exists (where the output's file system is)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
