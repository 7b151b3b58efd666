"""What the command line shows around its commands' results: help as users read it, and progress bars that leave
nothing behind them.

- :class:`App` makes every command a :class:`Command`, whose ``--help`` names arguments in capitals (usage
  ``SRC DST``), shows flags without a value and names option values plainly (``N``, ``PATH``: see
  :func:`posextend.options.metavar`), not as Python types; where a command's options name panels (typer's
  ``rich_help_panel``, declared in :func:`posextend.options.option`), the options that name none come last under
  :data:`posextend.options.DEFAULT_PANEL`.
- :func:`progress_bar` and :func:`without_library_bars`: the command's own bars on a terminal only, and none of
  transformers' while it loads a model, so that an error is one line with nothing before it.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import typer
from rich.console import Console

from posextend.options import DEFAULT_PANEL, metavar

F = TypeVar("F", bound=Callable[..., Any])


class _Argument(typer.core.TyperArgument):
    """An argument shown by its name alone (``SRC``), as click shows arguments: no type beside it."""

    def display_type_rich(self, ctx: Any) -> str | None:
        return None


class _PlainHelp:
    """Help as users read it, for a command or the app (mixed into typer's classes)."""

    def get_params(self, ctx: Any) -> list[Any]:
        params = super().get_params(ctx)  # type: ignore[misc]
        declared = inspect.signature(self.callback, eval_str=True).parameters if self.callback else {}  # type: ignore[attr-defined]
        for param in params:
            if isinstance(param, typer.core.TyperArgument):
                param.metavar, param.__class__ = param.metavar or param.name.upper(), _Argument
            elif param.metavar is None:  # a value named by the option's type; "" for a flag (--help too)
                param.metavar = "" if param.is_flag else metavar(declared[param.name].annotation)
        if not any(p.rich_help_panel for p in params):
            return params
        for param in params:
            if not isinstance(param, typer.core.TyperArgument):
                param.rich_help_panel = param.rich_help_panel or DEFAULT_PANEL
        return sorted(params, key=lambda p: p.rich_help_panel == DEFAULT_PANEL)  # stable: the rest keep their order


class Command(_PlainHelp, typer.core.TyperCommand):
    """A command whose help reads plainly (see the module)."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        """``[OPTIONS] SRC DST``: a required argument by its name, an optional one in brackets."""
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if isinstance(param, typer.core.TyperArgument):
                name = param.metavar + ("..." if param.nargs != 1 else "")
                pieces.append(name if param.required else f"[{name}]")
        return pieces


class Group(_PlainHelp, typer.core.TyperGroup):
    """The app's own options (``--version``, ``--debug``) read plainly too."""


class App(typer.Typer):
    """A typer app whose commands are :class:`Command` unless they name their own class."""

    def command(self, *args: Any, cls: type | None = None, **kwargs: Any) -> Callable[[F], F]:
        return super().command(*args, cls=cls or Command, **kwargs)


def progress_bar(console: Console, *columns: Any, disable: bool = False) -> Any:
    """A rich progress bar on ``console``, gone when done; none where the console is no terminal (a log shows no
    bar, and rich would leave an empty line in its place, before an error's line)."""
    from rich.progress import Progress

    return Progress(*columns, console=console, transient=True, disable=disable or not console.is_interactive)


@contextlib.contextmanager
def without_library_bars() -> Iterator[None]:
    """transformers' own progress bars (its "Loading weights") off while a command loads models: the command shows
    its progress, and nothing stands before an error's line. Hub downloads keep theirs. Restored after."""
    import huggingface_hub.utils as hub
    from transformers.utils import logging as hf_logging

    shown, hub_hidden = hf_logging.is_progress_bar_enabled(), hub.are_progress_bars_disabled()
    hf_logging.disable_progress_bar()  # transformers' and the hub's
    if not hub_hidden:
        hub.enable_progress_bars()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()  # the hub's too
        if hub_hidden:
            hub.disable_progress_bars()
