"""The ``posextend`` command line's typer app: its commands, their options and help.

Library errors become one red line and exit code 1. This module holds the app and the commands that resize
and inspect (``resize-model``, ``inspect``, ``strategies``, ``families``); :mod:`posextend.commands.training`
adds the fine-tune's (``finetune``, ``eval``), imported only where a command line may name them
(:mod:`posextend.cli`), since they import the fine-tune. What every command does around its work (errors,
logging, the consoles, resize-model's work) is :mod:`posextend.shell`'s.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from posextend import shell
from posextend.options import with_options as with_cli_options
from posextend.resize.options import REVISION_HELP, ResizeOptions
from posextend.terminal import App, Group

app = App(
    name="posextend",
    cls=Group,
    help="Extend the learned position table of GPT-2/BERT-style checkpoints to a longer context.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = shell.console()
err_console = shell.err_console()
F = TypeVar("F", bound=Callable[..., Any])


def handle_errors(fn: F) -> F:
    """Turn PosExtendError (and any stray OSError) into one red line on stderr and exit 1 (traceback with --debug);
    an interrupt into a line saying nothing was written, and exit 130 (:func:`posextend.shell.failure`)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except shell.FAILURES as exc:
            code = shell.failure(exc)
            if code is None:
                raise
            raise typer.Exit(code) from None

    return wrapper  # type: ignore[return-value]


def with_options(cls: type, command: str) -> Callable[[F], F]:
    """The command's ``options`` parameter becomes the options of ``cls`` that ``command`` shows, generated from
    its fields (:func:`posextend.options.with_options`); the command receives their values as one dict (as the
    command line gives them: the command reads an option whose ``cli_type`` is not the field's)."""
    return with_cli_options(cls, command, lambda o: typer.Option(*o.flags, help=o.help, metavar=o.metavar,
                                                                 rich_help_panel=o.panel))


def _version(value: bool) -> None:
    if value:
        print(shell.version_line())
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks on errors.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log what the library does.")] = False,
) -> None:
    """Extend learned absolute position tables (GPT-2, BERT and relatives)."""
    shell.setup_logging(debug=debug, verbose=verbose)


@app.command("resize-model")
@handle_errors
@with_options(ResizeOptions, "resize-model")
def resize_model(
    src: Annotated[str, typer.Argument(help="Checkpoint directory, or a Hugging Face Hub id (downloaded into the HF cache).")],
    dst: Annotated[Path, typer.Argument(help="Output directory; created atomically.")],
    options: dict[str, Any],
) -> None:
    """Resize the position table(s) of a checkpoint on disk, without loading the model."""
    shell.resize_model(src, dst, options)


@app.command("inspect")
@handle_errors
def inspect_cmd(
    src: Annotated[str, typer.Argument(help="Checkpoint directory, or a Hugging Face Hub id (downloaded into the HF cache).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write diagnostics of the table (PNGs, analysis.json) to this directory.")] = None,
    compare: Annotated[str | None, typer.Option("--compare", help="Another checkpoint to compare the table with (e.g. the original).")] = None,
    table: Annotated[str | None, typer.Option("--table", help="Which tables --plot/--compare analyse, for a model with several lengths (default: the first).")] = None,
    revision: Annotated[str | None, typer.Option("--revision", help=REVISION_HELP)] = None,
) -> None:
    """Show where a checkpoint keeps its positions and how long its context is."""
    from rich.table import Table

    from posextend.files.checkpoint import Checkpoint
    from posextend.resize.inspection import inspect_checkpoint

    checkpoint = Checkpoint.resolve(src, revision=revision)  # resolved once: the diagnostics read the same one
    info = inspect_checkpoint(checkpoint)
    if (plot or compare) and table is None and len(info.groups) > 1:
        table = info.groups[0].group
        err_console.print(f"diagnostics of the {table} table (--table chooses another)", highlight=False)
    analysis = _diagnostics(src, compare, plot, table, checkpoint) if plot or compare else None
    if as_json:
        print(json.dumps({**info.to_dict(), **({"analysis": analysis} if analysis else {})}, indent=2))
        return
    covered = "written spec" if info.covered_by == "spec" else "observed on a twin (no written spec)"
    names = (f"bare ({info.layout_class}'s names: the base model's own, as sentence-transformers saves them)"
             if info.layout == "bare" else
             f"headed ({info.layout_class}'s names: under the base model's prefix, as a model with a head saves them)")
    console.print(
        f"[bold]{info.path}[/]\n"
        + (f"  sentence-transformers Transformer module in {info.transformer_dir}/\n" if info.transformer_dir else "")
        + f"  model type {info.model_type} ({covered}), "
        f"{', '.join(info.architectures) or 'no architectures listed'}\n"
        f"  weights: {info.weights_format}, {len(info.weight_files)} file(s), {names}\n"
        + "".join(_group_line(g, len(info.groups) > 1) for g in info.groups)
        + f"  tokenizer model_max_length: {info.tokenizer_max_length if info.tokenizer_max_length is not None else 'no tokenizer_config.json'}"
        + (f"\n  sentence-transformers max_seq_length: {info.st_max_seq_length}" if info.st_max_seq_length is not None else ""),
        highlight=False,
    )
    from rich.table import Column

    longest = max((len(t.name) for g in info.groups for t in g.tables), default=5)
    table = Table(*(["group"] if len(info.groups) > 1 else []), Column("table", min_width=longest, no_wrap=True),
                  "rows", "dim", "dtype")
    for g in info.groups:
        for t in g.tables:
            table.add_row(*([g.group] if len(info.groups) > 1 else []), t.name, str(t.rows), str(t.dim), t.dtype)
    console.print(table)
    if info.buffers:
        shown = info.buffers[0] if len(info.buffers) == 1 else f"{len(info.buffers)} ({info.buffers[0]}, ...)"
        console.print(f"  buffers sized by the length (rebuilt by a resize): {shown}", highlight=False)
    if analysis:
        stats = Table("diagnostic", *analysis)
        rows = {
            "positions": "length", "components for 90% variance": "components_90",
            "components for 99% variance": "components_99", "cosine similarity at distance 1": "similarity_at_1",
            "row norm: mean": "norm_mean", "row norm: first": "norm_first", "row norm: last": "norm_last",
        }
        for label, key in rows.items():
            stats.add_row(label, *(_fmt(a[key]) for a in analysis.values()))
        console.print(stats)
        if plot:
            console.print(f"  diagnostics written to {plot}/ (analysis.json and PNGs)", highlight=False)


