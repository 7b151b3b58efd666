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
import errno
import glob
import json
import logging
import math
import os
import re
import secrets
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
from typing import TYPE_CHECKING, Any

from posextend.errors import CorruptCheckpointError, DestinationError, PosExtendError, SourceError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

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


# ------------------------------------------------------------------------- OS errors

_WRITE_FAULTS = {  # errno: what happened, what to do (only writing meets these)
    errno.ENOSPC: ("no space left on the device", "Free space there or choose another directory"),
    errno.EDQUOT: ("disk quota exceeded", "Free space there (or raise the quota) or choose another directory"),
    errno.EFBIG: ("a file is too large for that file system", "Choose a directory on another file system"),
    errno.EROFS: ("the file system is read-only", "Choose another directory"),
}
_DENIED = (errno.EACCES, errno.EPERM)
_VANISHED = (errno.ENOENT, errno.ESTALE, errno.ENOTDIR, errno.ENXIO, errno.ENODEV)


def _errno_of(exc: BaseException) -> int | None:
    """``exc``'s OS error number: an OSError's, or the one a Rust library (safetensors, tokenizers) wrote in its message."""
    if isinstance(exc, OSError):
        return exc.errno
    match = re.search(r"\(os error (\d+)\)", str(exc))
    return int(match.group(1)) if match else None


def source_error(exc: BaseException, path: str | os.PathLike) -> SourceError:
    """What to tell the user when the source file ``path`` could not be read."""
    code = _errno_of(exc)
    if code in _VANISHED:
        return SourceError(f"{path} disappeared while it was being read: the source changed while reading. "
                           "Re-run once nothing else is modifying it.")
    if code in _DENIED:
        return SourceError(f"Cannot read {path}: permission denied. Check its permissions.")
    return SourceError(f"Cannot read {path}: {os.strerror(code) if code else exc}. Check the source, then re-run.")


def destination_error(exc: BaseException, dst: str | os.PathLike) -> DestinationError:
    """What to tell the user when writing the output ``dst`` failed."""
    code = _errno_of(exc)
    if code in _WRITE_FAULTS:
        what, fix = _WRITE_FAULTS[code]
        return DestinationError(f"Cannot write {dst}: {what}. {fix}.")
    name = getattr(exc, "filename", None)
    where = Path(os.fsdecode(name)).parent if isinstance(name, (str, bytes)) else Path(dst).parent
    if code in _DENIED:
        return DestinationError(f"Cannot write {dst}: permission denied in {where}. "
                                "Check its permissions or choose another directory.")
    return DestinationError(f"Cannot write {dst}: {os.strerror(code) if code else exc} (in {where}). "
                            "Check that directory or choose another one.")


def _is_output(path: str | os.PathLike, dst: Path) -> bool:
    """Whether ``path`` is ``dst``, inside it or a temporary beside it, or a directory holding it."""
    path, dst = Path(os.path.abspath(path)), Path(os.path.abspath(dst))
    if path == dst or path in dst.parents:
        return True
    try:
        first = path.relative_to(dst.parent).parts[0]
    except (ValueError, IndexError):
        return False
    return first == dst.name or first.startswith(f".{dst.name}.posextend-")


@contextlib.contextmanager
def output_errors(dst: str | os.PathLike) -> Iterator[None]:
    """Turn an OS error met while producing ``dst`` into a PosExtendError that names the path and what to do.

    Every writer runs inside it (:func:`atomic_output`, :func:`write_file`). Errors only writing can
    meet (no space, read-only, quota, file too large), and errors on ``dst``, its temporaries or its
    parents, become a :class:`DestinationError`; an error on another file (a source that vanished
    or cannot be read) a :class:`SourceError`. Readers that know their file say so with :func:`reading`.
    """
    try:
        yield
    except PosExtendError:
        raise
    except Exception as exc:
        code = _errno_of(exc)
        if code is None:
            raise
        name = getattr(exc, "filename", None)
        if code not in _WRITE_FAULTS and isinstance(name, (str, bytes)) and not _is_output(os.fsdecode(name), Path(dst)):
            raise source_error(exc, os.fsdecode(name)) from exc
        raise destination_error(exc, dst) from exc


@contextlib.contextmanager
def reading(path: str | os.PathLike) -> Iterator[None]:
    """OS errors while reading the source file ``path`` become a :class:`SourceError` naming it."""
    try:
        yield
    except OSError as exc:
        raise source_error(exc, path) from exc


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
    except OSError as exc:
        raise source_error(exc, path) from None
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
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
    with reading(entry.file), open(entry.file, "rb") as f:
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
        self.metadata: dict[Path, dict[str, str]] = {}  # each safetensors file's header metadata
        self.index_metadata: dict[str, Any] = self._index_metadata()
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

    def _index_metadata(self) -> dict[str, Any]:
        """The safetensors index's metadata (provenance an earlier write recorded), without its total size."""
        if self.format != "safetensors" or not self.sharded:
            return {}
        metadata = json.loads((self.dir / SAFE_INDEX).read_text()).get("metadata") or {}
        return {k: v for k, v in metadata.items() if k != "total_size"} if isinstance(metadata, dict) else {}

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


