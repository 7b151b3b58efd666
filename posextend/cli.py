"""The ``posextend`` command line. Library errors become one red line and exit code 1.

The entry point: ``posextend --version`` and a ``resize-model`` command line are run lean, parsed from
:class:`~posextend.resize.options.ResizeOptions`' fields (what the typer command is generated from too) with
neither typer nor rich nor the fine-tune imported, since on a checkpoint of a few GB the start-up is a good
part of a resize. Any other command line goes to the typer app (:mod:`posextend.commands`), and so does a
``resize-model`` one the lean parser does not take as plainly given (``--help``, an unknown or repeated option,
a value typer might convert otherwise), which the app answers as ever. The app holds the fine-tune's commands
only where the command line may name one (:mod:`posextend.commands.training` imports the fine-tune).
"""

from __future__ import annotations

import re
import sys
import types
import typing
from typing import TYPE_CHECKING, Any, Union

if TYPE_CHECKING:
    from pathlib import Path

GLOBAL_FLAGS = ("--debug", "--verbose", "-v", "--version")  # the app's own options, before the command
CORE = ("resize-model", "inspect", "strategies", "families")  # the commands of posextend.commands itself
_APP_NAMES = ("app", "console", "err_console", "handle_errors", "with_options")


def run() -> None:
    """Console-script entry point."""
    argv = sys.argv[1:]
    if argv and set(argv) <= set(GLOBAL_FLAGS) and "--version" in argv:  # eager, as the app's: before all else
        from posextend.version import __version__

        print(f"posextend {__version__}")
        return
    from posextend import shell

    shell.STATE["fast_exit"] = True
    if not _lean(argv):
        typer_app(argv)()


def typer_app(argv: list[str]) -> Any:
    """The typer app that answers ``argv``: every command, but the fine-tune's where ``argv`` names another."""
    command = next((a for a in argv if a not in GLOBAL_FLAGS), None)
    if command not in CORE:
        import posextend.commands.training  # noqa: F401  (adds finetune and eval to the app)
    from posextend.commands import app

    return app


def __getattr__(name: str) -> Any:
    """The typer app's names, as this module held them (``from posextend.cli import app``: every command)."""
    if name in _APP_NAMES:
        import posextend.commands.training  # noqa: F401
        from posextend import commands

        return getattr(commands, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _lean(argv: list[str]) -> bool:
    """Run ``argv`` here when it is a plainly given ``resize-model`` command line (the app's flags first, as typer
    takes them; ``--version`` among them goes to the app, which answers before the command); False: the typer
    app answers it."""
    from posextend import shell

    at = next((i for i, a in enumerate(argv) if a not in GLOBAL_FLAGS), len(argv))
    flags = set(argv[:at])
    parsed = parse_resize(argv[at + 1:]) if argv[at:at + 1] == ["resize-model"] and "--version" not in flags else None
    if parsed is None:
        return False
    shell.setup_logging(debug="--debug" in flags, verbose=bool(flags & {"--verbose", "-v"}))
    try:
        shell.resize_model(*parsed)
    except shell.FAILURES as exc:
        code = shell.failure(exc)
        if code is None:
            raise
        sys.exit(code)
    return True


def parse_resize(args: list[str]) -> tuple[str, Path, dict[str, Any]] | None:
    """``resize-model``'s SRC, DST and options in ``args``, as the typer command receives them, where they are
    plainly given: ``--flag``, ``--option VALUE`` or ``--option=VALUE``, ``-x VALUE``, a repeatable option
    repeated, two arguments. None for anything else (``--help``, ``--``, an unknown option or one given twice,
    a value that starts with ``-``, a number that is not plain digits), which the typer app then answers."""
    from pathlib import Path

    from posextend.options import cli_options
    from posextend.resize.options import ResizeOptions

    options = cli_options(ResizeOptions, "resize-model")
    flags = {f: (o, i == 0) for o in options for flag in o.flags for i, f in enumerate(flag.split("/"))}
    values: dict[str, Any] = {o.name: o.default for o in options}
    given: set[str] = set()
    arguments: list[str] = []
    tokens = iter(args)
    for token in tokens:
        if not token.startswith("-") or token == "-":
            arguments.append(token)
            continue
        name, eq, attached = token.partition("=") if token.startswith("--") else (token, "", "")
        if name not in flags:
            return None
        option, on = flags[name]
        kind = _kind(option.annotation)
        text = None if kind == "flag" else attached if eq else next(tokens, None)
        value = (on if not eq else None) if kind == "flag" else _value(text, kind)
        if value is None or (option.name in given and kind != "list"):
            return None
        values[option.name] = [*(values[option.name] or []), value] if kind == "list" else value
        given.add(option.name)
    return (arguments[0], Path(arguments[1]), values) if len(arguments) == 2 else None


def _kind(annotation: Any) -> str:
    """``flag``, ``int``, ``str``, ``list`` (of text) or ``other`` for an option typed ``annotation`` (None aside)."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        kept = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = kept[0] if len(kept) == 1 else annotation
    if typing.get_origin(annotation) is list and typing.get_args(annotation) == (str,):
        return "list"
    return {bool: "flag", int: "int", str: "str"}.get(annotation, "other")  # type: ignore[call-overload]


def _value(text: str | None, kind: str) -> Any:
    """An option's value as typer gives it, where it is plain (None otherwise: the typer app decides)."""
    if text is None or text.startswith("-") or kind == "other":
        return None
    if kind == "int":
        return int(text) if re.fullmatch(r"[0-9]+", text) else None
    return text


if __name__ == "__main__":
    sys.exit(run())
