"""The ``posextend`` command line. Library errors become one red line and exit code 1."""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console

from posextend.errors import PosExtendError
from posextend.options import with_options as with_cli_options
from posextend.resize.options import REVISION_HELP, ResizeOptions
from posextend.terminal import (App, Command, Group, eval_table, far_range_advice, plot_run, print_verdict, progress_bar,
                                without_library_bars)
from posextend.training.options import EVALUATION, MOST, FinetuneConfig
from posextend.version import __version__

app = App(
    name="posextend",
    cls=Group,
    help="Extend the learned position table of GPT-2/BERT-style checkpoints to a longer context.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)
_state = {"debug": False, "fast_exit": False}
F = TypeVar("F", bound=Callable[..., Any])


# The library's messages name its arguments (``length=N``, ``overwrite=True``); the CLI shows its own flags.
_FLAGS = {"allow_large": "--yes", "allow_same": "--allow-same", "allow_shrink": "--shrink", "data": "--data", "decoder_length": "--decoder-length", "init_head": "--init-head", "length": "--length", "lr": "--lr",
          "mixed_precision": "--mixed-precision", "old_length": "--old-length", "overwrite": "--overwrite",
          "resume": "--resume", "table": "--table"}


def cli_wording(message: str) -> str:
    """``message`` with each argument it names (``name=value``) written as this CLI's flag: ``table='decoder'`` as
    ``--table decoder``, a tuple (``table=('decoder', 'encoder')``) as the flag repeated."""

    def flag(match: re.Match) -> str:
        name, value = match.groups()
        if name not in _FLAGS:
            return match.group(0)
        if value == "True":
            return _FLAGS[name]
        values = re.findall(r"'([^']*)'", value) if value[:1] in "('" else [value]
        return " ".join(f"{_FLAGS[name]} {v}" for v in values)

    return re.sub(r"\b([a-z_]+)=(\([^)]*\)|'[^']*'|[^\s,;)]*[^\s,;).])", flag, message)


def handle_errors(fn: F) -> F:
    """Turn PosExtendError (and any stray OSError) into one red line on stderr and exit 1 (traceback with --debug)."""
    from rich.markup import escape

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (PosExtendError, OSError) as exc:
            if _state["debug"]:
                raise
            message = cli_wording(str(exc)) if isinstance(exc, PosExtendError) else _os_message(exc)
            err_console.print(f"[bold red]Error:[/] {escape(message)}", highlight=False, markup=True, soft_wrap=True)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            err_console.print("[bold red]Interrupted;[/] nothing was written at the destination.")
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


def _os_message(exc: OSError) -> str:
    """An OS error the library did not explain, as one line: the path(s) and what the system said."""
    paths = " -> ".join(os.fsdecode(p) for p in (exc.filename, exc.filename2) if isinstance(p, (str, bytes)))
    return f"{paths}: {exc.strerror or exc}" if paths else str(exc.strerror or exc)


def with_options(cls: type, command: str) -> Callable[[F], F]:
    """The command's ``options`` parameter becomes the options of ``cls`` that ``command`` shows, generated from
    its fields (:func:`posextend.options.with_options`); the command receives their values as one dict (as the
    command line gives them: the command reads an option whose ``cli_type`` is not the field's)."""
    return with_cli_options(cls, command, lambda o: typer.Option(*o.flags, help=o.help, metavar=o.metavar,
                                                                 rich_help_panel=o.panel))


def _exit_without_teardown() -> None:
    """End a successful file-path command now: torch's interpreter teardown costs ~0.5 s.

    Only from the console script (never under the Python API or a test runner), and only
    after every output file is closed and renamed into place.
    """
    if _state["fast_exit"]:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(0)


def _version(value: bool) -> None:
    if value:
        console.print(f"posextend {__version__}")
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
    from rich.logging import RichHandler

    _state["debug"] = debug
    logging.basicConfig(
        level=logging.INFO if verbose or debug else logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(console=err_console, show_path=False, show_time=False)],
        force=True,
    )


