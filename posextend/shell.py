"""What the command line does around a command's work, with no command-line framework: an error as one red line
in the CLI's own words, logging, the terminal's consoles made when first used, and ``resize-model``'s work.

Both ways into the command line share it: :mod:`posextend.cli`'s lean path (``resize-model`` and ``--version``
parsed without typer) and the typer app (:mod:`posextend.commands`). Nothing here imports typer, nor rich until
something is shown on a terminal (a progress bar, a log record, an error), nor the fine-tune.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from posextend.errors import PosExtendError
from posextend.version import __version__

STATE = {"debug": False, "fast_exit": False}  # --debug; fast_exit: run from the console script

# The library's messages name its arguments (``length=N``, ``overwrite=True``); the CLI shows its own flags.
FLAGS = {"allow_large": "--yes", "allow_same": "--allow-same", "allow_shrink": "--shrink", "data": "--data",
         "decoder_length": "--decoder-length", "init_head": "--init-head", "length": "--length", "lr": "--lr",
         "mixed_precision": "--mixed-precision", "old_length": "--old-length", "overwrite": "--overwrite",
         "resume": "--resume", "table": "--table"}


def cli_wording(message: str) -> str:
    """``message`` with each argument it names (``name=value``) written as this CLI's flag: ``table='decoder'`` as
    ``--table decoder``, a tuple (``table=('decoder', 'encoder')``) as the flag repeated."""

    def flag(match: re.Match) -> str:
        name, value = match.groups()
        if name not in FLAGS:
            return match.group(0)
        if value == "True":
            return FLAGS[name]
        values = re.findall(r"'([^']*)'", value) if value[:1] in "('" else [value]
        return " ".join(f"{FLAGS[name]} {v}" for v in values)

    return re.sub(r"\b([a-z_]+)=(\([^)]*\)|'[^']*'|[^\s,;)]*[^\s,;).])", flag, message)


# ----------------------------------------------------------------------------- consoles, errors, logging


@functools.cache
def console() -> Any:
    """The rich console of a command's results (stdout), made when first used."""
    from rich.console import Console

    return Console(soft_wrap=True)


@functools.cache
def err_console() -> Any:
    """The rich console of progress, log records and errors (stderr), made when first used."""
    from rich.console import Console

    return Console(stderr=True, soft_wrap=True)


def failure(exc: BaseException) -> int | None:
    """Show what stopped a command as one red line on stderr (a library error in the CLI's words, an OS error's
    path and reason) and give the exit code: 1, or 130 when interrupted; None with ``--debug`` (the caller
    raises it again, for the traceback)."""
    from rich.markup import escape

    if isinstance(exc, KeyboardInterrupt):
        err_console().print("[bold red]Interrupted;[/] nothing was written at the destination.")
        return 130
    if STATE["debug"]:
        return None
    message = cli_wording(str(exc)) if isinstance(exc, PosExtendError) else _os_message(exc)
    err_console().print(f"[bold red]Error:[/] {escape(message)}", highlight=False, markup=True, soft_wrap=True)
    return 1


FAILURES = (PosExtendError, OSError, KeyboardInterrupt)  # what :func:`failure` shows; anything else is a bug


def _os_message(exc: BaseException) -> str:
    """An OS error the library did not explain, as one line: the path(s) and what the system said."""
    filenames = (getattr(exc, "filename", None), getattr(exc, "filename2", None))
    paths = " -> ".join(os.fsdecode(p) for p in filenames if isinstance(p, (str, bytes)))
    reason = getattr(exc, "strerror", None) or exc
    return f"{paths}: {reason}" if paths else str(reason)


class _LazyRichHandler(logging.Handler):
    """Log records through rich's handler on :func:`err_console`, made at the first record (most commands log
    none: rich is not imported for nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.rich: logging.Handler | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.rich is None:
            from rich.logging import RichHandler

            self.rich = RichHandler(console=err_console(), show_path=False, show_time=False)
            self.rich.setFormatter(self.formatter)
        self.rich.handle(record)


def setup_logging(*, debug: bool, verbose: bool) -> None:
    """``--debug`` (tracebacks, and the library's records) and ``--verbose`` (its records), as every command has."""
    STATE["debug"] = debug
    logging.basicConfig(level=logging.INFO if verbose or debug else logging.WARNING, format="%(message)s",
                        handlers=[_LazyRichHandler()], force=True)


def exit_without_teardown() -> None:
    """End a successful file-path command now: torch's interpreter teardown costs ~0.5 s.

    Only from the console script (never under the Python API or a test runner), and only
    after every output file is closed and renamed into place.
    """
    if STATE["fast_exit"]:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(0)


def version_line() -> str:
    return f"posextend {__version__}"


# ----------------------------------------------------------------------------- resize-model


def _may_be_interactive() -> bool:
    """Whether rich could take stderr for an interactive terminal (the only place a bar is shown): it is a
    terminal, or the environment says to treat it as one. False: rich need not even be imported."""
    if os.environ.get("TTY_INTERACTIVE") == "1" or os.environ.get("TTY_COMPATIBLE") == "1" or os.environ.get(
            "FORCE_COLOR"):
        return True
    try:
        return os.environ.get("TTY_INTERACTIVE") != "0" and sys.stderr.isatty()
    except (AttributeError, ValueError):  # no stderr, or a closed one
        return False


def byte_progress(description: str) -> tuple[Any, Callable[[int, int], None]]:
    """A rich progress bar in bytes on stderr (on a terminal only); returns (progress, callback(done, total))."""
    if not _may_be_interactive():
        return contextlib.nullcontext(), lambda done, total: None
    from rich.progress import BarColumn, DownloadColumn, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    from posextend.terminal import progress_bar

    progress = progress_bar(err_console(), TextColumn("[progress.description]{task.description}"), BarColumn(),
                            DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    task = progress.add_task(description, total=None)

    def update(done: int, total: int) -> None:
        progress.update(task, completed=done, total=total)

    return progress, update


def resize_model(src: str, dst: Path, options: dict[str, Any]) -> None:
    """``posextend resize-model SRC DST``: ``options`` as the command line gives :class:`ResizeOptions`' fields (an
    image size and strategy parameters as text, the tables as a list). Prints the report; asks before writing
    a large output on a terminal."""
    from posextend.errors import InvalidLengthError, LargeOutputError
    from posextend.resize.on_disk import resize_checkpoint
    from posextend.resize.options import parse_image_size, parse_params

    options = dict(options)
    if options["new_length"] is None and options["image_size"] is None:
        raise InvalidLengthError("Give --length (positions), --image-size (image grids), or both.")
    image_size, given = parse_image_size(options.pop("image_size")), parse_params(options.pop("params"))

    def resize(**asked: Any) -> Any:
        progress, update = byte_progress("Writing")
        with progress:
            return resize_checkpoint(src, dst, image_size=image_size, progress=update, **{**options, **asked}, **given)

    try:
        report = resize()
    except LargeOutputError as exc:  # asked on a terminal; elsewhere the error says to pass --yes
        if not sys.stdin.isatty() or not _confirm(f"{exc.summary} Write it anyway?"):
            raise
        report = resize(allow_large=True)
    print(str(report))
    exit_without_teardown()


def _confirm(question: str) -> bool:
    import typer  # only when a large output is asked about, on a terminal

    return typer.confirm(question, err=True)
