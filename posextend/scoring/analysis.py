"""What a position table learned: similarity, rank, and boundary effects.

Works on a tensor, a :class:`~posextend.tables.nn.LearnedPositionalEmbedding`, an ``nn.Embedding``,
a transformers model, or a checkpoint directory (reserved rows are stripped for models
and checkpoints, via the architecture spec).

Examples:
    >>> stats = analyze(table_of("gpt2-4k"))
    >>> stats.components_90, stats.similarity_by_distance[:3]
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posextend.errors import PosExtendError
from posextend.files.checkpoint import Checkpoint


def table_of(obj: Any, table: str | None = None) -> torch.Tensor:
    """The usable rows of a position table, as float32 on the CPU.

    ``table`` names the tables of a model or checkpoint with several lengths (``"decoder"``).
    """
    from posextend.tables.nn import LearnedPositionalEmbedding

    if isinstance(obj, torch.Tensor):
        rows = obj
    elif isinstance(obj, (LearnedPositionalEmbedding, nn.Embedding)):
        rows = obj.weight
    elif isinstance(obj, nn.Module) and hasattr(obj, "config"):
        from posextend.families.lookup import spec_for

        config = obj.config.to_dict()
        params = dict(obj.named_parameters())
        shapes = {n: tuple(p.shape) for n, p in params.items()}
        layout = spec_for(config, cls=type(obj), table=table).locate(shapes, config)
        rows = params[layout.tables[0]][layout.reserved :]
    elif isinstance(obj, (str, Path, Checkpoint)):
        from posextend.resize.inspection import read_position_table

        rows = read_position_table(obj, table)
    else:
        raise PosExtendError(f"Cannot find a position table in a {type(obj).__name__}.")
    if rows.dim() != 2:
        raise PosExtendError(f"A position table is 2-D, got shape {tuple(rows.shape)}.")
    return rows.detach().to("cpu", torch.float32)


def cosine_similarity_matrix(table: torch.Tensor) -> torch.Tensor:
    """``[L, L]`` cosine similarity between every pair of positions."""
    unit = torch.nn.functional.normalize(table.float(), dim=1)
    return unit @ unit.T


def similarity_by_distance(table: torch.Tensor) -> torch.Tensor:
    """Mean cosine similarity of positions ``d`` apart, for ``d = 0 .. L-1``."""
    sim = cosine_similarity_matrix(table)
    return torch.stack([torch.diagonal(sim, d).mean() for d in range(sim.shape[0])])


def singular_values(table: torch.Tensor) -> torch.Tensor:
    """Singular values of the centred table (the spectrum of its variance across positions)."""
    centred = table.float() - table.float().mean(dim=0, keepdim=True)
    return torch.linalg.svdvals(centred)


def components_for(table: torch.Tensor, fraction: float) -> int:
    """How many principal components explain ``fraction`` of the variance across positions."""
    energy = singular_values(table).pow(2)
    total = energy.sum()
    if total <= 0:
        return 0
    cumulative = energy.cumsum(0) / total
    return int((cumulative < fraction - 1e-6).sum().item()) + 1


def row_norms(table: torch.Tensor) -> torch.Tensor:
    """L2 norm of each position's row (boundary effects show at the ends)."""
    return table.float().norm(dim=1)


@dataclass(frozen=True)
class TableStats:
    length: int
    dim: int
    components_90: int
    components_99: int
    similarity_at_1: float  # mean cosine similarity of neighbouring positions
    similarity_by_distance: list[float]
    norm_mean: float
    norm_first: float
    norm_last: float
    norms: list[float]
    singular_values: list[float]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def analyze(table: Any) -> TableStats:
    """All diagnostics of one table."""
    t = table_of(table)
    by_distance, norms = similarity_by_distance(t), row_norms(t)
    return TableStats(
        length=t.shape[0],
        dim=t.shape[1],
        components_90=components_for(t, 0.90),
        components_99=components_for(t, 0.99),
        similarity_at_1=float(by_distance[1]) if len(by_distance) > 1 else float("nan"),
        similarity_by_distance=by_distance.tolist(),
        norm_mean=float(norms.mean()),
        norm_first=float(norms[0]),
        norm_last=float(norms[-1]),
        norms=norms.tolist(),
        singular_values=singular_values(t).tolist(),
    )


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PosExtendError(
            "Plots need matplotlib, which is not installed: pip install 'posextend[plot]'."
        ) from None
    return plt


