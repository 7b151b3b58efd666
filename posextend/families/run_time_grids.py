"""Grids a family adapts to each image on every forward, observed: nothing on disk to resize.

A tiny twin (image and patch sizes kept) that holds a table shaped as a grid which no image-size field sizes,
runs on two images of different sizes (as pixels, or as patch sequences with their grid: Qwen-VL's
``grid_thw``) and uses the table there, shows that the family adapts that one learned grid to each image
(:func:`adapted_per_image`); :mod:`posextend.families.grid_probe` then refuses it with
:class:`~posextend.errors.RunTimeGridError`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from posextend.errors import UnsupportedArchitectureError
from posextend.families import configs, twin, twin_runs
from posextend.families.grid_fields import STEP, image_fields
from posextend.families.specs import GridSpec

if TYPE_CHECKING:
    import torch
    from torch import nn

PATCH_GRIDS = ((12, 12), (24, 24))  # patch grids of the two images a tower fed patch sequences gets


def adapted_per_image(config: dict[str, Any], cls: type, failures: list[str], *, pixels: bool = True) -> str | None:
    """What shows that the family uses one learned grid at any image size, or None: a tiny twin (image
    and patch sizes kept) holds a table shaped as a grid that no image-size field sizes, runs on two images
    of different sizes with finite outputs (as pixels, or as patch sequences with their grid: Qwen-VL's
    ``grid_thw``), and uses the table there (zeroing it changes the output). ``pixels=False``: patch
    sequences only (a grid an image size sizes, refused for a reason of its own when fed pixels). Appends
    to ``failures`` why a run failed."""
    for widths in (True, False):
        try:
            small = configs.shrink(config, widths=widths)
            model = twin.build(small, cls=cls)
        except UnsupportedArchitectureError:
            return None
        except Exception:  # a foreign constructor: try a milder shrink
            continue
        tables = [n for n, p in twin.absolute_position_tables(model) if twin.is_grid_shape(tuple(p.shape))]
        if not tables:
            return None
        for runs in (_ImageRuns(small if pixels else {}, model, tables), _PatchRuns(model, tables)):
            if not runs.sizes:
                continue
            try:
                return _used_at_both(model, tables[0], runs)
            except UnsupportedArchitectureError:
                return None
            except Exception as exc:  # a foreign forward: the other input form, or a milder shrink
                failures.append(f"a tiny twin does not run on {runs.label()} ({str(exc)[:300]})")
    return None


class _ImageRuns:
    """Runs of a twin on images of its own size and of two patches more a side, as pixels."""

    def __init__(self, small: dict[str, Any], model: nn.Module, tables: list[str]):
        fields = image_fields(small)
        self.model, self.tables, self.channels, self.sizes = model, tables, twin_runs.num_channels(small), []
        if fields:
            (h, w), (ph, pw) = GridSpec(*fields[0]).sizes(small)
            self.sizes = [(h, w), (h + STEP * ph, w + STEP * pw)]

    def __call__(self, size: tuple[int, int]) -> torch.Tensor:
        return twin_runs.run_pixels(self.model, self.tables, size, self.channels, resampling=True)

    def label(self) -> str:
        (a, b), (c, d) = self.sizes
        return f"{a}x{b} and {c}x{d} images"


class _PatchRuns:
    """Runs of a twin on two images given as patch sequences with their grids (:func:`.twin_runs.run_patches`),
    each in the module and layout the first one ran in."""

    def __init__(self, model: nn.Module, tables: list[str]):
        self.model, self.tables, self.sizes, self.where = model, tables, list(PATCH_GRIDS), None

    def __call__(self, grid: tuple[int, int]) -> torch.Tensor:
        out, self.where = twin_runs.run_patches(self.model, self.tables, grid, self.where)
        return out

    def label(self) -> str:
        (a, b), (c, d) = self.sizes
        if self.where is None:
            return f"images of {a}x{b} and {c}x{d} patches given as patch sequences with their grid"
        module = self.where[0] or type(self.model).__name__
        return f"images of {a}x{b} and {c}x{d} patches (given to {module} as patch sequences with their grid),"


def _used_at_both(model: nn.Module, table: str, runs: _ImageRuns | _PatchRuns) -> str | None:
    """What a twin showed when ``runs`` fed it both sizes with ``table`` made random, then zeroed at the
    second; None when an output is not finite or zeroing changed nothing (the table is not used)."""
    import torch

    param = dict(model.named_parameters())[table]
    with torch.no_grad():  # some families start their table at zeros: make it matter
        param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(0)))
    outs = [runs(size) for size in runs.sizes]
    with torch.no_grad():
        kept = param.detach().clone()
        param.zero_()
        try:
            zeroed = runs(runs.sizes[1])
        finally:
            param.copy_(kept)
    if not all(torch.isfinite(o).all() for o in outs) or torch.equal(zeroed, outs[1]):
        return None
    return (f"a tiny twin ran on {runs.label()} with one table {table} {list(param.shape)}, which no image-size "
            "field changes, and used it")

