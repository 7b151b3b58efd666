"""Operating-system errors as one-line messages: which path, what happened, what to do.

Every writer runs inside :func:`output_errors` (:func:`posextend.files.atomic.atomic_output` and
:func:`posextend.files.atomic.write_file` do); a reader that knows its file says so with
:func:`reading`. Errors only writing meets (no space, read-only, quota, file too large) and errors on
the output become a :class:`~posextend.errors.DestinationError`, errors on a source file a
:class:`~posextend.errors.SourceError`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Iterator
from pathlib import Path

from posextend.errors import DestinationError, PosExtendError, SourceError

WRITE_FAULTS = {  # errno: what happened, what to do (only writing meets these)
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
    if code in WRITE_FAULTS:
        what, fix = WRITE_FAULTS[code]
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

    Every writer runs inside it (:func:`posextend.files.atomic.atomic_output`,
    :func:`posextend.files.atomic.write_file`). Errors only writing can
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
        if code not in WRITE_FAULTS and isinstance(name, (str, bytes)) and not _is_output(os.fsdecode(name), Path(dst)):
            raise source_error(exc, os.fsdecode(name)) from exc
        raise destination_error(exc, dst) from exc


@contextlib.contextmanager
def reading(path: str | os.PathLike) -> Iterator[None]:
    """OS errors while reading the source file ``path`` become a :class:`SourceError` naming it."""
    try:
        yield
    except OSError as exc:
        raise source_error(exc, path) from exc