def plot(tables: dict[str, Any], out_dir: str | Path, *, mark: int | None = None) -> list[Path]:
    """Write PNGs comparing one or more tables (label -> table); returns the files written.

    ``similarity.png`` (heatmaps side by side), ``similarity_by_distance.png``,
    ``spectrum.png`` and ``norms.png``. ``mark`` draws a line at a position (the old length).
    """
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = {label: table_of(t) for label, t in tables.items()}
    written = []

    fig, axes = plt.subplots(1, len(data), figsize=(5 * len(data), 4.4), squeeze=False)
    for ax, (label, t) in zip(axes[0], data.items()):
        im = ax.imshow(cosine_similarity_matrix(t).numpy(), cmap="RdBu_r", vmin=-1, vmax=1)
        ax.set_title(f"{label}: cosine similarity ({t.shape[0]} positions)")
        ax.set_xlabel("position")
        ax.set_ylabel("position")
        fig.colorbar(im, ax=ax, shrink=0.8)
    written.append(_save(fig, out / "similarity.png", plt))

    curves = {
        "similarity_by_distance.png": ("distance", "mean cosine similarity", similarity_by_distance),
        "spectrum.png": ("component", "singular value (centred table)", singular_values),
        "norms.png": ("position", "row L2 norm", row_norms),
    }
    for fname, (xlabel, ylabel, fn) in curves.items():
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, t in data.items():
            ax.plot(fn(t).numpy(), label=label, linewidth=1)
        if fname == "spectrum.png":
            ax.set_yscale("log")
        if mark is not None and fname != "spectrum.png":
            ax.axvline(mark, color="grey", linestyle="--", linewidth=1, label=f"old length {mark}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.legend()
        written.append(_save(fig, out / fname, plt))
    return written


def grid_similarity(grid: torch.Tensor, refs: list[tuple[int, int]]) -> torch.Tensor:
    """``[len(refs), H, W]``: cosine similarity of every patch of ``grid [H, W, D]`` to each reference patch."""
    unit = torch.nn.functional.normalize(grid.float(), dim=-1)
    return torch.stack([unit @ unit[i, j] for i, j in refs])


def reference_patches(h: int, w: int) -> list[tuple[int, int]]:
    """A few patches to compare against: the corners, the centre, and the middle of the left and top edges."""
    refs = [(0, 0), (0, w - 1), (h // 2, w // 2), (h // 2, 0), (0, w // 2), (h - 1, 0), (h - 1, w - 1)]
    return list(dict.fromkeys(refs))


def plot_grid(grids: dict[str, torch.Tensor], out_dir: str | Path) -> Path:
    """``grid_similarity.png``: for each image grid (label -> ``[H, W, D]``, one row each), the
    similarity of every patch position to a few reference patches, laid out on the grid (the
    familiar ViT figure: a good table shows a bright blob around each reference)."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    first = next(iter(grids.values()))
    n = len(reference_patches(*first.shape[:2]))
    fig, axes = plt.subplots(len(grids), n, figsize=(2.2 * n, 2.4 * len(grids)), squeeze=False)
    for row, (label, grid) in zip(axes, grids.items()):
        h, w = grid.shape[:2]
        refs = reference_patches(h, w)
        for ax, (i, j), sim in zip(row, refs, grid_similarity(grid, refs)):
            ax.imshow(sim.numpy(), cmap="viridis", vmin=-1, vmax=1)
            ax.plot(j, i, "r+", markersize=8)
            ax.set_title(f"{label}: ({i}, {j})", fontsize=7)
            ax.set_xticks([])
            ax.set_yticks([])
    fig.suptitle("cosine similarity of each patch position to the marked one")
    return _save(fig, out / "grid_similarity.png", plt)


def _save(fig, path: Path, plt) -> Path:
    """Write ``fig`` to ``path`` whole or not at all (OS errors as a DestinationError naming it)."""
    import io

    from posextend.files.atomic import write_file

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format=Path(path).suffix.lstrip(".") or "png", dpi=110)
    plt.close(fig)
    return write_file(path, buf.getvalue())


def diagnose(checkpoints: dict[str, Checkpoint], table: str | None = None, out: Path | None = None
             ) -> dict[str, dict[str, Any]]:
    """What each labelled checkpoint's table learned (:func:`analyze`, by label); with ``out``, also
    ``analysis.json`` and the plots (:func:`plot`; image grids: :func:`plot_grid`) written there."""
    tables = {label: table_of(c, table) for label, c in checkpoints.items()}
    analysis = {label: analyze(t).to_dict() for label, t in tables.items()}
    if out:
        from posextend.files.atomic import write_file
        from posextend.files.oserrors import output_errors
        from posextend.resize.inspection import read_position_table

        write_file(out / "analysis.json", json.dumps(analysis, indent=2))
        lengths = [t.shape[0] for t in tables.values()]
        grids = {label: read_position_table(c, table, grid=True) for label, c in checkpoints.items()}
        with output_errors(out):
            plot(tables, out, mark=min(lengths) if len(set(lengths)) > 1 else None)
            if all(g.dim() == 3 for g in grids.values()):  # image grids: similarity to reference patches on the grid
                plot_grid({k: g.float() for k, g in grids.items()}, out)
    return analysis