def _write_all(fd: int, data: bytes) -> None:
    """``os.write`` until every byte is written (a write may write fewer, e.g. on a filling disk)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _copy_range(src_fd: int, dst, start: int, count: int, progress: Progress | None, source: Path) -> None:
    """Copy ``count`` bytes from ``src_fd`` (the file ``source``) at ``start`` to the current end of ``dst``."""
    dst.flush()
    dst_fd = dst.fileno()
    offset = start
    while count > 0:
        step = min(count, CHUNK)
        try:
            done = os.copy_file_range(src_fd, dst_fd, step, offset)
        except OSError as exc:
            if exc.errno in _WRITE_FAULTS:
                raise
            done = 0
        if done <= 0:  # not supported here (or across filesystems, or failing): a plain copy tells which side failed
            with reading(source):
                done = len(chunk := os.pread(src_fd, step, offset))
            if done == 0:
                raise CorruptCheckpointError(
                    f"{source} ended before its header said it would: it was truncated or changed while being read. "
                    "Re-run; if it happens again, re-download or re-save it."
                )
            _write_all(dst_fd, chunk)
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
    with reading(src):
        fd = os.open(src, os.O_RDONLY)
    try:
        with open(dst, "wb") as fout:
            _copy_range(fd, fout, 0, os.fstat(fd).st_size, progress, src)
    finally:
        os.close(fd)
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
    blob = _header(items, metadata)
    with open(path, "wb") as out, _RangeCopier(out, progress) as copier:
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


def _header(items: list[tuple[Entry, Source]], metadata: Mapping[str, str]) -> bytes:
    """The safetensors header of ``items`` in order, padded to 8 bytes."""
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for entry, _ in items:
        header[entry.name] = {"dtype": entry.dtype, "shape": list(entry.shape), "data_offsets": [offset, offset + entry.nbytes]}
        offset += entry.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    return blob + b" " * (-len(blob) % 8)


def _write_tensor(out, entry: Entry, tensor, progress: Progress | None) -> None:
    """A computed tensor's bytes, after checking it has the dtype and shape its entry declares."""
    import torch

    if dtype_code(tensor.dtype) != entry.dtype or tuple(tensor.shape) != entry.shape:
        raise RuntimeError(f"{entry.name}: produced {tensor.dtype} {tuple(tensor.shape)}, declared {entry.dtype} {entry.shape}")
    data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    out.write(memoryview(data.numpy()))
    if progress:
        progress(data.numel())


class _RangeCopier:
    """Copies source byte ranges into ``out``, joining adjacent ones into one copy and keeping one source
    file open at a time."""

    def __init__(self, out, progress: Progress | None):
        self.out, self.progress = out, progress
        self.source: tuple[Path, int] | None = None  # the open source file
        self.run: tuple[Path, int, int] | None = None  # adjacent source bytes, not copied yet

    def add(self, file: Path, start: int, end: int) -> None:
        if self.run is not None and self.run[0] == file and self.run[2] == start:
            self.run = (file, self.run[1], end)
            return
        self.flush()
        self.run = (file, start, end)

    def flush(self) -> None:
        if self.run is None:
            return
        path, start, end = self.run
        if self.source is None or self.source[0] != path:
            self._close()
            with reading(path):
                self.source = (path, os.open(path, os.O_RDONLY))
        _copy_range(self.source[1], self.out, start, end - start, self.progress, path)
        self.run = None

    def _close(self) -> None:
        if self.source is not None:
            os.close(self.source[1])
            self.source = None

    def __enter__(self) -> _RangeCopier:
        return self

    def __exit__(self, kind, *_) -> None:
        try:
            if kind is None:
                self.flush()
        finally:
            self._close()


# --------------------------------------------------------------------- atomic output

_RENAME_NOREPLACE, _RENAME_EXCHANGE, _AT_FDCWD = 1, 2, -100  # linux/fs.h, fcntl.h


