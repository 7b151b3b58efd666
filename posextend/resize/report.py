"""What a resize did: its :class:`ResizeReport` (also the provenance written into the files) and the model
card written beside the output (:func:`model_card`)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posextend.version import __version__
from posextend.files.checkpoint import Checkpoint
from posextend.tables.strategies import get_strategy
from posextend.resize.options import ResizeOptions
from posextend.resize.plan import GroupPlan
from posextend.resize.writer import Written


@dataclass
class ResizeReport:
    """What :func:`~posextend.resize.on_disk.resize_checkpoint` did. ``print(report)`` shows the summary the
    command line prints.

    Attributes:
        src: the source: the Hugging Face Hub id it was downloaded as (``src_revision``: at that commit), else
            its folder, resolved. ``dst``: the output folder.
        model_type: the config's ``model_type``.
        strategy: the strategy of the first group of tables (``strategies``: each group's, when several).
        params: the strategy's parameters.
        options: what was asked, resolved: the seed drawn when none was given (``seed`` reads it).
        old_length: usable positions before (the first group's). ``new_length``: after.
        lengths: with several groups of positions (LED's encoder and decoder), each one's ``[before, after]``.
        reserved: rows before the usable ones (RoBERTa's padding rows, OPT's offset, ViT's class token).
        tables: the tensors resized. ``buffers``: the length-dependent buffers rebuilt.
        dropped: obsolete tensors left out (a causal mask an older GPT-2 file stores).
        covered_by: ``"spec"`` (a written spec) or ``"probed"`` (observed on a twin of its config).
        verified: whether a twin of the written config had the written shapes and ran at the full new size.
        st_max_seq_length: the sentence-transformers ``max_seq_length`` written (None: not one).
        files_rewritten: weight files written with a changed tensor. ``files_copied``: copied whole.
        files_skipped: files left out: the old table in other formats (ONNX, OpenVINO, other weight files).
        bytes_written: bytes of the weight files written. ``seconds``: the time it took.
        old_image_size: image grids: ``[height, width]`` in pixels before (``new_image_size``: after).
        old_grid: image grids: ``[H, W]`` patches before (``new_grid``: after).
        transformer_dir: where the model sits in ``src`` and ``dst`` (``"0_Transformer"`` in an older
            sentence-transformers folder; ``""``: at the root).
    """

    src: str
    dst: str
    model_type: str
    strategy: str
    params: dict[str, Any]
    options: ResizeOptions  # as resolved: the seed drawn when none was given
    old_length: int
    new_length: int
    reserved: int
    tables: list[str]
    buffers: list[str]
    dropped: list[str] = field(default_factory=list)
    covered_by: str = "spec"
    verified: bool = False
    st_max_seq_length: int | None = None
    files_rewritten: list[str] = field(default_factory=list)
    files_copied: list[str] = field(default_factory=list)
    files_skipped: list[str] = field(default_factory=list)
    bytes_written: int = 0
    seconds: float = 0.0
    old_image_size: list[int] | None = None  # image grids: [height, width] in pixels
    new_image_size: list[int] | None = None
    old_grid: list[int] | None = None  # image grids: [H, W] patches
    new_grid: list[int] | None = None
    strategies: dict[str, str] = field(default_factory=dict)  # group -> strategy, when several groups
    lengths: dict[str, list[int]] = field(default_factory=dict)  # group -> [before, after], several of positions
    transformer_dir: str = ""  # where the resized model sits in src and dst ("0_Transformer" in an older ST folder)
    src_revision: str | None = None  # a hub source's commit

    @property
    def seed(self) -> int:
        """The seed the strategy was given (drawn when none was asked for)."""
        return self.options.seed

    @property
    def uses_seed(self) -> bool:
        """Whether a strategy of this resize draws random numbers (its registration says so), so the seed matters."""
        return any(get_strategy(name).random for name in {self.strategy, *self.strategies.values()})

    def __str__(self) -> str:
        """The summary ``posextend resize-model`` prints: what changed and how, then one line per fact."""
        params = ", ".join(f"{k}={v}" for k, v in self.params.items())
        lines = []
        if self.options.new_length is not None:
            lines.append(f"Resized {self.model_type} checkpoint: {self.length_change()} usable "
                         f"positions with {self.strategy}" + (f" ({params})" if params else "")
                         + (f", seed {self.seed}" if self.uses_seed else "") + f", in {self.seconds:.2f} s")
        if self.new_image_size:
            size = "x".join
            lines.append(f"Resized {self.model_type} image grid: {size(map(str, self.old_image_size))} → "
                         f"{size(map(str, self.new_image_size))} px, patches {size(map(str, self.old_grid))} → "
                         f"{size(map(str, self.new_grid))} with {list(self.strategies.values())[-1]}"
                         + (f" ({params})" if params and self.options.new_length is None else "")
                         + f", in {self.seconds:.2f} s")
        lines.append(f"  tables: {', '.join(self.tables)}")
        if self.covered_by == "probed":
            lines.append("  family observed on a twin of its config (no written spec)")
        if self.verified:
            lines.append("  verified: a twin of the written config has its shapes and runs at the full new size")
        if self.st_max_seq_length is not None:
            lines.append(f"  sentence-transformers max_seq_length: {self.st_max_seq_length}")
        if self.buffers:
            lines.append(f"  buffers rebuilt: {len(self.buffers)}")
        lines.append(f"  weights: {len(self.files_rewritten)} file(s) rewritten, {len(self.files_copied)} copied "
                     f"whole; {self.bytes_written / 2**20:.1f} MiB")
        if self.files_skipped:
            lines.append(f"  left out (the old table in other formats; export again from the output): "
                         f"{', '.join(self.files_skipped)}")
        lines.append(f"  written to {self.dst}")
        return "\n".join(lines)

    def length_change(self) -> str:
        """``512 → 1024``; with several groups of positions, each: ``encoder 48 → 96, decoder 40 → 96``."""
        if len(self.lengths) > 1:
            return ", ".join(f"{group} {old} → {new}" for group, (old, new) in self.lengths.items())
        return f"{self.old_length} → {self.new_length}"

    def record(self, written: Written) -> None:
        """Take the writer's account of the files (:class:`Written`)."""
        for f in dataclasses.fields(written):
            setattr(self, f.name, getattr(written, f.name))

    def provenance(self) -> dict[str, str]:
        """String metadata recorded in the safetensors header and index."""
        return {
            "posextend.version": __version__,
            **source_provenance(self.src, self.src_revision),
            "posextend.strategy": self.strategy,
            "posextend.params": json.dumps(self.params, sort_keys=True),
            "posextend.seed": str(self.seed),
            "posextend.old_length": str(self.old_length),
            "posextend.new_length": str(self.new_length),
            "posextend.tables": ",".join(self.tables),
            **({"posextend.old_image_size": "x".join(map(str, self.old_image_size)),
                "posextend.new_image_size": "x".join(map(str, self.new_image_size))} if self.new_image_size else {}),
            **({"posextend.strategies": json.dumps(self.strategies, sort_keys=True)} if len(self.strategies) > 1 else {}),
            **({"posextend.lengths": json.dumps(self.lengths)} if len(self.lengths) > 1 else {}),
        }


def source_provenance(src: str, revision: str | None = None) -> dict[str, str]:
    """The provenance entries that name a checkpoint's source: ``posextend.source`` (a hub id or a folder) and,
    for a hub id, ``posextend.source_revision`` (the commit; the anchor and ``eval`` look the source up at it)."""
    return {"posextend.source": src, **({"posextend.source_revision": revision} if revision else {})}


def resize_report(source: Checkpoint, dst: Path, plans: list[GroupPlan], options: ResizeOptions) -> ResizeReport:
    """The report of a resize of checkpoint ``source`` by ``plans`` (on disk, or in memory before a
    fine-tune) with ``options`` (resolved): the first group's numbers (positions before an image grid) at the top."""
    main, config = plans[0], source.config
    report = ResizeReport(
        src=source.name, src_revision=source.commit, dst=str(dst.resolve()), model_type=main.spec.model_type,
        strategy=main.strategy, params=dict(main.params), options=options, old_length=main.layout.usable,
        new_length=main.new_usable, reserved=main.layout.reserved, tables=[t for p in plans for t in p.layout.tables],
        buffers=[b for p in plans for b in p.layout.buffers], dropped=sorted({d for p in plans for d in p.layout.dropped}),
        covered_by=main.spec.covered_by, strategies={p.spec.group: p.strategy for p in plans},
        transformer_dir=source.transformer_dir,
        lengths={p.spec.group: [p.layout.usable, p.new_usable] for p in plans if not p.spec.grid},
    )
    for plan in plans:
        if plan.spec.grid:
            report.old_image_size = list(plan.spec.grid.sizes(config)[0])
            report.new_image_size = list(plan.target)
            report.old_grid, report.new_grid = list(plan.layout.grid), list(plan.new_grid)
    return report


def model_card(report: ResizeReport, original: str = "", *, trained: bool = False) -> str:
    """A short model card stating how the checkpoint was made (``trained``: after a fine-tune)."""
    text = report.new_grid is None or len(report.strategies) > 1  # the top numbers are positions, not patches
    grew = report.new_length > report.old_length and not trained and text
    strategy = get_strategy(report.strategy)
    lines = [
        "---",
        *([f"base_model: {report.src}"] if report.src_revision else []),  # the Hub's model tree links to it
        "tags:",
        "- posextend",
        "---",
        "",
        f"# Position table extended with posextend {__version__}",
        "",
        f"- Source: `{report.src}`" + (f" (revision `{report.src_revision}`)" if report.src_revision else ""),
        f"- Usable positions: {report.length_change()}"
        + (f" (plus {report.reserved} reserved rows)" if report.reserved else ""),
        *([f"- Image size: {'x'.join(map(str, report.old_image_size))} → {'x'.join(map(str, report.new_image_size))} "
           f"pixels (patch grid {'x'.join(map(str, report.old_grid))} → {'x'.join(map(str, report.new_grid))})"]
          if report.new_image_size else []),
        f"- Strategy: `{report.strategy}` — {strategy.description}",
        *([f"- Strategies by table group: {', '.join(f'{g} `{s}`' for g, s in report.strategies.items())}"]
          if len(report.strategies) > 1 else []),
        f"- Parameters: `{json.dumps(report.params, sort_keys=True)}`" + (f", seed {report.seed}" if report.uses_seed else ""),
        f"- Tables: {', '.join(f'`{t}`' for t in report.tables)}",
    ]
    if report.covered_by == "probed":
        lines.append("- Family: no written spec; tables, reserved rows and length field observed on a twin of its config")
    if report.verified:
        lines.append("- Verified: a twin built from the written config has the written shapes and runs at the full "
                     "length or image size")
    if report.st_max_seq_length is not None:
        lines.append(f"- sentence-transformers `max_seq_length`: {report.st_max_seq_length}")
    if report.transformer_dir:
        lines.append(f"- sentence-transformers Transformer module: `{report.transformer_dir}/`")
    if report.buffers:
        lines.append(f"- Length-dependent buffers rebuilt: {len(report.buffers)}")
    if report.dropped:
        lines.append(f"- Obsolete tensors left out: {len(report.dropped)} (e.g. `{report.dropped[0]}`)")
    if report.files_skipped:
        lines.append(f"- Left out: {', '.join(f'`{f}`' for f in report.files_skipped)}: the source model in other "
                     f"formats (exports such as ONNX or OpenVINO, other weight files) still has the old "
                     f"{report.old_length}-position table; export them again from this checkpoint")
    if grew:
        lines += [
            "",
            f"Positions {report.old_length}–{report.new_length - 1} have not been trained. "
            "Fine-tune briefly (`posextend finetune`) before relying on them.",
        ]
    if original.startswith("---"):  # drop the original's YAML front matter
        original = original.split("\n---", 1)[1].partition("\n")[2] if "\n---" in original[3:] else ""
    if original.strip():
        lines += ["", "## Original model card", "", original.strip()]
    return "\n".join(lines) + "\n"