def byte_progress(description: str):
    """A rich progress bar in bytes; returns (progress, callback(done, total))."""
    from rich.progress import BarColumn, DownloadColumn, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    progress = progress_bar(err_console, TextColumn("[progress.description]{task.description}"), BarColumn(),
                            DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    task = progress.add_task(description, total=None)

    def update(done: int, total: int) -> None:
        progress.update(task, completed=done, total=total)

    return progress, update


@app.command("resize-model")
@handle_errors
@with_options(ResizeOptions, "resize-model")
def resize_model(
    src: Annotated[str, typer.Argument(help="Checkpoint directory, or a Hugging Face Hub id (downloaded into the HF cache).")],
    dst: Annotated[Path, typer.Argument(help="Output directory; created atomically.")],
    options: dict[str, Any],
) -> None:
    """Resize the position table(s) of a checkpoint on disk, without loading the model."""
    from posextend.errors import InvalidLengthError, LargeOutputError
    from posextend.resize.on_disk import resize_checkpoint
    from posextend.resize.options import parse_image_size, parse_params

    length = options["new_length"]
    if length is None and options["image_size"] is None:
        raise InvalidLengthError("Give --length (positions), --image-size (image grids), or both.")
    image_size, given = parse_image_size(options.pop("image_size")), parse_params(options.pop("params"))

    def resize(**asked: Any) -> Any:
        progress, update = byte_progress("Writing")
        with progress:
            return resize_checkpoint(src, dst, image_size=image_size, progress=update, **{**options, **asked}, **given)

    try:
        report = resize()
    except LargeOutputError as exc:  # asked on a terminal; elsewhere the error says to pass --yes
        if not sys.stdin.isatty() or not typer.confirm(f"{exc.summary} Write it anyway?", err=True):
            raise
        report = resize(allow_large=True)
    console.print(str(report), highlight=False, markup=False)
    _exit_without_teardown()


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
        params = ", ".join(
            f"{n}={p.default!r}" for n, p in s.params.items() if n not in CONTEXT_PARAMS
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


class _ListsObjectives(Command):
    """A command whose ``--objective`` help ends with the registered objectives (plug-ins included), each with
    its help line: listed when the command runs or shows its help, since the objectives import torch."""

    def get_params(self, ctx: Any) -> list[Any]:
        params = super().get_params(ctx)
        for param in params:
            if param.name == "objective" and not getattr(param, "lists_objectives", False):
                from posextend.training.objectives import objectives_help

                param.help, param.lists_objectives = f"{param.help}\n\n{objectives_help()}", True
        return params


_DATA = "UTF-8 text file, directory of them, or JSON Lines with a 'text' field (repeatable)."
Data = Annotated[list[Path], typer.Option("--data", "-d", help=_DATA)]


@app.command("finetune", cls=_ListsObjectives)
@handle_errors
@with_options(FinetuneConfig, "finetune")
def finetune_cmd(
    src: Annotated[str, typer.Argument(help="Original checkpoint (with --length) or one extended already: a folder or a Hugging Face Hub id.")],
    dst: Annotated[Path, typer.Argument(help="Where the fine-tuned model is written (atomically).")],
    data: Annotated[list[Path], typer.Option("--data", "-d", help=_DATA, rich_help_panel=MOST)],
    options: dict[str, Any],
    plot: Annotated[Path | None, typer.Option("--plot", help="Save perplexity vs position (before and after) as PNG.",
                                              rich_help_panel=EVALUATION)] = None,
    revision: Annotated[str | None, typer.Option("--revision", help=REVISION_HELP)] = None,
) -> None:
    """Extend (optionally) and fine-tune so the new positions learn; evaluate before and after."""
    from rich.progress import BarColumn, TextColumn, TimeRemainingColumn

    from posextend.training.loop import finetune

    main_process = os.environ.get("RANK", "0") == "0"  # under torchrun / accelerate launch: only rank 0 shows
    progress = progress_bar(
        err_console, TextColumn("[progress.description]{task.description}"), BarColumn(),
        TextColumn("{task.completed}/{task.total}"), TextColumn("loss {task.fields[loss]:.4f}  {task.fields[tps]:,.0f} tok/s"),
        TimeRemainingColumn(), disable=not main_process,
    )
    task = progress.add_task("Training", total=options["steps"] or None, loss=float("nan"), tps=0.0)
    with progress, without_library_bars():
        report = finetune(
            src, dst, data, **options, revision=revision,
            progress=lambda step, total, loss, tps: progress.update(task, completed=step, total=total, loss=loss, tps=tps),
        )
    if not report.main_process:
        return
    eval_table(console, "Held-out evaluation by position", {"before": report.before, "after": report.after})
    processes = f" on {report.processes} processes" if report.processes > 1 else ""
    console.print(
        f"[green]Fine-tuned[/] ({report.objective}, {report.train}, {report.steps} steps, lr {report.lr:g} "
        f"{report.schedule}{report.precision_note}) {report.old_length} → {report.new_length} positions: {report.tokens:,} tokens in {report.seconds:.1f} s "
        f"({report.tokens_per_second:,.0f} tok/s{processes}), written to {report.dst}",
        highlight=False,
    )
    if report.anchor_source:
        console.print(f"  anchor: held to the original model {report.anchor_source}", highlight=False)
    for note in report.notes:
        console.print(f"  {note}", highlight=False)
    print_verdict(console, report.verdict)
    if report.verdict is None:
        far_range_advice(console, report)
    if plot:
        plot_run(console, {k: v for k, v in {"before": report.before, "after": report.after}.items() if v}, report.verdict, plot)


@app.command("eval", cls=_ListsObjectives)
@handle_errors
@with_options(FinetuneConfig, "eval")
def eval_cmd(
    model: Annotated[str, typer.Argument(help="Checkpoint directory, or a Hugging Face Hub id.")],
    data: Data,
    options: dict[str, Any],
    max_sequences: Annotated[int, typer.Option(help="Evaluate at most this many sequences (0: all).")] = 64,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the report as JSON.")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Save perplexity vs position as PNG.")] = None,
    task: Annotated[str | None, typer.Option("--task", help="Embedding models: retrieval tasks built from the data, e.g. passkey,needle.")] = None,
    lengths: Annotated[str, typer.Option("--lengths", help="With --task: document lengths in tokens.")] = "256,512,1024,2048",
    documents: Annotated[int, typer.Option("--documents", help="With --task: documents (and queries) per length.")] = 50,
    mode: Annotated[str, typer.Option("--mode", help="With --task: full (read up to the model's length) or chunk (embed chunks, average).")] = "full",
    max_tokens: Annotated[int | None, typer.Option("--max-tokens", help="With --task: read at most this many tokens at once (default: the model's max_seq_length).")] = None,
    reference: Annotated[str | None, typer.Option("--reference", help="With --task: the original model, for the short-input cosine.")] = None,
    haystack: Annotated[str, typer.Option("--haystack", help="With --task: shared (LongEmbed's protocol: one haystack per length, "
                                          "keys at evenly spread depths; passkey in LongEmbed's filler) or varied (each document "
                                          "its own span of the data, key at a random depth).")] = "shared",
    revision: Annotated[str | None, typer.Option("--revision", help=REVISION_HELP)] = None,
) -> None:
    """Held-out scores by position bucket, as the objective scores a fine-tune; or, with --task, long-document retrieval."""
    from posextend.files.checkpoint import Checkpoint
    from posextend.training.evaluate import evaluate

    checkpoint = Checkpoint.resolve(model, revision=revision)  # a hub id: downloaded once, for either evaluation
    if task:
        with without_library_bars():
            _retrieval(str(checkpoint), data, task, lengths, documents, mode, max_tokens, reference, json_path, haystack)
        return
    with err_console.status("Evaluating"), without_library_bars():
        report = evaluate(checkpoint, data, **options, max_sequences=max_sequences or None, json_path=json_path,
                          plot_path=plot)
    console.print(f"{model}: {report}", highlight=False, markup=False)
    print_verdict(console, report.verdict)