def _temp_prefix(dst: Path, kind: str = "") -> str:
    """Names beside ``dst``: ``.NAME.posextend-PID-XXXXXXXX`` (temporary output) or ``...-old-PID-...``
    (the previous output, parked during an overwrite); PID is the writer's."""
    return f".{dst.name}.posextend-{kind}{os.getpid()}-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: Path) -> None:
    """Remove a directory tree, file or link, as far as possible."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _fsync(path: str | os.PathLike, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str | os.PathLike) -> None:
    _fsync(path, os.O_RDONLY | os.O_DIRECTORY)


def _sync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every directory (``root`` last), so that once ``root`` is
    renamed into place a crash finds whole files, never empty or partial ones."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                _fsync(path)
        _fsync_dir(dirpath)


def _remove_stale_temps(dst: Path) -> bool:
    """Clean up beside ``dst`` after runs that died (kill -9, power loss); True if ``dst`` was put back.

    An old output parked by an overwrite that died between its two renames is renamed back to
    ``dst`` when ``dst`` is missing, and never deleted while it is; temporary directories go.
    """
    restored = False
    for path in dst.parent.glob(glob.escape(f".{dst.name}.posextend-") + "*"):
        try:
            pid = int(path.name.rsplit("-", 2)[-2])
        except (ValueError, IndexError):
            continue
        if not path.is_dir() or path.is_symlink() or _pid_alive(pid):
            continue
        parked = path / "old"
        if path.name.startswith(f".{dst.name}.posextend-old-") and os.path.lexists(parked):
            if os.path.lexists(dst):
                _remove(parked)
            else:
                os.rename(parked, dst)
                _fsync_dir(dst.parent)
                restored = True
                log.warning("Put %s back: an overwrite of it was interrupted before the new output was in place.", dst)
        shutil.rmtree(path, ignore_errors=True)
    return restored


@lru_cache(maxsize=1)
def _libc_renameat2() -> Callable[..., int] | None:
    """libc's ``renameat2`` (Linux, glibc 2.28+), or None."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        func = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    func.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    func.restype = ctypes.c_int
    return func


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """``renameat2(src, dst, flags)``; False where the system or file system cannot (the caller falls back)."""
    func = _libc_renameat2()
    if func is None:
        return False
    import ctypes

    if func(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(src), None, str(dst))


def _swap_in(new: Path, dst: Path) -> Path:
    """Put ``new`` at the existing ``dst``; returns where the old ``dst`` now is, for removal.

    ``renameat2(RENAME_EXCHANGE)`` swaps both names at once: ``dst`` is never missing. Where the
    file system cannot, the old ``dst`` is parked in a holder directory beside it first; if the
    process dies before the second rename, the next run puts it back (:func:`_remove_stale_temps`).
    """
    if _renameat2(new, dst, _RENAME_EXCHANGE):
        return new
    holder = Path(tempfile.mkdtemp(prefix=_temp_prefix(dst, "old-"), dir=dst.parent))
    os.rename(dst, holder / "old")
    try:
        os.rename(new, dst)
    except BaseException:
        os.rename(holder / "old", dst)
        holder.rmdir()
        raise
    return holder


def _put_in_place(tmp: Path, dst: Path, *, overwrite: bool) -> Path | None:
    """Rename the finished ``tmp`` to ``dst``; returns the old output to remove (with ``overwrite``)."""
    if os.path.lexists(dst):
        if not overwrite:
            raise DestinationError(f"{dst} appeared while writing; nothing was changed there.")
        return _swap_in(tmp, dst)
    if not _renameat2(tmp, dst, _RENAME_NOREPLACE):  # never onto something that appeared meanwhile
        os.rename(tmp, dst)
    return None


def _missing_dirs(path: Path) -> list[Path]:
    """``path`` and its ancestors that do not exist yet, deepest first."""
    missing = []
    while not os.path.lexists(path) and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _remove_dirs(dirs: list[Path]) -> None:
    """Remove the (empty) directories ``dirs``, deepest first, stopping at one that is not empty."""
    for path in dirs:
        try:
            path.rmdir()
        except OSError:
            return


@contextlib.contextmanager
def atomic_output(dst: Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory beside ``dst``; rename it to ``dst`` only on success, durably.

    On any exception (Ctrl-C included) the temporary directory, and any parent directory made for
    it, is removed and ``dst`` is left as it was. Before the rename every file and directory
    written is fsynced, and the parent after it: a crash or power cut leaves the old output or the
    new one, never neither and never empty files. With ``overwrite=True`` an existing ``dst`` is
    swapped out (see :func:`_swap_in`). OS errors become a :class:`DestinationError` (or a
    :class:`SourceError` for a source file) that names the path and what to do (:func:`output_errors`).
    """
    dst = Path(dst)
    made = _missing_dirs(dst.parent)
    with output_errors(dst):
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            if _remove_stale_temps(dst) and not overwrite:
                raise DestinationError(f"{dst} was put back from an earlier overwrite that was interrupted; "
                                       "pass overwrite=True to replace it.")
            tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(dst), dir=dst.parent))
        except BaseException:
            _remove_dirs(made)
            raise
        try:
            yield tmp
            _sync_tree(tmp)
            old = _put_in_place(tmp, dst, overwrite=overwrite)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            _remove_dirs(made)
            raise
        _fsync_dir(dst.parent)
        if old is not None:
            _remove(old)


def write_file(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write one small output file (a JSON report, a plot) whole or not at all; returns its path.

    The bytes go to a temporary file beside ``path``, fsynced and renamed over it; OS errors
    become a :class:`DestinationError` naming ``path`` and what to do, with no partial file left.
    """
    path = Path(path)
    with output_errors(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{_temp_prefix(path)}{secrets.token_hex(4)}")
        try:
            with open(tmp, "xb") as f:
                f.write(data.encode() if isinstance(data, str) else data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
    return path
