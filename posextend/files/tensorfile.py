"""The safetensors format: dtype codes, a tensor's :class:`Entry`, reading a header, writing a file.

A safetensors file is an 8-byte header length, a JSON header (name -> dtype, shape, data offsets;
``__metadata__``) and the tensors' bytes. :func:`write_safetensors` streams one tensor at a time,
copying unchanged bytes from their source file (:mod:`posextend.files.copying`). Importing this
module does not import torch; only code that makes a tensor does.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from posextend.errors import CorruptCheckpointError
from posextend.files.copying import Progress, RangeCopier
from posextend.files.oserrors import source_error

PAGE = 4096  # bytes of a memory page: the kernel copies file data a page at a time

if TYPE_CHECKING:
    import torch

_ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8, "C64": 8,
}


@lru_cache(maxsize=1)
def torch_dtypes() -> dict[str, torch.dtype]:
    """safetensors dtype code -> torch dtype (imports torch)."""
    import torch

    return {
        "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
        "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
        "U8": torch.uint8, "BOOL": torch.bool,
        "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    }


def dtype_code(dtype: torch.dtype) -> str:
    """torch dtype -> safetensors dtype code."""
    codes = {v: k for k, v in torch_dtypes().items()}
    if dtype not in codes:
        raise CorruptCheckpointError(f"Tensors of dtype {dtype} cannot be stored in safetensors by posextend.")
    return codes[dtype]

_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class Entry:
    """One tensor of a checkpoint: where it lives and what it is, without its data."""

    name: str
    file: Path
    dtype: str  # safetensors dtype code ("F32", "BF16", ...)
    shape: tuple[int, ...]
    start: int = 0  # absolute byte offsets in ``file`` (safetensors only)
    end: int = 0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ITEMSIZE[self.dtype]


def read_header(path: Path) -> tuple[list[Entry], dict[str, str]]:
    """Parse and validate a safetensors header: entries in data order, and metadata."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError("file shorter than its 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n > min(size - 8, _MAX_HEADER):
                raise ValueError(f"header length {n} exceeds the file ({size} bytes)")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        base, entries = 8 + n, []
        for name, info in header.items():
            dtype, shape, (lo, hi) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            if dtype not in _ITEMSIZE:
                raise ValueError(f"tensor {name!r} has unknown dtype {dtype!r}")
            entry = Entry(name, path, dtype, shape, base + lo, base + hi)
            if not 0 <= lo <= hi or entry.end > size or hi - lo != entry.nbytes:
                raise ValueError(f"tensor {name!r} has offsets {lo}..{hi} outside or inconsistent with the file")
            entries.append(entry)
    except OSError as exc:
        raise source_error(exc, path) from None
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(
            f"{path} is not a valid safetensors file ({exc}); it may be truncated or damaged: "
            "re-download or re-save it."
        ) from None
    entries.sort(key=lambda e: e.start)
    return entries, metadata


ByteRanges = tuple[tuple[Path, int, int], ...]  # (file, start, end) pieces, copied in order
# what a written tensor holds: made by a call, byte ranges of a file copied in order, or (None) its own bytes
TensorData = Callable[[], "torch.Tensor"] | ByteRanges | None


def write_safetensors(
    path: Path,
    items: list[tuple[Entry, TensorData]],
    metadata: Mapping[str, str],
    *,
    progress: Progress | None = None,
) -> None:
    """Write a safetensors file tensor by tensor, holding at most one new tensor in memory.

    Each item is ``(entry, source)``: ``entry`` gives the output name, dtype and shape.
    With ``source=None`` the entry's bytes are copied from its source file; with byte
    ranges, those bytes (they must add up to the entry's size); otherwise ``source()`` is
    called when the tensor's turn comes and must return that dtype and shape.
    """
    blob = _header(items, metadata)
    with open(path, "wb") as out, RangeCopier(out, progress) as copier:
        out.write(struct.pack("<Q", len(blob)) + blob)
        for entry, make in items:
            if callable(make):
                copier.flush()
                _write_tensor(out, entry, make(), progress)
                continue
            pieces = ((entry.file, entry.start, entry.end),) if make is None else make
            if sum(end - start for _, start, end in pieces) != entry.nbytes:
                raise RuntimeError(f"{entry.name}: byte ranges do not add up to {entry.nbytes} bytes")
            for piece in pieces:
                copier.add(*piece)


def _header(items: list[tuple[Entry, TensorData]], metadata: Mapping[str, str]) -> bytes:
    """The safetensors header of ``items`` in order, padded with spaces (as the format allows) to 8 bytes, and
    further where that puts the first copied bytes at the offset within a page that they have in their source
    (:func:`_page_padding`)."""
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset, first_copy = 0, None
    for entry, make in items:
        header[entry.name] = {"dtype": entry.dtype, "shape": list(entry.shape), "data_offsets": [offset, offset + entry.nbytes]}
        if first_copy is None and not callable(make) and entry.nbytes:
            first_copy = (offset, entry.start if make is None else make[0][1])
        offset += entry.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    return blob + b" " * _page_padding(len(blob), first_copy)


def _page_padding(length: int, first_copy: tuple[int, int] | None) -> int:
    """Spaces after a header of ``length`` bytes: to a multiple of 8, and, where ``first_copy`` (the first copied
    bytes' offset in the data, and in their source file) allows it, so that those bytes fall at the offset within a
    :data:`PAGE` they have in the source. The kernel's copy then moves whole pages; shifted by a few hundred bytes
    (a header that grew), copying a 1.4 GB checkpoint and flushing it to disk took 1.3x as long."""
    if first_copy is None or (first_copy[1] - first_copy[0]) % 8:  # the data would not start 8-byte aligned
        return -length % 8
    return (first_copy[1] - 8 - length - first_copy[0]) % PAGE


def _write_tensor(out, entry: Entry, tensor, progress: Progress | None) -> None:
    """A computed tensor's bytes, after checking it has the dtype and shape its entry declares."""
    import torch

    if dtype_code(tensor.dtype) != entry.dtype or tuple(tensor.shape) != entry.shape:
        raise RuntimeError(f"{entry.name}: produced {tensor.dtype} {tuple(tensor.shape)}, declared {entry.dtype} {entry.shape}")
    data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    out.write(memoryview(data.numpy()))
    if progress:
        progress(data.numel())