def _retrieval(model: str, data: list[Path], tasks: str, lengths: str, documents: int, mode: str,
               max_tokens: int | None, reference: str | None, json_path: Path | None, haystack: str = "shared") -> None:
    from rich.table import Table

    from posextend.errors import DataError
    from posextend.scoring.retrieval import HAYSTACKS, evaluate_retrieval

    if mode not in ("full", "chunk"):
        raise DataError(f"--mode must be full or chunk, got {mode!r}.")
    if haystack not in HAYSTACKS:
        raise DataError(f"--haystack must be {' or '.join(HAYSTACKS)}, got {haystack!r}.")
    try:
        sizes = [int(x) for x in lengths.split(",")]
    except ValueError:
        raise DataError(f"--lengths must be comma-separated numbers, got {lengths!r}.") from None
    with err_console.status("Embedding documents"):
        report = evaluate_retrieval(model, data, tasks=[t.strip() for t in tasks.split(",")], lengths=sizes,
                                    n=documents, mode=mode, max_tokens=max_tokens, reference=reference, haystack=haystack)
    table = Table("task", *(f"{n} tokens" for n in sizes),
                  title=f"{model}: accuracy@1 over {documents} documents, {HAYSTACKS[haystack]} ({mode}, reads {report.max_seq_length} tokens)")
    for name, scores in report.scores.items():
        table.add_row(name, *(f"{scores[n]:.2f}" for n in sizes))
    console.print(table)
    spread = "keys spread evenly over the depth" if haystack == "shared" else "keys at random depths"
    depth = Table("task", "tokens", *(f"{q}/4" for q in range(1, 5)),
                  title=f"accuracy@1 by where the key sits (quarters of depth; {spread})")
    for name, per_length in report.depth.items():
        for n in sizes:
            depth.add_row(name, str(n), *("–" if a is None else f"{a:.2f}" for a in per_length[n]))
    console.print(depth)
    if report.short_input_cosine is not None:
        console.print(f"  short inputs: mean cosine to {reference}: {report.short_input_cosine:.4f}", highlight=False)
    if json_path:
        from posextend.files.atomic import write_file

        write_file(json_path, json.dumps(report.to_dict(), indent=2))


def run() -> None:
    """Console-script entry point."""
    _state["fast_exit"] = True
    app()


if __name__ == "__main__":
    sys.exit(run())
