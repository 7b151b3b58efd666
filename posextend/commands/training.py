"""The fine-tune's commands (``finetune``, ``eval``), added to the app of :mod:`posextend.commands` when
imported: :mod:`posextend.cli` imports this only where a command line may name them (it imports the fine-tune)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer

from posextend.commands import app, console, err_console, handle_errors, with_options
from posextend.resize.options import REVISION_HELP, parse_params
from posextend.terminal import (
    Command,
    eval_table,
    far_range_advice,
    plot_run,
    print_context_use,
    print_verdict,
    progress_bar,
    without_library_bars,
)
from posextend.training.options import DEFAULTED, EVALUATION, MOST, FinetuneConfig


class _ListsObjectives(Command):
    """A command whose ``--objective`` help ends with the registered objectives (plug-ins included), each with its help
    line, and whose ``--lr``, ``--schedule``, ``--strategy``, ``--anchor`` and ``--window-anchor`` help end with
    each one's default (:func:`~posextend.training.objectives.defaults_help`): made from the registry when the
    command runs or shows its help, since the objectives import torch."""

    def get_params(self, ctx: Any) -> list[Any]:
        params = super().get_params(ctx)
        for param in params:
            if getattr(param, "lists_objectives", False):
                continue
            if param.name == "objective":
                from posextend.training.objectives import objectives_help

                param.help, param.lists_objectives = f"{param.help}\n\n{objectives_help()}", True
            elif param.name in ("data", "eval_data"):
                from posextend.training.objectives.help import data_help

                param.help, param.lists_objectives = f"{param.help}\n\n{data_help()}", True
            elif param.name in DEFAULTED and self.name == "finetune":
                from posextend.training.objectives import defaults_help

                param.help, param.lists_objectives = f"{param.help}\n\n{defaults_help(param.name)}", True
        return params


_DATA = "The data, as each objective reads it (repeatable):"  # the kinds: from the registry (_ListsObjectives)
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

    options = {**options, "params": parse_params(options["params"]) or None}  # as resize-model reads them
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
    if report.written_step is not None and report.written_step != report.steps:
        console.print(f"  written: {report.written} weights (the held-out reading was best there)", highlight=False)
    if report.anchor_source:
        console.print(f"  anchor: held to the original model {report.anchor_source}", highlight=False)
    for note in report.notes:
        console.print(f"  {note}", highlight=False)
    print_verdict(console, report.verdict)
    if report.verdict is not None and report.held_out:
        console.print(f"  {report.held_out}", highlight=False, style="yellow" if "tail" in report.held_out else None)
    print_context_use(console, report.context_use)
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
                                          "its own span of the data, key at a random depth) or reworded (varied in a wording no default was chosen "
                                          "on, kept aside: a fine-tune's verdict never reads it).")] = "shared",
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
    print_context_use(console, report.context_use)


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
