"""Atomic, durable output: a directory or a file appears whole, or not at all.

:func:`atomic_output` yields a temporary directory beside the destination, fsyncs everything
written in it and renames it into place (``renameat2``: never onto something that appeared
meanwhile, and an overwrite swaps both names at once); :func:`write_file` does the same for one
small file. Temporaries left by a run that died are cleaned up by the next one.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path

from posextend.errors import DestinationError
from posextend.files.oserrors import output_errors

log = logging.getLogger(__name__)

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
        tmp = path.with_name(f"{_temp_prefix(path)}{os.urandom(4).hex()}")  # as secrets.token_hex(4)
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