def _group_line(g: Any, named: bool) -> str:
    """One line of ``inspect`` per group: positions, or an image grid with its patch and prefix tokens."""
    config = ", ".join(f"{k}={v}" for k, v in g.config_lengths.items())
    head = f"  {g.group + ': ' if named else ''}"
    if g.patch_size:
        return (f"{head}image grid: [bold]{'x'.join(map(str, g.grid))}[/] patches of "
                f"{'x'.join(map(str, g.patch_size))} px, prefix tokens: {g.reserved}, config: {config}\n")
    reserved = f", reserved rows: {g.reserved} (before position 0: padding or offset rows)" if g.reserved else ""
    return f"{head}usable positions: [bold]{g.usable}[/]{reserved}, config: {config}\n"


def _fmt(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _diagnostics(src: str, compare: str | None, out: Path | None, table: str | None, checkpoint: Any
                 ) -> dict[str, dict[str, Any]]:
    """``inspect --plot/--compare``: ``src`` (resolved: ``checkpoint``) and ``compare``, labelled by folder name."""
    from posextend.files.checkpoint import Checkpoint
    from posextend.scoring.analysis import diagnose

    names = [Path(src).name or str(src), Path(compare).name if compare else ""]
    if names[0] == names[1]:
        names = [str(src), str(compare)]
    checkpoints = {names[0]: checkpoint, **({names[1]: Checkpoint.resolve(compare)} if compare else {})}
    return diagnose(checkpoints, table, out)


@app.command("strategies")
@handle_errors
def strategies_cmd() -> None:
    """List the registered strategies (plugins included)."""
    from rich.table import Table

    from posextend.tables.strategies import CONTEXT_PARAMS, available_strategies

    table = Table("strategy", "description", "parameters", "keeps old rows", "tables")
    for s in available_strategies().values():
        params = ", ".join(  # a default that follows the table, as the strategy says it
            f"{n}={s.defaults.get(n, repr(p.default))}" for n, p in s.params.items() if n not in CONTEXT_PARAMS
        )
        kinds = ", ".join({1: "positions", 2: "image grids"}[r] for r in s.ranks)
        table.add_row(s.name, s.description, params or "-", "yes" if s.keeps_rows else "no", kinds)
    console.print(table)


@app.command("families")
@handle_errors
def families_cmd(
    query: Annotated[str | None, typer.Argument(
        metavar="QUERY", help="A model type (bert), a class name (BertModel) or a checkpoint folder; none: a summary.")] = None,
) -> None:
    """Is my model supported? How a family is covered, as the census of every model type found it."""
    from posextend.families import coverage

    if query is None:
        text = coverage.summary() + "\nAsk about one: posextend families MODEL_TYPE, CLASS or FOLDER."
    elif Path(query).is_dir():
        from posextend.files.checkpoint import Checkpoint

        text = coverage.for_config(Checkpoint.resolve(query).config, query)
    else:
        text = coverage.answer(query)
    console.print(text, highlight=False, markup=False)
