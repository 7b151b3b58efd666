"""Options declared once: dataclass fields that carry their command-line form.

:func:`option` declares a field of an options dataclass (:class:`posextend.training.options.FinetuneConfig`,
:class:`posextend.resize.options.ResizeOptions`) with its help, its flag and the commands that show it;
:func:`cli_options` reads them back as one :class:`CliOption` per option a command shows, and
:func:`with_options` turns a command function's ``options`` parameter into those options, from which
:mod:`posextend.cli` makes its commands (as mergekit's ``add_merge_options`` does for click). So adding an
option is one field. Imports nothing from posextend, nor any command-line framework.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Annotated, Any, Literal, TypeVar, Union

F = TypeVar("F", bound=Callable[..., Any])
# a help text, or one per command ({"finetune": ..., "eval": ...})
Help = Union[str, Mapping[str, str]]


def option(default: Any = MISSING, help: Help = "", *, commands: tuple[str, ...] = (), flag: str | None = None,
           short: str | None = None, metavar: str | None = None, cli_type: Any = None) -> Any:
    """A dataclass field with its command-line form in its metadata.

    - ``help``: the text ``--help`` shows; a mapping gives each command its own text and names the
      commands that show the option (``commands`` then goes unused).
    - ``commands``: the commands that show it, for a single text (none: the option has no flag).
    - ``flag``: the long flag when it is not the name's (``--shrink`` for ``allow_shrink``, or a
      ``--verify/--no-verify`` pair); ``short``: a one-letter alias (``-n``); ``metavar``: the value's name.
    - ``cli_type``: the command line's type when it is not the field's (an image size given as text, which
      the command turns into the field's value).
    """
    metadata = {"help": help, "commands": commands, "flag": flag, "short": short, "metavar": metavar,
                "cli_type": cli_type}
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class CliOption:
    """One option of a command, as read from its field: the parameter ``name`` (the field's), its
    ``flags``, ``help``, ``default``, ``annotation`` (the command line's type) and ``metavar``."""

    name: str
    flags: tuple[str, ...]
    help: str
    default: Any
    annotation: Any
    metavar: str | None = None


def cli_options(cls: type, command: str) -> list[CliOption]:
    """The options of dataclass ``cls`` that ``command`` shows, in field order."""
    hints = typing.get_type_hints(cls)
    found = []
    for f in fields(cls):
        meta = f.metadata
        text = meta.get("help", "")
        shown = tuple(text) if isinstance(text, Mapping) else meta.get("commands", ())
        if command not in shown:
            continue
        flags = (meta["flag"] or "--" + f.name.replace("_", "-"), *((meta["short"],) if meta["short"] else ()))
        annotation = meta["cli_type"] or _cli_type(hints[f.name])
        if f.default is None and meta["cli_type"]:
            annotation = annotation | None
        found.append(CliOption(f.name, flags, text[command] if isinstance(text, Mapping) else text, f.default,
                               annotation, meta["metavar"]))
    return found


def _cli_type(hint: Any) -> Any:
    """The command line's type of a field typed ``hint``: choices (``Literal``) and alternatives
    (``str | Path``) are text; ``None`` stays allowed."""
    args = typing.get_args(hint)
    optional = typing.get_origin(hint) in (Union, types.UnionType) and type(None) in args
    kept = [a for a in args if a is not type(None)] if optional else [hint]
    base = kept[0] if len(kept) == 1 and typing.get_origin(kept[0]) is not Literal else str
    return base | None if optional else base


def with_options(cls: type, command: str, marker: Callable[[CliOption], Any]) -> Callable[[F], F]:
    """Decorator: the command function's parameter ``options`` becomes one parameter per option of ``cls``
    that ``command`` shows (its type ``Annotated`` with ``marker(option)``, the command-line framework's
    description of it, such as ``typer.Option``); the function receives their values as one dict
    ``options`` (field name -> value), ready for ``**options``."""
    generated = cli_options(cls, command)

    def decorate(fn: F) -> F:
        own = list(inspect.signature(fn, eval_str=True).parameters.values())
        at = [p.name for p in own].index("options")
        params = [inspect.Parameter(o.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=o.default,
                                    annotation=Annotated[o.annotation, marker(o)]) for o in generated]

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            options = {o.name: kwargs.pop(o.name) for o in generated}
            return fn(*args, options=options, **kwargs)

        wrapper.__signature__ = inspect.Signature([*own[:at], *params, *own[at + 1:]])  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate
