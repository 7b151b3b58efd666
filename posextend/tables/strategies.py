"""Strategies that give a position table a new number of usable rows.

A strategy is a pure function on the *usable* rows::

    fn(table: Tensor[L, D], new_len: int, *, generator: torch.Generator, **params) -> Tensor[new_len, D]

It receives float32 and must not modify its input. :func:`resize_table` strips the
reserved rows before calling it, checks the result's shape and finiteness, casts back
to the table's dtype and re-attaches the reserved rows bit-exact, so no plugin can
corrupt a checkpoint.

Grids: a table's usable rows form a grid, ``(L,)`` for positions or ``(H, W)`` for image
patches after prefix tokens. A strategy declares the grid ranks it accepts
(``register_strategy(..., ranks=(2,))``); a rank-2 strategy is called as
``fn(grid: Tensor[H, W, D], new_size: tuple[int, int], *, generator, **params) -> Tensor[H', W', D]``
(like timm's ``resample_abs_pos_embed``), through :func:`resize_grid`. A strategy is
never given a rank it did not declare.

Row strategies: a strategy whose every new row is a copy of an old one (``tile``) may also
give ``rows(old_len, new_len) -> list[int]``, the old row behind each new row, and define
``fn`` from it. Files are then resized by copying those rows' bytes: exact in every dtype,
and without importing torch.

Context parameters: a strategy that declares a keyword named ``initializer_range``
receives the model config's ``initializer_range`` (0.02 when absent) unless the user
passes one.

Third-party packages register strategies through the entry-point group
``posextend.strategies``; each entry point names a module (or callable) whose import
registers them with :func:`register_strategy`. They are imported lazily, on the first
lookup.

Examples:
    >>> import posextend, torch
    >>> @posextend.register_strategy("mirror", description="Reflect at the end.")
    ... def mirror(table, new_len, *, generator):
    ...     idx = torch.arange(new_len) % (2 * len(table))
    ...     idx = torch.where(idx < len(table), idx, 2 * len(table) - 1 - idx)
    ...     return table[idx]
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from posextend.errors import CorruptCheckpointError, StrategyError
from posextend.registry import Registry

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

StrategyFn = Callable[..., "torch.Tensor"]
ENTRY_POINT_GROUP = "posextend.strategies"
CONTEXT_PARAMS = ("initializer_range",)
DEFAULTS = {1: "tile", 2: "bicubic"}  # the strategy used when none is named, by grid rank


@dataclass(frozen=True)
class Strategy:
    name: str
    fn: StrategyFn
    description: str
    keeps_rows: bool  # whether rows below the old length come out bit-exact when growing
    rows: Callable[[int, int], list[int]] | None = None  # old row of each new row, for row strategies
    ranks: tuple[int, ...] = (1,)  # the grid ranks it resizes: 1 (positions), 2 (image patches)
    random: bool = False  # whether it draws from its generator (its seed is then reported)
    defaults: Mapping[str, str] = field(default_factory=dict)  # a default that follows the table: what it is

    @property
    def params(self) -> dict[str, inspect.Parameter]:
        sig = inspect.signature(self.fn)
        return {
            n: p
            for n, p in sig.parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY and n != "generator"
        }


_REGISTRY: Registry[Strategy] = Registry("strategy", "strategies", ENTRY_POINT_GROUP, StrategyError)


def register_strategy(
    name: str,
    *,
    description: str | None = None,
    keeps_rows: bool = False,
    rows: Callable[[int, int], list[int]] | None = None,
    ranks: tuple[int, ...] = (1,),
    random: bool = False,
    defaults: Mapping[str, str] | None = None,
) -> Callable[[StrategyFn], StrategyFn]:
    """Decorator registering ``fn(table, new_len, *, generator, **params)`` (see the module doc) as strategy
    ``name``; returns ``fn`` unchanged. Refuses (:class:`StrategyError`) a name invalid or taken, and an ``fn``
    without a keyword-only ``generator`` or with ``ranks`` / ``rows`` that do not fit.

    Args:
        name: lowercase letters, digits, ``-`` and ``_``, starting with a letter; not one registered.
        description: one line for ``posextend strategies`` (default: the first line of ``fn``'s docstring).
        keeps_rows: whether the rows below the old length come out bit-exact when the table grows.
        rows: row strategies only: ``rows(old_len, new_len)``, the old row behind each new row; it must
            agree with ``fn`` (``fn(table, n)`` is ``table[rows(len(table), n)]``).
        ranks: the grid ranks ``fn`` handles: ``(1,)`` positions (the default), ``(2,)`` image-patch grids.
        random: ``fn`` draws from ``generator``: its result depends on the seed, which is then shown with it.
        defaults: parameters whose default follows the table or the model (``None`` in ``fn``'s signature, worked
            out by ``fn``), each with what it is, as ``posextend strategies`` shows it.

    Examples:
        >>> @register_strategy("zeros", description="New rows are 0.", keeps_rows=True)
        ... def zeros(table, new_len, *, generator):
        ...     out = table.new_zeros(new_len, table.shape[1])
        ...     out[: min(len(table), new_len)] = table[:new_len]
        ...     return out
    """
    _REGISTRY.check_name(name)

    def decorator(fn: StrategyFn) -> StrategyFn:
        _REGISTRY.check_name(name)
        params = inspect.signature(fn).parameters
        if "generator" not in params or params["generator"].kind is not inspect.Parameter.KEYWORD_ONLY:
            raise StrategyError(
                f"Strategy {name!r} must accept a keyword-only 'generator' argument: "
                "fn(table, new_len, *, generator, **params)."
            )
        if not ranks or any(r not in (1, 2) for r in ranks) or (rows is not None and ranks != (1,)):
            raise StrategyError(f"Strategy {name!r}: ranks must be 1 and/or 2 (a row strategy: 1 only), got {ranks!r}.")
        if rows is not None and any(
            p.kind is inspect.Parameter.KEYWORD_ONLY and n != "generator" for n, p in params.items()
        ):
            raise StrategyError(f"Strategy {name!r}: a row strategy (rows=...) takes no parameters.")
        doc = description or (inspect.getdoc(fn) or "").split("\n")[0]
        if set(defaults or {}) - set(params):
            raise StrategyError(f"Strategy {name!r}: defaults must name its parameters, got {sorted(defaults)}.")
        _REGISTRY.add(name, Strategy(name, fn, doc, keeps_rows, rows, tuple(ranks), random, dict(defaults or {})))
        return fn

    return decorator


def available_strategies() -> dict[str, Strategy]:
    """All registered strategies (built-ins and plugins), by name."""
    return _REGISTRY.available()


def get_strategy(name: str) -> Strategy:
    """The registered strategy ``name``; raises :class:`StrategyError` listing the valid ones.

    Args:
        name: a strategy's name, as :func:`available_strategies` lists them.
    """
    return _REGISTRY.get(name)


def check_params(strategy: str, params: Mapping[str, Any] | None) -> Strategy:
    """The strategy, once its name and parameter names are known to be valid (no torch needed)."""
    strat = get_strategy(strategy)
    accepted = strat.params
    unknown = sorted(set(params or {}) - set(accepted))
    if unknown:
        names = ", ".join(n for n in accepted if n not in CONTEXT_PARAMS) or "none"
        raise StrategyError(
            f"Strategy {strategy!r} does not take parameter(s) {', '.join(unknown)}; it accepts: {names}."
        )
    return strat


def check_rank(strategy: str, rank: int) -> Strategy:
    """The strategy, once it is known to handle grids of ``rank`` (1: positions, 2: image patches)."""
    strat = get_strategy(strategy)
    if rank not in strat.ranks:
        what = {1: "a 1-D table of positions", 2: "a 2-D grid of image patches"}
        fits = ", ".join(n for n, s in available_strategies().items() if rank in s.ranks)
        raise StrategyError(
            f"Strategy {strategy!r} resizes {' and '.join(what[r] for r in strat.ranks)}; this table is "
            f"{what[rank]}: use {DEFAULTS[rank]} (the default) or another of: {fits}."
        )
    return strat


def resize_table(
    table: torch.Tensor,
    new_usable: int,
    strategy: str = "tile",
    *,
    reserved: int = 0,
    seed: int | None = None,
    params: Mapping[str, Any] | None = None,
    context: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """Return ``table`` with ``new_usable`` usable rows, its ``reserved`` leading rows kept.

    Args:
        table: the table, ``[rows, dim]``; not modified.
        new_usable: the usable rows of the result (the reserved rows come on top).
        strategy: a registered strategy that handles tables of positions (:func:`available_strategies`).
        reserved: leading rows that are no position (RoBERTa's padding rows, OPT's offset), kept bit-exact.
        seed: seeds the generator a random strategy draws from (default: a random seed).
        params: the strategy's parameters (``{"std": "matched"}`` for ``random``).
        context: the model config's values a strategy may ask for (``initializer_range``).

    Examples:
        >>> t = torch.randn(514, 8)     # RoBERTa-style: 2 reserved + 512 usable
        >>> resize_table(t, 1024, "tile", reserved=2).shape
        torch.Size([1026, 8])
    """
    if table.dim() != 2 or table.shape[0] <= reserved:
        raise StrategyError(
            f"Expected a 2-D table with more than {reserved} reserved rows, got shape {tuple(table.shape)}."
        )
    return resize_grid(table, (table.shape[0] - reserved,), (new_usable,), strategy, reserved=reserved, seed=seed,
                       params=params, context=context)


def resize_grid(
    table: torch.Tensor,
    grid: tuple[int, ...],
    new_grid: tuple[int, ...],
    strategy: str,
    *,
    reserved: int = 0,
    seed: int | None = None,
    params: Mapping[str, Any] | None = None,
    context: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """Return ``table`` (``[rows, D]``, ``[1, rows, D]`` or ``[1, H, W, D]``) with its usable rows, a ``grid``,
    resized to ``new_grid``; the ``reserved`` leading rows (prefix tokens) are kept bit-exact.

    The usable rows are reshaped to the grid (row-major, as ViT flattens patches), given to the
    strategy in float32, checked (shape, finiteness), flattened back and cast to the table's dtype.
    A ``[1, H, W, D]`` table (SAM's ``pos_embed``, no prefix tokens) is written in the same layout. Raises
    :class:`StrategyError` where a shape, the strategy or its result does not fit (``resize_table`` too).

    Args:
        table: the table; not modified.
        grid: the usable rows' grid: ``(L,)`` for positions, ``(H, W)`` for image patches.
        new_grid: the grid of the result, of the same rank.
        strategy: a registered strategy that handles grids of this rank (:func:`available_strategies`).
        reserved: leading rows (prefix tokens: ViT's class token, DeiT's distillation token), kept bit-exact.
        seed: seeds the generator a random strategy draws from (default: a random seed).
        params: the strategy's parameters.
        context: the model config's values a strategy may ask for (``initializer_range``).

    Raises:
        CorruptCheckpointError: the table already holds NaN or Inf values.

    Examples:
        >>> t = torch.randn(1, 1 + 14 * 14, 768)  # ViT-B/16, 224 px: class + 14x14
        >>> resize_grid(t, (14, 14), (28, 28), "bicubic", reserved=1).shape
        torch.Size([1, 785, 768])
    """
    import torch

    rank = len(grid)
    strat = check_params(strategy, params)
    check_rank(strategy, rank)
    params = dict(params or {})
    for key in CONTEXT_PARAMS:
        if key in strat.params and key not in params and context and context.get(key) is not None:
            params[key] = context[key]
    flat = _grid_rows(table, grid, new_grid, reserved)
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed if seed is not None else torch.seed())
    dim = flat.shape[1]
    usable = flat[reserved:].detach().to("cpu", torch.float32).clone().reshape(*grid, dim)
    with torch.no_grad():
        try:
            out = strat.fn(usable, new_grid[0] if rank == 1 else tuple(new_grid), generator=generator, **params)
        except (ValueError, TypeError) as exc:
            raise StrategyError(f"Strategy {strategy!r} rejected its parameters: {exc}") from exc
    expected = (*new_grid, dim)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != expected:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise StrategyError(f"Strategy {strategy!r} returned {got}, expected shape {expected}.")
    if not torch.isfinite(out).all():
        raise StrategyError(f"Strategy {strategy!r} produced non-finite values; the table was not changed.")
    out = out.reshape(-1, dim).to(device=table.device, dtype=table.dtype)
    out = torch.cat([flat[:reserved].detach(), out]) if reserved else out.contiguous()
    if table.dim() == 4:  # [1, H, W, D]: the grid in place of the rows
        return out.reshape(1, *new_grid, dim)
    return out.reshape(*table.shape[:-2], out.shape[0], dim)


def _grid_rows(table: torch.Tensor, grid: tuple[int, ...], new_grid: tuple[int, ...], reserved: int) -> torch.Tensor:
    """``table``'s rows as ``[rows, D]``, once its shape is known to hold ``reserved`` rows and ``grid`` (a
    ``[1, H, W, D]`` table: exactly the grid) and ``new_grid`` a grid of the same rank; its values finite."""
    import math

    import torch

    four = table.dim() == 4 and table.shape[0] == 1 and tuple(table.shape[1:3]) == tuple(grid) and not reserved
    lead = tuple(table.shape[:-2])
    rows = table.shape[-2] if table.dim() in (2, 3) else math.prod(table.shape[1:3]) if four else 0
    if not four and (table.dim() not in (2, 3) or any(d != 1 for d in lead)) or rows != reserved + math.prod(grid) \
            or len(new_grid) != len(grid):
        raise StrategyError(
            f"Expected a table of {reserved} reserved rows and a {'x'.join(map(str, grid))} grid "
            f"([rows, dim], [1, rows, dim] or [1, H, W, dim]), got shape {tuple(table.shape)}; new grid {new_grid}."
        )
    if any(not isinstance(n, int) or n <= 0 for n in new_grid):
        raise StrategyError(f"A new grid size must be positive integers, got {new_grid}.")
    flat = table.reshape(rows, table.shape[-1])
    bad = int((~torch.isfinite(flat.detach().float())).sum())
    if bad:
        raise CorruptCheckpointError(
            f"The position table already holds {bad} NaN/Inf value(s) before resizing: the source model is "
            "damaged (no strategy can repair it). Re-download or re-save it; nothing was changed."
        )
    return flat


# ---------------------------------------------------------------------------- built-ins


def tile_rows(old_len: int, new_len: int) -> list[int]:
    """Row ``i`` of the result is row ``i mod L`` of the old table; shrinking keeps the first rows."""
    return [i % old_len for i in range(new_len)]


@register_strategy(
    "tile",
    description="Copy-tiling (Longformer): old rows kept bit-exact, then repeated cyclically.",
    keeps_rows=True,
    rows=tile_rows,
)
def tile(table: torch.Tensor, new_len: int, *, generator: torch.Generator) -> torch.Tensor:
    """Row ``i`` of the result is row ``i mod L`` of the old table (any new length).

    Shrinking keeps the first ``new_len`` rows.
    """
    import torch

    return table[torch.tensor(tile_rows(table.shape[0], new_len), dtype=torch.long)]


@register_strategy(
    "interpolate",
    description="Position interpolation: stretch the old table linearly over the new length.",
)
def interpolate(table: torch.Tensor, new_len: int, *, generator: torch.Generator) -> torch.Tensor:
    """Linear interpolation with aligned ends (``align_corners=True``).

    New row ``i`` samples the old table at ``x = i * (L - 1) / (new_len - 1)``:
    ``(1 - w) * old[floor(x)] + w * old[floor(x) + 1]`` with ``w = x - floor(x)``.
    The first and last rows are kept exactly; shrinking compresses the same way.
    """
    import torch

    old_len = table.shape[0]
    if old_len == 1 or new_len == 1:
        return table[:1].expand(new_len, -1).clone()
    x = torch.arange(new_len, dtype=torch.float64) * ((old_len - 1) / (new_len - 1))
    lo = x.floor().long().clamp(max=old_len - 2)
    w = (x - lo).to(table.dtype)[:, None]
    return (1 - w) * table[lo] + w * table[lo + 1]


@register_strategy(
    "random",
    description="Old rows kept bit-exact; new rows ~ N(0, std), std = initializer_range or 'matched'.",
    keeps_rows=True,
    random=True,
    defaults={"std": "initializer_range"},
)
def random(
    table: torch.Tensor,
    new_len: int,
    *,
    generator: torch.Generator,
    std: float | str | None = None,
    initializer_range: float = 0.02,
) -> torch.Tensor:
    """New rows drawn from N(0, std).

    ``std`` defaults to the config's ``initializer_range`` (0.02 if absent);
    ``std="matched"`` uses the standard deviation of the existing table.
    Shrinking keeps the first ``new_len`` rows.
    """
    import torch

    if std is None:
        std = initializer_range
    elif std == "matched":
        std = table.std().item()
    elif not isinstance(std, (int, float)) or std < 0:
        raise ValueError(f"std must be a non-negative number or 'matched', got {std!r}")
    extra = max(new_len - table.shape[0], 0)
    fill = torch.randn(extra, table.shape[1], generator=generator) * float(std)
    return torch.cat([table[:new_len], fill])


KPS_KEEP, KPS_OF = 20, 77  # Long-CLIP keeps 20 of CLIP's 77 text positions


def kps_keep(old_len: int) -> int:
    """``kps``'s default ``keep`` for a table of ``old_len`` rows: Long-CLIP's 20 of 77, scaled (``round(old_len *
    20 / 77)``: 20 for CLIP's 77, 4 for OWL-ViT's 16), at most ``old_len - 2`` (what ``kps`` takes)."""
    return max(0, min(round(old_len * KPS_KEEP / KPS_OF), old_len - 2))


@register_strategy(
    "kps",
    description="Knowledge-preserved stretching (Long-CLIP): first `keep` rows bit-exact, the rest stretched.",
    defaults={"keep": f"old length × {KPS_KEEP}/{KPS_OF}, rounded"},
)
def kps(table: torch.Tensor, new_len: int, *, generator: torch.Generator, keep: int | None = None) -> torch.Tensor:
    """Long-CLIP's knowledge-preserved stretching (arXiv 2403.15378).

    Rows ``0 .. keep-1`` are copied; ``keep`` defaults to :func:`kps_keep` of the old length (Long-CLIP's 20 of
    77 rows, scaled: 20 for CLIP, 4 for a 16-row table). The rest stretch by ``ratio = (new_len - keep) / (L - keep)``:
    new row ``keep + j`` samples the old table at ``x = keep + j / ratio``, linear between
    ``floor(x)`` and ``floor(x) + 1``; past the last old row it extrapolates with the last
    slope. For CLIP's 77 → 248 (ratio 4) that is Long-CLIP's table exactly: rows ``20+4k ..
    23+4k`` blend ``old[20+k]`` and ``old[21+k]`` with weights 1, ¾, ½, ¼, and rows 244..247 are
    ``old[76] + j * (old[76] - old[75]) / 4``. Shrinking compresses the tail the same way.
    """
    import torch

    old_len = table.shape[0]
    keep = kps_keep(old_len) if keep is None else keep
    if not isinstance(keep, int) or not 0 <= keep < old_len - 1:
        raise ValueError(f"keep must be an integer between 0 and {old_len - 2} (the old length less 2), got {keep!r}")
    if new_len <= keep:
        return table[:new_len].clone()
    j = torch.arange(new_len - keep, dtype=torch.float64)
    x = keep + j * ((old_len - keep) / (new_len - keep))
    lo = x.floor().long().clamp(max=old_len - 2)
    w = (x - lo)[:, None]
    stretched = ((1 - w) * table[lo].double() + w * table[lo + 1].double()).to(table.dtype)
    return torch.cat([table[:keep], stretched])


def _resample(grid: torch.Tensor, new_size: tuple[int, int], mode: str, antialias: bool | None) -> torch.Tensor:
    """``grid [H, W, D]`` resampled to ``new_size`` like transformers' ``interpolate_pos_encoding``:
    ``[1, D, H, W]``, ``align_corners=False``, in float32; ``antialias`` (None: when shrinking)."""
    import torch.nn.functional as F

    shrinking = new_size[0] < grid.shape[0] or new_size[1] < grid.shape[1]
    if antialias is None:
        antialias = shrinking
    if not isinstance(antialias, bool):
        raise ValueError(f"antialias must be true or false, got {antialias!r}")
    x = grid[None].permute(0, 3, 1, 2)  # the strides transformers' reshape + permute gives
    extra = {"align_corners": False, "antialias": antialias} if mode != "nearest-exact" else {}
    return F.interpolate(x, size=tuple(new_size), mode=mode, **extra)[0].permute(1, 2, 0).contiguous()


@register_strategy(
    "bicubic",
    description="Image grids: bicubic resampling, as transformers' interpolate_pos_encoding (antialias when shrinking).",
    ranks=(2,),
    defaults={"antialias": "when shrinking"},
)
def bicubic(grid: torch.Tensor, new_size: tuple[int, int], *, generator: torch.Generator,
            antialias: bool | None = None) -> torch.Tensor:
    """Bicubic, ``align_corners=False``, in float32: growing, exactly what transformers computes at
    run time with ``interpolate_pos_encoding=True``. ``antialias`` defaults to on when shrinking
    (timm's ``resample_abs_pos_embed`` always antialiases; transformers never does: ``antialias=false``)."""
    return _resample(grid, new_size, "bicubic", antialias)


@register_strategy("bilinear", description="Image grids: bilinear resampling (antialias when shrinking).", ranks=(2,),
                   defaults={"antialias": "when shrinking"})
def bilinear(grid: torch.Tensor, new_size: tuple[int, int], *, generator: torch.Generator,
             antialias: bool | None = None) -> torch.Tensor:
    """Bilinear, ``align_corners=False``, in float32; smoother than bicubic, never overshoots."""
    return _resample(grid, new_size, "bilinear", antialias)


@register_strategy("nearest", description="Image grids: each new patch copies the nearest old one.", ranks=(2,))
def nearest(grid: torch.Tensor, new_size: tuple[int, int], *, generator: torch.Generator) -> torch.Tensor:
    """Nearest neighbour with pixel centres aligned (``nearest-exact``): every new row is an old row,
    bit-exact; doubling the size repeats each patch as a 2x2 block."""
    return _resample(grid, new_size, "nearest-exact", None)
