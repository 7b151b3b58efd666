"""Lazy checkpoint reading and streaming safetensors writing.

Nothing here instantiates a model or loads a tensor that does not change: tensors are
addressed by name, their bytes located from the safetensors header, and passed through
as byte ranges (``os.copy_file_range``, which the kernel may turn into a reflink).
Legacy ``pytorch_model.bin`` files are read with ``torch.load(weights_only=True, mmap=True)``,
one shard at a time, and written out as safetensors.

Importing this module does not import torch (it takes longer than copying a GB). A row
strategy (``tile``) on safetensors never needs it: the new table is byte ranges of the old
one. Otherwise the file path starts torch's import in the background (:func:`prefetch_torch`)
and copies bytes meanwhile; only code that makes a tensor imports it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import struct
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import CorruptCheckpointError, DestinationError, SourceError

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


def prefetch_torch() -> None:
    """Start importing torch in a background thread (no-op once imported or started)."""
    if "torch" not in sys.modules:
        threading.Thread(target=import_module, args=("torch",), name="posextend-import-torch", daemon=True).start()

SAFE_SINGLE, SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"
BIN_SINGLE, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
_MAX_HEADER = 100 * 1024 * 1024
CHUNK = 64 * 1024 * 1024
Progress = Callable[[int], None]


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
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(
            f"{path} is not a valid safetensors file ({exc}); it may be truncated or damaged: "
            "re-download or re-save it."
        ) from None
    entries.sort(key=lambda e: e.start)
    return entries, metadata


def read_tensor(entry: Entry) -> torch.Tensor:
    """Read one tensor of a safetensors file (only its bytes)."""
    import torch

    dtypes = torch_dtypes()
    if entry.dtype not in dtypes:
        raise CorruptCheckpointError(f"Tensor {entry.name!r} has dtype {entry.dtype}, which torch cannot hold.")
    with open(entry.file, "rb") as f:
        f.seek(entry.start)
        data = bytearray(f.read(entry.nbytes))
    if len(data) != entry.nbytes:
        raise CorruptCheckpointError(f"{entry.file} is truncated inside tensor {entry.name!r}.")
    if not data:
        return torch.empty(entry.shape, dtype=dtypes[entry.dtype])
    return torch.frombuffer(data, dtype=dtypes[entry.dtype]).reshape(entry.shape)


# Exponent bits of IEEE formats: all ones means NaN or Inf.
_EXPONENT = {"F64": ("<u8", 0x7FF0000000000000), "F32": ("<u4", 0x7F800000), "F16": ("<u2", 0x7C00),
             "BF16": ("<u2", 0x7F80)}


def nonfinite_count(entry: Entry) -> int | None:
    """NaN/Inf values in a safetensors tensor, from its bits (no torch); None for other dtypes."""
    if entry.dtype not in _EXPONENT:
        return None if entry.dtype.startswith("F8") else 0
    import numpy as np

    kind, mask = _EXPONENT[entry.dtype]
    bits = np.fromfile(entry.file, dtype=kind, count=entry.nbytes // np.dtype(kind).itemsize, offset=entry.start)
    return int(np.count_nonzero((bits & mask) == mask))


class CheckpointReader:
    """The weights of a checkpoint directory, by name, without loading them.

    Layouts: ``model.safetensors``, sharded safetensors (``model.safetensors.index.json``),
    and legacy ``pytorch_model.bin`` (single or sharded). Safetensors is preferred when a
    directory has both.
    """

    def __init__(self, directory: Path):
        self.dir = directory
        if (directory / SAFE_INDEX).is_file():
            self.format, self.files = "safetensors", self._index_files(SAFE_INDEX)
        elif (directory / SAFE_SINGLE).is_file():
            self.format, self.files = "safetensors", [directory / SAFE_SINGLE]
        elif (directory / BIN_INDEX).is_file():
            self.format, self.files = "bin", self._index_files(BIN_INDEX)
        elif (directory / BIN_SINGLE).is_file():
            self.format, self.files = "bin", [directory / BIN_SINGLE]
        else:
            raise SourceError(
                f"No weights in {directory}: expected {SAFE_SINGLE}, {SAFE_INDEX}, {BIN_SINGLE} or {BIN_INDEX}."
            )
        self.sharded = len(self.files) > 1 or self.files[0].name not in (SAFE_SINGLE, BIN_SINGLE)
        self.metadata: dict[Path, dict[str, str]] = {}
        self.entries: dict[str, Entry] = {}
        self._bin_cache: tuple[Path, Mapping[str, torch.Tensor]] | None = None
        for path in self.files:
            for entry in self._scan(path):
                if entry.name in self.entries:
                    raise CorruptCheckpointError(f"Tensor {entry.name!r} appears in two shards of {directory}.")
                self.entries[entry.name] = entry

    def _index_files(self, index_name: str) -> list[Path]:
        try:
            weight_map = json.loads((self.dir / index_name).read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CorruptCheckpointError(f"{self.dir / index_name} is not a valid index ({exc}).") from None
        files = [self.dir / f for f in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise SourceError(f"Shards listed in {index_name} are missing: {', '.join(missing)}.")
        return files

    def _scan(self, path: Path) -> list[Entry]:
        if self.format == "safetensors":
            entries, self.metadata[path] = read_header(path)
            return entries
        state = self._load_bin(path)
        return [Entry(name, path, dtype_code(t.dtype), tuple(t.shape)) for name, t in state.items()]

    def _load_bin(self, path: Path) -> Mapping[str, torch.Tensor]:
        # Keep at most one shard open (memory-mapped).
        if self._bin_cache is None or self._bin_cache[0] != path:
            import torch

            self._bin_cache = None
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as exc:
                raise CorruptCheckpointError(
                    f"{path} could not be read as a PyTorch state dict ({exc}); re-download or re-save it."
                ) from None
            if not isinstance(state, Mapping) or not all(isinstance(t, torch.Tensor) for t in state.values()):
                raise CorruptCheckpointError(f"{path} does not hold a flat state dict of tensors.")
            self._bin_cache = (path, state)
        return self._bin_cache[1]

    def names(self) -> frozenset[str]:
        return frozenset(self.entries)

    def get(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        if self.format == "safetensors":
            return read_tensor(entry)
        return self._load_bin(entry.file)[name]

    def by_file(self) -> Iterator[tuple[Path, list[Entry]]]:
        for path in self.files:
            yield path, [e for e in self.entries.values() if e.file == path]

    def close(self) -> None:
        self._bin_cache = None

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())


# ------------------------------------------------------------------------------ writing


def _copy_range(src_fd: int, dst, start: int, count: int, progress: Progress | None) -> None:
    """Copy ``count`` bytes from ``src_fd`` at ``start`` to the current end of ``dst``."""
    dst.flush()
    dst_fd = dst.fileno()
    offset = start
    while count > 0:
        step = min(count, CHUNK)
        try:
            done = os.copy_file_range(src_fd, dst_fd, step, offset)
        except OSError:
            done = 0
        if done <= 0:  # not supported here (or across filesystems): plain copy
            done = len(chunk := os.pread(src_fd, step, offset))
            if done == 0:
                raise CorruptCheckpointError("A weights file ended before its header said it would.")
            os.write(dst_fd, chunk)
        offset += done
        count -= done
        if progress:
            progress(done)


def copy_file(src: Path, dst: Path, *, link: bool = False, progress: Progress | None = None) -> None:
    """Copy a whole file with the kernel's copy (a reflink where the filesystem has one), or hard-link it."""
    if link:
        try:
            os.link(src, dst)
            if progress:
                progress(src.stat().st_size)
            return
        except OSError:
            pass  # another filesystem: fall back to a copy
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        _copy_range(fin.fileno(), fout, 0, os.fstat(fin.fileno()).st_size, progress)
    shutil.copystat(src, dst)


