"""What one resize changes, group by group: the plan both doors (file, in memory) carry out.

A model may have a length of positions (``--length``: GPT-2, BERT, CLIP's text tower) and an
image grid (``--image-size``: ViT, CLIP's vision tower). :func:`plan_resize` picks the
group(s) to resize, checks the new sizes, and gives each its strategy: the one named when it
handles the group's grid rank, else the rank's default (``tile`` for positions, ``bicubic``
for image grids, or the family's own run-time resampling where its spec names one).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from posextend.errors import InvalidLengthError, StrategyError, UnsupportedArchitectureError
from posextend.families.lookup import spec_for
from posextend.families.specs import ArchitectureSpec, Layout
from posextend.tables.relative import resize_relative
from posextend.tables.strategies import DEFAULTS, check_params, check_rank, get_strategy, resize_grid

if TYPE_CHECKING:
    import torch

ImageSize = tuple[int, int]


def check_length(new_length: int, old_length: int, *, allow_shrink: bool) -> None:
    if not isinstance(new_length, int) or isinstance(new_length, bool) or new_length <= 0:
        raise InvalidLengthError(f"The new length must be a positive number of positions, got {new_length!r}.")
    if new_length < old_length and not allow_shrink:
        raise InvalidLengthError(
            f"The new length {new_length} is below the current {old_length}: positions from "
            f"{new_length} on would be cut. To shrink on purpose, pass allow_shrink=True."
        )


def image_size_pair(value: int | tuple[int, int] | list[int]) -> ImageSize:
    """``448`` → ``(448, 448)``; ``(448, 336)`` stays (height, width)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value, value
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return int(value[0]), int(value[1])
    raise InvalidLengthError(f"An image size is a number of pixels or (height, width), got {value!r}.")


@dataclass(frozen=True)
class GroupPlan:
    """One group of tables (one length or one image grid), its new grid and strategy."""

    spec: ArchitectureSpec
    layout: Layout
    new_grid: tuple[int, ...]
    target: int | ImageSize  # the new length, or the new image size (height, width)
    strategy: str
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def new_usable(self) -> int:
        return math.prod(self.new_grid)

    @property
    def new_rows(self) -> int:
        return self.new_usable + self.layout.reserved

    def table_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """A table's written shape: ``[rows, D]`` or ``[1, rows, D]`` with the new rows, ``[1, H, W, D]`` with the
        new grid, or a relative-position companion's ``[2 * side - 1, D]`` with the new side."""
        if len(shape) == 4:
            return (1, *self.new_grid, shape[-1])
        if self._is_relative(shape):
            return (2 * self.new_grid[0] - 1, shape[-1])
        return (*shape[:-2], self.new_rows, shape[-1])

    def _is_relative(self, shape: tuple[int, ...]) -> bool:
        """Whether a table of ``shape`` is one of the layout's relative-position companions (told apart from the
        grid's own tables by its rows; :meth:`ArchitectureSpec.locate` checked both)."""
        if not self.layout.relative or len(shape) != 2 or shape[0] != 2 * self.layout.grid[0] - 1:
            return False
        if shape[0] == self.layout.usable + self.layout.reserved:
            raise StrategyError(f"A {self.layout.grid[0]}x{self.layout.grid[1]} grid's table and its relative-position "
                                "tables have the same rows: which is which is ambiguous; nothing was changed.")
        return True

    def changes(self, config: Mapping[str, Any]) -> bool:
        """Whether the plan changes its tables or config: a new grid, or (an image grid) a new image size."""
        return self.new_grid != self.layout.grid or bool(self.spec.grid and self.target != self.spec.grid.sizes(config)[0])

    def buffer_value(self, config: Mapping[str, Any]) -> int:
        """The value length-dependent buffers are rebuilt for (see :meth:`ArchitectureSpec.config_value`)."""
        return self.spec.config_value(config, self.new_usable)

    def config_updates(self, config: Mapping[str, Any]) -> dict[str, Any]:
        return self.spec.config_updates(config, self.target)

    def resize(self, table: torch.Tensor, *, seed: int | None, context: Mapping[str, Any]) -> torch.Tensor:
        """``table`` resized: a grid's table by the plan's strategy, a relative-position companion linearly, as
        the family resamples it at run time."""
        if self._is_relative(tuple(table.shape)):
            return resize_relative(table, 2 * self.new_grid[0] - 1)
        return resize_grid(table, self.layout.grid, self.new_grid, self.strategy, reserved=self.layout.reserved,
                           seed=seed, params=self.params, context=context)


