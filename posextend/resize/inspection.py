"""What a checkpoint on disk holds, read by name without loading the model: ``posextend inspect``
(:func:`inspect_checkpoint`) and a position table's rows (:func:`read_position_table`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from posextend.files.checkpoint import Checkpoint
from posextend.files.sources import json_int
from posextend.families.lookup import all_specs, spec_for
from posextend.families.specs import table_rows as rows_of
from posextend.families.configs import get_path
from posextend.families.twin import layout_class

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TableInfo:
    name: str
    rows: int
    dim: int
    dtype: str


@dataclass(frozen=True)
class GroupInfo:
    """One position length of a model: the tables one config field sizes."""

    group: str
    tables: list[TableInfo]
    usable: int
    reserved: int
    config_lengths: dict[str, Any]
    grid: list[int] = field(default_factory=list)  # [L] for positions, [H, W] patches for an image grid
    patch_size: list[int] | None = None  # image grids: [height, width] of a patch


@dataclass(frozen=True)
class CheckpointInfo:
    """What ``posextend inspect`` reports about a checkpoint (the first group's numbers at the top)."""

    path: str
    model_type: str
    architectures: list[str]
    spec: str  # the spec's model type, or "probed" (observed on a twin)
    covered_by: str  # "spec" or "probed"
    weights_format: str
    weight_files: list[str]
    tables: list[TableInfo]
    usable: int
    reserved: int
    config_lengths: dict[str, int]
    buffers: list[str]
    tokenizer_max_length: int | None
    st_max_seq_length: int | None = None  # sentence-transformers' max_seq_length, when present
    groups: list[GroupInfo] = field(default_factory=list)
    transformer_dir: str = ""  # where the model sits in ``path``: "" at its root, "0_Transformer" in an older ST folder
    layout: str = ""  # "headed" (names under the base model's prefix) or "bare" (the base model's own names)
    layout_class: str = ""  # the transformers class whose names the weights hold (MPNetModel for a bare MPNet)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def read_position_table(src: str | Path | Checkpoint, table: str | None = None, *, grid: bool = False) -> torch.Tensor:
    """The usable rows ``[N, D]`` of a checkpoint's (first) position table, read by name only.

    ``table`` names a group (``"vision"``); ``grid=True`` gives an image grid's rows as ``[H, W, D]``.
    """
    with Checkpoint.open(src) as source:
        layout = spec_for(source.config, table=table).locate(source.shapes, source.config)
        rows = source.reader.get(layout.tables[0])
        rows = rows.reshape(rows.shape[-2], rows.shape[-1])[layout.reserved :]
        return rows.reshape(*layout.grid, rows.shape[-1]) if grid else rows


def inspect_checkpoint(src: str | Path | Checkpoint, *, revision: str | None = None) -> CheckpointInfo:
    """Describe a checkpoint's position table(s) without loading the model.

    Args:
        src: the checkpoint: a folder (transformers or sentence-transformers), a Hugging Face Hub
            id (its files downloaded into the Hugging Face cache), or a
            :class:`~posextend.files.checkpoint.Checkpoint`.
        revision: with a hub id, the branch, tag or commit (default: main).

    Returns:
        Where its tables are, their rows, the usable and reserved positions, the config fields
        and buffers that follow the length, and what its tokenizer says; one
        :class:`GroupInfo` per length (``info.groups``) for a model with several.

    Raises:
        PosExtendError: the folder is no checkpoint, or its family has no learned table (the
            message says why).

    Examples:
        >>> info = posextend.inspect_checkpoint("sentence-transformers/all-MiniLM-L6-v2")
        >>> info.usable, info.tables[0].name
        (512, 'embeddings.position_embeddings.weight')
    """
    with Checkpoint.open(src, revision=revision) as source:
        config, reader, shapes, where = source.config, source.reader, source.shapes, source.transformer_dir
        groups = []
        for spec in all_specs(config):
            layout = spec.locate(shapes, config)
            tables = [TableInfo(n, rows_of(shapes[n]), shapes[n][-1], reader.entries[n].dtype) for n in layout.tables]
            keys = (*spec.length_keys, spec.grid.patch_key) if spec.grid else spec.length_keys
            lengths = {k: v for k in keys if (v := get_path(config, k)) is not None}
            patch = list(spec.grid.sizes(config)[1]) if spec.grid else None
            groups.append((spec, layout, GroupInfo(spec.group, tables, layout.usable, layout.reserved, lengths,
                                                   list(layout.grid), patch)))
        spec, layout, first = groups[0]
        return CheckpointInfo(
            path=str(source.directory),
            model_type=config.get("model_type", ""),
            architectures=list(config.get("architectures") or []),
            spec="probed" if spec.covered_by == "probed" else spec.model_type,
            covered_by=spec.covered_by,
            weights_format=reader.format + (" (sharded)" if reader.sharded else ""),
            weight_files=[(PurePosixPath(where) / f.name).as_posix() for f in reader.files],
            tables=first.tables,
            usable=layout.usable,
            reserved=layout.reserved,
            config_lengths=first.config_lengths,
            buffers=list(layout.buffers),
            tokenizer_max_length=json_int(source.model_dir / "tokenizer_config.json", "model_max_length"),
            st_max_seq_length=json_int(source.st_config, "max_seq_length"),
            groups=[g for _, _, g in groups],
            transformer_dir=where,
            layout=layout.kind,
            layout_class=layout_class(config, frozenset(shapes))[0].__name__,
        )
