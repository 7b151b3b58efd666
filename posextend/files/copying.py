"""Byte copies between files, by the kernel: whole files, and byte ranges of a source written one after
another into an output.

Bytes never pass through Python where the kernel can copy them (``os.copy_file_range``: page cache to
page cache, or a reflink where the file system has one). Where a file system refuses it (across file
systems on older kernels, network and FUSE file systems: EXDEV, ENOSYS, EINVAL, EOPNOTSUPP) or the
platform lacks it, the rest is copied with reads and writes of :data:`BUFFER` bytes; that plain copy
also tells which side an I/O error came from.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from posextend.errors import CorruptCheckpointError
from posextend.files.oserrors import WRITE_FAULTS, reading

CHUNK = 64 * 1024 * 1024  # bytes per kernel copy (progress and cancellation come between them)
BUFFER = 1024 * 1024  # bytes per read and write where the kernel does not copy
Progress = Callable[[int], None]


def _write_all(fd: int, data: bytes | memoryview) -> None:
    """``os.write`` until every byte is written (a write may write fewer, e.g. on a filling disk)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _kernel_copy(src_fd: int, dst_fd: int, count: int, offset: int) -> int:
    """``os.copy_file_range`` of up to ``count`` bytes at ``offset``; 0 where the kernel does not copy them
    (refused, not available, or the source ends there). Errors only writing meets are raised."""
    copy = getattr(os, "copy_file_range", None)  # Linux only
    if copy is None:
        return 0
    try:
        return copy(src_fd, dst_fd, count, offset)
    except OSError as exc:
        if exc.errno in WRITE_FAULTS:
            raise
        return 0  # refused here (EXDEV, ENOSYS, EINVAL, EOPNOTSUPP) or failing: the plain copy goes on, or says why


def _plain_copy(src_fd: int, dst_fd: int, start: int, count: int, progress: Progress | None, source: Path) -> None:
    """Copy ``count`` bytes at ``start`` with reads and writes of at most :data:`BUFFER` bytes."""
    offset, end = start, start + count
    while offset < end:
        with reading(source):
            chunk = os.pread(src_fd, min(end - offset, BUFFER), offset)
        if not chunk:
            raise CorruptCheckpointError(
                f"{source} ended before its header said it would: it was truncated or changed while being read. "
                "Re-run; if it happens again, re-download or re-save it."
            )
        _write_all(dst_fd, chunk)
        offset += len(chunk)
        if progress:
            progress(len(chunk))


def _copy_range(src_fd: int, dst, start: int, count: int, progress: Progress | None, source: Path) -> None:
    """Copy ``count`` bytes from ``src_fd`` (the file ``source``) at ``start`` to the current end of ``dst``:
    by the kernel, then with a plain copy from where it stopped (see the module's docstring)."""
    dst.flush()
    dst_fd = dst.fileno()
    offset, end = start, start + count
    while offset < end:
        done = _kernel_copy(src_fd, dst_fd, min(end - offset, CHUNK), offset)
        if done <= 0:
            _plain_copy(src_fd, dst_fd, offset, end - offset, progress, source)
            return
        offset += done
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


class RangeCopier:
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

    def __enter__(self) -> RangeCopier:
        return self

    def __exit__(self, kind, *_) -> None:
        try:
            if kind is None:
                self.flush()
        finally:
            self._close()