@dataclass(frozen=True)
class Request:
    """What a resize asks for, as both doors take it: a new length and/or image size, the strategy and its
    ``params``, the group(s) of positions (``group``: ``table=`` in the public API: one name, or several resized
    to the same length) in a model with several, and whether it may shrink."""

    new_length: int | None = None
    pixels: int | ImageSize | None = None  # the new image size, in pixels (height, width; one int: square)
    strategy: str | None = None
    params: Mapping[str, Any] | None = None
    group: str | Sequence[str] | None = None
    allow_shrink: bool = False

    @property
    def groups(self) -> tuple[str | None, ...]:
        """The groups named, each once, in the order given; ``(None,)`` when none is."""
        if self.group is None or isinstance(self.group, str):
            return (self.group,)
        return tuple(dict.fromkeys(self.group)) or (None,)


def plan_resize(config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], request: Request, *,
                cls: type | None = None) -> list[GroupPlan]:
    """The groups to resize (positions first, then the image grid), checked; nothing is computed yet.

    ``request.strategy`` (with its ``params``) applies to the groups whose grid rank it handles; the others
    get their rank's default. ``request.group`` names the group of positions in a model with several
    (``"decoder"``; several, ``("encoder", "decoder")``, each resized to the new length), or the grid's group
    when only an image size is given. ``cls``: the model's class, in memory.
    """
    if request.new_length is None and request.pixels is None:
        raise InvalidLengthError("Give a new length (positions) or a new image size (image grids) to resize to.")
    ranks = [r for r, v in ((1, request.new_length), (2, request.pixels)) if v is not None]
    strategy = request.strategy
    if request.params and strategy is None and len(ranks) > 1:
        raise StrategyError("Strategy parameters were given for a length and an image size: name the strategy they are for.")
    if strategy is not None and not any(r in get_strategy(strategy).ranks for r in ranks):
        check_rank(strategy, ranks[0])  # raises, naming the strategies that fit
    plans = []
    for rank, group in [(r, g) for r in ranks for g in (request.groups if r == 1 or len(ranks) == 1 else (None,))]:
        spec = spec_for(config, cls=cls, table=group, rank=rank)
        layout = spec.locate(shapes, config)
        target, new_grid = _target(spec, layout, config, request, rank, in_memory=cls is not None)
        default = spec.grid.strategy if rank == 2 and spec.grid.strategy else DEFAULTS[rank]
        name = strategy if strategy is not None and rank in get_strategy(strategy).ranks else default
        own = dict(request.params or {}) if name == strategy or strategy is None else {}
        if rank == 2 and spec.grid.antialias and "antialias" in get_strategy(name).params:
            own.setdefault("antialias", True)  # what the family's own run-time interpolation does
        check_params(name, own)
        plans.append(GroupPlan(spec, layout, new_grid, target, name, own))
    return plans


def _target(spec: ArchitectureSpec, layout: Layout, config: Mapping[str, Any], request: Request, rank: int, *,
            in_memory: bool) -> tuple[int | ImageSize, tuple[int, ...]]:
    """The group's target (usable positions, or ``(height, width)`` pixels) and its new grid, checked."""
    if rank == 1:
        check_length(request.new_length, layout.usable, allow_shrink=request.allow_shrink)
        return request.new_length, (request.new_length,)
    target = image_size_pair(request.pixels)
    new_grid = spec.grid.grid(config, target)
    _check_grid(new_grid, layout.grid, target, allow_shrink=request.allow_shrink)
    if in_memory and spec.grid.follow:
        raise UnsupportedArchitectureError(
            f"{spec.model_type}: {', '.join(k for k, _ in spec.grid.follow)} follow the image size, and its "
            "modules copy them when built, which a model in memory keeps; save the model, resize the saved "
            "checkpoint and load that instead.")
    if layout.relative and new_grid[0] != new_grid[1]:
        raise InvalidLengthError(
            f"This model's relative-position tables follow a square grid: give one image size (e.g. "
            f"{target[0]}), not {target[0]}x{target[1]}.")
    return target, new_grid


def _check_grid(new: tuple[int, ...], old: tuple[int, ...], size: ImageSize, *, allow_shrink: bool) -> None:
    if any(n < o for n, o in zip(new, old)) and not allow_shrink:
        raise InvalidLengthError(
            f"The image size {size[0]}x{size[1]} gives a {new[0]}x{new[1]} patch grid, smaller than the current "
            f"{old[0]}x{old[1]} on a side: the positions would be resampled to fewer. To shrink on purpose, "
            "allow shrinking (allow_shrink=True)."
        )