ByteRanges = tuple[tuple[Path, int, int], ...]  # (file, start, end) pieces, copied in order
Source = Callable[[], "torch.Tensor"] | ByteRanges | None


def write_safetensors(
    path: Path,
    items: list[tuple[Entry, Source]],
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
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for entry, _ in items:
        header[entry.name] = {"dtype": entry.dtype, "shape": list(entry.shape), "data_offsets": [offset, offset + entry.nbytes]}
        offset += entry.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    source: tuple[Path, int] | None = None  # keep one source file open at a time
    run: tuple[Path, int, int] | None = None  # adjacent source bytes, copied in one go

    def flush_run(out) -> None:
        nonlocal source, run
        if run is None:
            return
        path, start, end = run
        if source is None or source[0] != path:
            if source is not None:
                os.close(source[1])
            source = (path, os.open(path, os.O_RDONLY))
        _copy_range(source[1], out, start, end - start, progress)
        run = None

    try:
        with open(path, "wb") as out:
            out.write(struct.pack("<Q", len(blob)) + blob)
            for entry, make in items:
                if not callable(make):
                    pieces = ((entry.file, entry.start, entry.end),) if make is None else make
                    if sum(end - start for _, start, end in pieces) != entry.nbytes:
                        raise RuntimeError(f"{entry.name}: byte ranges do not add up to {entry.nbytes} bytes")
                    for file, start, end in pieces:
                        if run is not None and run[0] == file and run[2] == start:
                            run = (file, run[1], end)
                        else:
                            flush_run(out)
                            run = (file, start, end)
                    continue
                flush_run(out)
                tensor = make()
                if dtype_code(tensor.dtype) != entry.dtype or tuple(tensor.shape) != entry.shape:
                    raise RuntimeError(f"{entry.name}: produced {tensor.dtype} {tuple(tensor.shape)}, declared {entry.dtype} {entry.shape}")
                import torch

                data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                out.write(memoryview(data.numpy()))
                if progress:
                    progress(data.numel())
            flush_run(out)
    finally:
        if source is not None:
            os.close(source[1])


# --------------------------------------------------------------------- atomic output


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_temps(dst: Path) -> None:
    """Remove temporary directories left beside ``dst`` by runs that died (kill -9, power loss)."""
    for path in dst.parent.glob(f".{dst.name}.posextend-*"):
        try:
            pid = int(path.name.rsplit("-", 2)[-2])
        except (ValueError, IndexError):
            continue
        if path.is_dir() and not _pid_alive(pid):
            shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def atomic_output(dst: Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory beside ``dst``; rename it to ``dst`` only on success.

    On any exception (Ctrl-C included) the temporary directory is removed and ``dst``
    is left as it was.
    """
    dst.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(dst)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.posextend-{os.getpid()}-", dir=dst.parent))
    try:
        yield tmp
        if dst.exists() or dst.is_symlink():
            if not overwrite:
                raise DestinationError(f"{dst} appeared while writing; nothing was changed there.")
            old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.posextend-{os.getpid()}-", dir=dst.parent))
            os.rename(dst, old / "old")
            os.rename(tmp, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
