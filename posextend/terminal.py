"""What the command line shows around its commands' results: help as users read it, and progress bars that leave
nothing behind them.

- :class:`App` makes every command a :class:`Command`, whose ``--help`` names arguments in capitals (usage
  ``SRC DST``), shows flags without a value and names option values plainly (``N``, ``PATH``: see
  :func:`posextend.options.metavar`), not as Python types; where a command's options name panels (typer's
  ``rich_help_panel``, declared in :func:`posextend.options.option`), the options that name none come last under
  :data:`posextend.options.DEFAULT_PANEL`.
- :func:`progress_bar` and :func:`without_library_bars`: the command's own bars on a terminal only, and none of
  transformers' while it loads a model, so that an error is one line with nothing before it.
- :func:`eval_table`, :func:`print_verdict`, :func:`far_range_advice`, :func:`plot_run`: a fine-tune's or an
  evaluation's results: the scores by position, whether the extension is worth it, what to try next.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from pathlib import Path
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


def eval_table(console: Console, title: str, reports: dict[str, Any]) -> None:
    """Held-out scores by position bucket, a column per report (``None``: not measured): the text
    :func:`posextend.scoring.by_position.side_by_side` makes, which ``print(report)`` shows too."""
    from posextend.scoring.by_position import side_by_side

    console.print(f"{title}\n{side_by_side(reports)}", highlight=False, markup=False)


def far_range_advice(console: Console, report: Any) -> None:
    """One line when the far range is still more than 10% above the original range, with what to try."""
    from posextend.scoring.by_position import far_range_gap

    gap = report.before and report.after and far_range_gap(report.before, report.after)
    if not gap or gap[0] <= 1.10 * gap[1]:
        return
    far, original, start = gap
    if report.train != "all":
        step = "train every weight (--train all)"
    elif report.strategy is not None and report.strategy not in ("interpolate", "kps"):
        step = "start from --strategy interpolate"
    else:
        step = f"train longer (--steps {2 * report.steps})"
    console.print(f"[yellow]The far range (positions {start}–{report.after.length - 1}) is at perplexity {far:.1f}, "
                  f"{far / original - 1:.0%} above the original range's {original:.1f}:[/] {step}.", highlight=False)


def print_verdict(console: Console, verdict: Any) -> None:
    """The verdict, one line: green when the extension is worth it, yellow with what to try when not yet."""
    if verdict is None:
        return
    if verdict.worth_it:
        console.print(f"[green]{verdict.text[:1].upper()}{verdict.text[1:]}[/]", highlight=False)
        return
    hint = (verdict.advice or ("give it a larger budget (--budget)" if verdict.budget
                               else "train longer (--budget, or more --steps)"))
    if verdict.source_memorised:
        hint += " (--eval-data)"
    console.print(f"[yellow]{verdict.text[:1].upper()}{verdict.text[1:]}[/]: {hint}.", highlight=False)


def print_context_use(console: Console, probe: Any) -> None:
    """Whether a causal LM uses its new positions (a ContextUse), one line: green when it does, yellow when not."""
    if probe is None:
        return
    colour = "green" if probe.uses else "yellow"
    console.print(f"[{colour}]Context: {probe.text}[/]", highlight=False)


def plot_run(console: Console, reports: dict[str, Any], verdict: Any, path: Path) -> None:
    """The score by position; with a verdict, beside the far and original ranges along the run."""
    if verdict is not None and verdict.curve:
        from posextend.scoring.verdict import plot_verdict

        plot_verdict(verdict, path, reports)
    else:
        from posextend.scoring.by_position import plot_reports

        plot_reports(reports, path)
    console.print(f"  plot: {path}", highlight=False)
