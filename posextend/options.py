"""Options declared once: dataclass fields that carry their command-line form.

:func:`option` declares a field of an options dataclass (:class:`posextend.training.options.FinetuneConfig`,
:class:`posextend.resize.options.ResizeOptions`) with its help, its flag and the commands that show it;
:func:`cli_options` reads them back as one :class:`CliOption` per option a command shows, and
:func:`with_options` turns a command function's ``options`` parameter into those options, from which
:mod:`posextend.cli` makes its commands (as mergekit's ``add_merge_options`` does for click). So adding an
option is one field. Imports nothing from posextend, nor any command-line framework.

``--help`` names each option's value plainly (:func:`metavar`: ``N``, ``FLOAT``, ``PATH``, ``TEXT``; a flag takes
none), and a command whose options name panels (``panel``: a heading of ``--help`` such as "Training") shows
the options that name none last, under :data:`DEFAULT_PANEL`.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import PurePath
from typing import Annotated, Any, Literal, TypeVar, Union

F = TypeVar("F", bound=Callable[..., Any])
# a help text, or one per command ({"finetune": ..., "eval": ...}); a panel, likewise
Help = Union[str, Mapping[str, str]]
# the panel of an option that names none, in a command whose options name panels: shown last
DEFAULT_PANEL = "Advanced"


def option(default: Any = MISSING, help: Help = "", *, commands: tuple[str, ...] = (), flag: str | None = None,
           short: str | None = None, metavar: str | None = None, cli_type: Any = None, panel: Help | None = None
           ) -> Any:
    """A dataclass field with its command-line form in its metadata.

    - ``help``: the text ``--help`` shows; a mapping gives each command its own text and names the
      commands that show the option (``commands`` then goes unused).
    - ``commands``: the commands that show it, for a single text (none: the option has no flag).
    - ``flag``: the long flag when it is not the name's (``--shrink`` for ``allow_shrink``, or a
      ``--verify/--no-verify`` pair); ``short``: a one-letter alias (``-n``); ``metavar``: the value's name
      (default: :func:`metavar` of its type).
    - ``cli_type``: the command line's type when it is not the field's (an image size given as text, which
      the command turns into the field's value).
    - ``panel``: the heading ``--help`` shows it under, or one per command (``{"finetune": "Training"}``; a
      command not named shows it without). None: :data:`DEFAULT_PANEL`, where the command has panels.
    """
    metadata = {"help": help, "commands": commands, "flag": flag, "short": short, "metavar": metavar,
                "cli_type": cli_type, "panel": panel}
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class CliOption:
    """One option of a command, as read from its field: the parameter ``name`` (the field's), its
    ``flags``, ``help``, ``default``, ``annotation`` (the command line's type), ``metavar`` (its value's
    name; "" for a flag) and ``panel`` (None: as the command places options that name none)."""

    name: str
    flags: tuple[str, ...]
    help: str
    default: Any
    annotation: Any
    metavar: str | None = None
    panel: str | None = None


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
        found.append(CliOption(f.name, flags, _for(command, text) or "", f.default, annotation,
                               metavar(annotation) if meta["metavar"] is None else meta["metavar"],
                               _for(command, meta["panel"])))
    return found


def _for(command: str, value: Help | None) -> str | None:
    """What ``value`` (a text, or one per command) gives ``command``."""
    return value.get(command) if isinstance(value, Mapping) else value


def metavar(annotation: Any) -> str:
    """How ``--help`` names the value of an option typed ``annotation``: ``N`` (a whole number), ``FLOAT``,
    ``PATH``, ``TEXT``; a repeatable option's (``list[Path]``), its items' name; "" for a flag (``bool``), which
    takes no value. ``Annotated`` and ``None`` (``int | None``) are looked through."""
    if typing.get_origin(annotation) is Annotated:
        return metavar(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (Union, types.UnionType, list, tuple):
        kept = [a for a in typing.get_args(annotation) if a not in (type(None), Ellipsis)]
        return metavar(kept[0]) if len(set(kept)) == 1 else "TEXT"
    if isinstance(annotation, type):
        for kind, name in ((bool, ""), (int, "N"), (float, "FLOAT"), (PurePath, "PATH")):
            if issubclass(annotation, kind):
                return name
    return "TEXT"


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
