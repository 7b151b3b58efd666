"""Byte copies between files, by the kernel (``os.copy_file_range``, a reflink where the file system
has one), falling back to a plain copy where a file system refuses it: whole files, and byte ranges
of a source written one after another into an output.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from posextend.errors import CorruptCheckpointError
from posextend.files.oserrors import WRITE_FAULTS, reading

CHUNK = 64 * 1024 * 1024
Progress = Callable[[int], None]


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
            if exc.errno in WRITE_FAULTS:
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
