"""Image-patch grids no spec states, observed on twins of the model (see :mod:`posextend.families.twin`).

:func:`observe_grids` derives a family's grid specs from its own code, as :mod:`.probe` does for
1-D tables: for every (sub-)config holding an ``image_size`` and a ``patch_size``, meta twins at
the config's image size and two patches larger per side show which learned tables follow it (their
rows move as ``prefix + (H/p)*(W/p)`` with the same prefix at both sizes) and which buffers do; a
twin at ``[h, w + 2p]`` shows whether non-square images are handled. Then the family's method is
observed, not assumed: where the module around the table takes ``interpolate_pos_encoding``, a tiny
twin's run-time output at new sizes must equal (within :data:`TOLERANCE`) that of a twin whose table
was resized by exactly one of :data:`CANDIDATES`; a family without a run-time path must load and run
with a resized table. Anything inconclusive is refused with the reason. A family that adapts one learned
grid to each image on every forward (a tiny twin runs on two image sizes, fed pixels or patch sequences with
their grid as Qwen-VL's ``grid_thw``, with one table that it uses) is refused with :class:`RunTimeGridError`:
there is nothing on disk to resize.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from posextend.families import twin
from posextend.errors import RunTimeGridError, UnsupportedArchitectureError
from posextend.families.specs import (
    IMAGE_COUNT_FIELD, ArchitectureSpec, BufferRule, GridSpec, positions_kind_problem, table_rows,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

log = logging.getLogger(__name__)

STEP = 2  # patches added per side for the second twin
PATCH_GRIDS = ((12, 12), (24, 24))  # patch grids of the two images a tower fed patch sequences gets
TOLERANCE = 1e-5  # largest difference from the run-time interpolation a resized twin may show
# (strategy, antialias): the resamplings a family's run-time interpolation is checked against
CANDIDATES = (("bicubic", False), ("bicubic", True), ("bilinear", False), ("bilinear", True))


def image_fields(config: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(image_key, patch_key)`` of the config and every sub-config holding an int or ``[h, w]``
    ``image_size`` and ``patch_size`` (dotted: ``vision_config.image_size``)."""
    return [(f"{prefix}image_size", f"{prefix}patch_size") for prefix, sub in twin.sub_configs(config)
            if twin.pair(sub.get("image_size")) and twin.pair(sub.get("patch_size"))]


def observe_grids(config: Mapping[str, Any], cls: type | None = None) -> tuple[ArchitectureSpec, ...]:
    """The specs of the image-patch grids of a family without a written grid spec, observed on twins.

    Returns ``()`` at once for a config without a patch size, and for one without an image size whose
    twin shows no grid used at two image sizes. Raises :class:`RunTimeGridError` when the family adapts
    its grid to each image on every forward, :class:`UnsupportedArchitectureError` naming what was
    inconclusive when it has an image size but no grid can be resized safely.
    """
    if not any("patch_size" in sub for _, sub in twin.sub_configs(config)):
        return ()
    name = f"{cls.__module__}.{cls.__qualname__}" if cls else None
    found = _cached(json.dumps(dict(config), sort_keys=True, default=str), name)
    if isinstance(found, UnsupportedArchitectureError):
        raise type(found)(str(found))
    return found


@functools.lru_cache(maxsize=64)
def _cached(config_json: str, cls_name: str | None) -> tuple[ArchitectureSpec, ...] | UnsupportedArchitectureError:
    """The specs, or the refusal (refusals are remembered too: lookups ask again)."""
    try:
        return _observe_grids(config_json, cls_name)
    except UnsupportedArchitectureError as exc:
        return exc


def _observe_grids(config_json: str, cls_name: str | None) -> tuple[ArchitectureSpec, ...]:
    from posextend.families.probe import claim

    config = json.loads(config_json)
    cls = twin._resolve(cls_name) or twin.model_class(config)
    base = twin.base_prefix(config, cls)
    specs, reasons, claimed = [], [], {}
    for image_key, patch_key in image_fields(config):
        try:
            spec = _observe_field(config, cls, image_key, patch_key, base)
        except UnsupportedArchitectureError as exc:
            reasons.append(str(exc))
            continue
        if spec is None:
            continue
        claim(claimed, spec, image_key)
        specs.append(spec)
    if not specs:
        _refuse(config, cls, reasons)
    return tuple(specs)


def _refuse(config: dict[str, Any], cls: type, reasons: list[str]) -> None:
    """No grid found to resize: raise :class:`RunTimeGridError` when the family adapts one to each image (for
    grids refused for a reason of their own, seen through patch sequences only), else why no grid is resized;
    return (nothing to say) for a config with a patch size but no image size and no adapted grid."""
    model_type, failures = config.get("model_type", "?"), []
    adapted = _adapted_per_image(config, cls, failures, pixels=not reasons)
    if adapted:
        raise RunTimeGridError(
            f"Model type {model_type!r} uses {_rotary(config)}its learned position grid at any image size: "
            f"{adapted}. It adapts the grid to each image on every forward, so there is nothing on disk to "
            "resize; feed it larger images instead (raise the image processor's size)."
        )
    keys = [k for k, _ in image_fields(config)]
    if not keys:
        return
    if not reasons:  # what else the twins showed: a table another field sizes, else why none ran on images
        elsewhere = _sized_elsewhere(config, cls, keys)
        reasons = [f"no image size ({', '.join(keys)}) changes the rows of a learned table",
                   *([elsewhere] if elsewhere else failures[:1])]
    why = "; ".join(reasons)
    raise UnsupportedArchitectureError(
        f"Model type {model_type!r} has no written grid spec, and its twin shows no image grid posextend can "
        f"resize safely ({why})."
    )


def _sized_elsewhere(config: dict[str, Any], cls: type, image_keys: list[str]) -> str:
    """What names a grid-shaped table that another length field sizes (Molmo2's ``num_position_embeddings``,
    stated beside its ``image_size``), as meta twins with that field doubled show; ``""`` when none does."""
    from posextend.families.probe import length_fields

    model = twin.build(config, device="meta", cls=cls)
    grids = {n: tuple(p.shape) for n, p in twin.absolute_position_tables(model) if twin.is_grid_shape(tuple(p.shape))}
    for key in (k for k in length_fields(config) if k not in image_keys):
        try:
            moved = twin.meta_shapes(twin.set_path(config, key, 2 * twin.get_path(config, key)), cls, saved=False)
        except UnsupportedArchitectureError:
            continue
        name = next((n for n, shape in grids.items() if moved.get(n, shape) != shape), None)
        if name is not None:
            return (f"its table {name} {list(grids[name])} follows {key} instead, a field of its own beside the "
                    "image size: posextend resizes a grid only where the image size sizes it")
    return ""


def grid_tables(config: Mapping[str, Any], cls: type | None = None) -> list[str]:
    """The learned position tables shaped as an image grid (:func:`.twin.is_grid_shape`) that a meta twin of
    ``config`` holds; none without a patch size, or when no twin builds."""
    if not any("patch_size" in sub for _, sub in twin.sub_configs(config)):
        return []
    try:
        model = twin.build(config, device="meta", cls=cls or twin.model_class(config))
    except Exception:  # a foreign constructor, or no class: no grid to speak of
        return []
    return [n for n, p in twin.absolute_position_tables(model) if twin.is_grid_shape(tuple(p.shape))]


def _rotary(config: Mapping[str, Any]) -> str:
    """``"<rotary embeddings> for its attention positions (...) and "`` when the config or a sub-config's
    positions are rotary (a RoPE language model or tower beside the grid), else ``""``."""
    problem = next((p for _, sub in twin.sub_configs(config)
                    if (p := positions_kind_problem(sub)) and "rotary" in p), None)
    if problem is None:
        return ""
    return (f"{problem} for its attention positions, which posextend does not resize (for longer inputs, use its "
            "own length scaling, e.g. rope_scaling), and ")


def _adapted_per_image(config: dict[str, Any], cls: type, failures: list[str], *, pixels: bool = True) -> str | None:
    """What shows that the family uses one learned grid at any image size, or None: a tiny twin (image
    and patch sizes kept) holds a table shaped as a grid that no image-size field sizes, runs on two images
    of different sizes with finite outputs (as pixels, or as patch sequences with their grid: Qwen-VL's
    ``grid_thw``), and uses the table there (zeroing it changes the output). ``pixels=False``: patch
    sequences only (a grid an image size sizes, refused for a reason of its own when fed pixels). Appends
    to ``failures`` why a run failed."""
    for widths in (True, False):
        try:
            small = twin.shrink(config, widths=widths)
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
        self.model, self.tables, self.channels, self.sizes = model, tables, twin.num_channels(small), []
        if fields:
            (h, w), (ph, pw) = GridSpec(*fields[0]).sizes(small)
            self.sizes = [(h, w), (h + STEP * ph, w + STEP * pw)]

    def __call__(self, size: tuple[int, int]) -> torch.Tensor:
        return twin.run_pixels(self.model, self.tables, size, self.channels, resampling=True)

    def label(self) -> str:
        (a, b), (c, d) = self.sizes
        return f"{a}x{b} and {c}x{d} images"


class _PatchRuns:
    """Runs of a twin on two images given as patch sequences with their grids (:func:`.twin.run_patches`),
    each in the module and layout the first one ran in."""

    def __init__(self, model: nn.Module, tables: list[str]):
        self.model, self.tables, self.sizes, self.where = model, tables, list(PATCH_GRIDS), None

    def __call__(self, grid: tuple[int, int]) -> torch.Tensor:
        out, self.where = twin.run_patches(self.model, self.tables, grid, self.where)
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


def _value(old: Any, size: tuple[int, int]) -> Any:
    """The image-size field for ``size`` in the field's own form: an int when square and it was one."""
    return size[0] if size[0] == size[1] and isinstance(old, int) else [size[0], size[1]]


def _is_grid_table(old: tuple[int, ...], new: tuple[int, ...] | None, cells: int, new_cells: int) -> bool:
    """``[1, rows, D]`` / ``[rows, D]`` whose rows are ``prefix + cells`` at both sizes, same prefix; or
    ``[1, H, W, D]`` (SAM's ``pos_embed``) whose ``H * W`` are the cells at both sizes."""
    if new is not None and len(old) == len(new) == 4 and old[0] == new[0] == 1 and old[-1] == new[-1]:
        return old[1] * old[2] == cells and new[1] * new[2] == new_cells
    if new is None or len(new) != len(old) or old[:-2] != new[:-2] or old[-1] != new[-1]:
        return False
    rows, new_rows = table_rows(old), table_rows(new)
    return rows is not None and new_rows is not None and rows - cells == new_rows - new_cells >= 0


def _observe_field(
    config: dict[str, Any], cls: type, image_key: str, patch_key: str, base: str,
) -> ArchitectureSpec | None:
    """The spec of the grid ``image_key`` drives, or None when it drives no learned table."""
    from posextend.families.probe import _name_pattern, _param_names, _relative, group_name

    facts = _Facts.of(config, cls, image_key, patch_key)
    model_type, old_value, up, ((h, w), (ph, pw)) = facts.model_type, facts.old_value, facts.up, facts.sizes
    shapes, saved = twin.meta_shapes(config, cls, saved=False), twin.meta_shapes(config, cls)
    moved = _shapes_at(config, cls, image_key, _value(old_value, up))
    changed = {n: (s, moved.get(n)) for n, s in shapes.items() if moved.get(n) != s}
    added = [n for n in moved if n not in shapes]
    if not changed and not added:
        return None
    params = _param_names(config, cls)
    cells, up_cells = (h // ph) * (w // pw), (up[0] // ph) * (up[1] // pw)
    tables, buffers, odd, relative = [], [], [], []
    for name, (old, new) in changed.items():
        if name in params and _is_grid_table(old, new, cells, up_cells):
            tables.append(name)
        elif name in params and _is_relative_table(old, new, (h // ph, w // pw), (up[0] // ph, up[1] // pw)):
            relative.append(name)  # a global-attention layer's rel_pos_h / rel_pos_w (windowed ones keep their size)
        elif name not in params and new is not None:
            buffers.append(name)
        else:
            odd.append(f"{name} {list(old)} -> {new and list(new)}")
    odd += [f"{n} (only at the larger size) {list(moved[n])}" for n in added]
    if relative and not tables:
        odd += [f"{n} {list(changed[n][0])} -> {list(changed[n][1])}" for n in relative]
    _refuse_odd(facts, tables, odd)
    if not tables:
        return None  # only buffers follow the image size (a grid resampled on every forward, or none)
    rows = {table_rows(shapes[t]) for t in tables}
    if len(rows) != 1:
        raise UnsupportedArchitectureError(
            f"{model_type}: the grids {image_key} sizes have different rows ({sorted(rows)}) for one patch grid: "
            "which prefix each has is ambiguous.")
    prefix = rows.pop() - cells
    square = not _non_square_shapes(config, cls, image_key, (h, w), (ph, pw), tables, prefix)
    small, source = _tiny_twin(config, cls, tables, (h, w), model_type)
    rules, derived = _buffer_rules(small, facts, buffers, saved, (cells + prefix, up_cells + prefix))
    probe = _Probe(small, facts, tables, prefix, rules, source)
    probe.follow = _follow_fields(config, image_key, (h, w), (ph, pw))
    probe.relative = _relative_tables(small, cls, image_key, (h, w), (ph, pw)) if relative else ()
    strategy, antialias, reference, square = probe.method(square or bool(relative))
    reference = _check_relative(probe, reference) if relative else reference
    if derived:
        log.debug("%s: buffers computed from the config follow %s: %s", model_type, image_key, derived)
    grid = GridSpec(image_key, patch_key, square=square, antialias=antialias, strategy=strategy, reference=reference,
                    counts=_counts(config, cells, prefix), relative=tuple(_relative(r, base) for r in relative),
                    follow=probe.follow)
    return ArchitectureSpec(
        model_type=model_type, prefix=base, tables=tuple(_relative(t, base) for t in tables),
        length_keys=(image_key,), reserved=prefix, buffers=tuple(BufferRule(_name_pattern(n, base), k, o)
                                                                  for n, k, o in rules),
        note="probed", group=group_name(image_key), grid=grid,
    )



@dataclass(frozen=True)
class _Facts:
    """What one image-size field of a config says: the family, its class, the field and its old value, the
    image and patch sizes, and the larger image the second twin gets (two patches more a side)."""

    model_type: str
    cls: type
    image_key: str
    patch_key: str
    old_value: Any
    sizes: tuple[tuple[int, int], tuple[int, int]]
    up: tuple[int, int]

    @classmethod
    def of(cls_, config: Mapping[str, Any], cls: type, image_key: str, patch_key: str) -> _Facts:
        (h, w), (ph, pw) = sizes = GridSpec(image_key, patch_key).sizes(config)
        return cls_(config.get("model_type", "?"), cls, image_key, patch_key, twin.get_path(config, image_key),
                    sizes, (h + STEP * ph, w + STEP * pw))


def _refuse_odd(facts: _Facts, tables: list[str], odd: list[str]) -> None:
    """Refuse a field that sizes tensors that are no grid of its patches (``odd``): beside no grid table, or
    beside the grid ``tables`` (resizing those alone would leave them at the old size)."""
    if not odd:
        return
    (h, w), (ph, pw) = facts.sizes
    cells, up_cells = (h // ph) * (w // pw), (facts.up[0] // ph) * (facts.up[1] // pw)
    grid_text = f"prefix rows + {h // ph}x{w // pw} patches"
    if not tables:
        raise UnsupportedArchitectureError(
            f"{facts.model_type}: {facts.image_key} sizes {', '.join(odd[:3])}, but no learned table of {grid_text} "
            f"(whose rows grow by {up_cells - cells} with two more patches a side); nothing posextend resizes "
            "as a grid."
        )
    raise UnsupportedArchitectureError(
        f"{facts.model_type}: {facts.image_key} sizes the grid {tables[0]} and also {', '.join(odd[:3])}, which is "
        f"no grid of {grid_text} (e.g. relative position tables, or a table whose prefix changes with the size); "
        "resizing the grid alone would leave it at the old size."
    )


def _is_relative_table(old: tuple[int, ...], new: tuple[int, ...] | None, grid: tuple[int, int],
                       up: tuple[int, int]) -> bool:
    """``[2 * side - 1, D]`` at both sizes, for the grid's side (square: SAM's global ``rel_pos_h`` / ``_w``)."""
    return (new is not None and len(old) == len(new) == 2 and old[1] == new[1] and grid[0] == grid[1]
            and old[0] == 2 * grid[0] - 1 and new[0] == 2 * up[0] - 1)


# Fields of other sub-configs that hold the image size or its grid's side (SAM's prompt encoder)
_FOLLOW = (("image_size", "image"), ("image_embedding_size", "side"))


def _follow_fields(config: Mapping[str, Any], image_key: str, size: tuple[int, int],
                   patch: tuple[int, int]) -> tuple[tuple[str, str], ...]:
    """``(field, kind)`` of the fields outside ``image_key``'s config named as an image size (holding ``size``)
    or an image embedding size (holding the grid's side): they follow the image (checked on the twin)."""
    side = (size[0] // patch[0], size[1] // patch[1])
    found = []
    for path, sub in twin.sub_configs(config):
        for key, kind in _FOLLOW:
            if path + key != image_key and key in sub and twin.pair(sub[key]) == (size if kind == "image" else side):
                found.append((path + key, kind))
    return tuple(found)


def _relative_tables(small: dict[str, Any], cls: type, image_key: str, size: tuple[int, int],
                     patch: tuple[int, int]) -> tuple[str, ...]:
    """The relative-position tables of the tiny twin ``small`` that follow ``image_key`` (its global layers)."""
    grid = (size[0] // patch[0], size[1] // patch[1])
    up = (size[0] + STEP * patch[0], size[1] + STEP * patch[1])
    old = twin.meta_shapes(small, cls, saved=False)
    new = _shapes_at(small, cls, image_key, _value(twin.get_path(small, image_key), up))
    return tuple(n for n, s in old.items() if new.get(n) != s
                 and _is_relative_table(s, new.get(n), grid, (up[0] // patch[0], up[1] // patch[1])))


def _check_relative(probe: _Probe, reference: str) -> str:
    """The relative tables' linear resizing, checked against the family's run time: at a larger size, a twin
    holding the source's relative tables as they are (resampled on every forward) must compute what one holding
    them resized computes, every hidden state within :data:`TOLERANCE`, where the tables move those states
    (zeroing them changes them by more than a thousand times that). Returns the reference the spec reports."""
    import torch

    if not probe.relative:
        raise UnsupportedArchitectureError(
            f"{probe.model_type}: relative-position tables follow its image size, but a tiny twin holds none of "
            "them, so their resizing cannot be checked against its run time.")
    with torch.no_grad():  # SAM starts them at zeros, its twin's layers near zero: make every weight count
        gen = torch.Generator().manual_seed(2)
        for name, param in probe.source.named_parameters():
            if name in probe.relative or (param.dim() > 1 and name not in probe.tables):
                scale = 1.0 if name in probe.relative else param[0].numel() ** -0.5
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    # the innermost module around the grid that takes pixels (SAM's vision encoder: its states, not the masks)
    path = next((p for p in reversed(twin._paths_around(probe.tables))
                 if twin._accepts(probe.source.get_submodule(p) if p else probe.source, "pixel_values")), "")
    size = probe.sizes(True)[0]  # the larger size (shrinking runs the same interpolation)
    model = probe.resized(size, "bicubic", False)
    got = _states(model, path, size, probe.channels)
    want = _with_tables(model, {n: probe.state[n] for n in probe.relative}, path, size, probe.channels)
    zeroed = _with_tables(model, {n: torch.zeros_like(probe.state[n]) for n in probe.relative}, path, size,
                          probe.channels)
    diff, moved = _largest_difference(got, want), _largest_difference(got, zeroed)
    if not diff <= TOLERANCE or not moved > 1e3 * TOLERANCE:
        raise UnsupportedArchitectureError(
            f"{probe.model_type}: its relative-position tables {', '.join(probe.relative[:2])} resized linearly "
            + (f"compute other values than its own run-time resampling at {size[0]}x{size[1]} (off by {diff:.2g})."
               if not diff <= TOLERANCE else f"do not move a tiny twin's states ({moved:.2g}), so whether they "
                                             "compute what its run-time resampling does is not observed."))
    return f"{reference}; relative tables: run-time"


def _with_tables(model: nn.Module, tables: Mapping[str, torch.Tensor], path: str, size: tuple[int, int],
                 channels: int) -> list[torch.Tensor]:
    """:func:`_states` of ``model`` holding ``tables`` (any shape) in place of its own, which are put back."""
    import torch

    kept = {}
    for name, value in tables.items():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        kept[name] = getattr(module, attr)
        setattr(module, attr, torch.nn.Parameter(value.clone()))
    try:
        return _states(model, path, size, channels)
    finally:
        for name, value in kept.items():
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, value)


def _largest_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    if len(a) != len(b) or not a:
        return float("inf")
    return max(float((x - y).abs().max()) if x.shape == y.shape else float("inf") for x, y in zip(a, b))


def _states(model: nn.Module, path: str, size: tuple[int, int], channels: int) -> list[torch.Tensor]:
    """The main output and every hidden state of ``model``'s module ``path`` on one random image of ``size``."""
    import torch

    module = model.get_submodule(path) if path else model
    pixels = torch.randn(1, channels, *size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), twin._quiet():
        try:
            out = module(pixel_values=pixels, output_hidden_states=True)
        except TypeError:  # a forward without the option
            out = module(pixel_values=pixels)
    return [twin.main_tensor(out), *(getattr(out, "hidden_states", None) or ())]


def _counts(config: Mapping[str, Any], cells: int, prefix: int) -> tuple[tuple[str, int], ...]:
    """Config fields named as a count of image tokens that hold the patch count (with or without the
    prefix tokens): LLaVA's ``image_seq_length``, PaliGemma's ``num_image_tokens``; they follow the grid."""
    found = []
    for path, sub in twin.sub_configs(config):
        for key, value in sub.items():
            if (IMAGE_COUNT_FIELD.search(key) and isinstance(value, int) and not isinstance(value, bool)
                    and value in (cells, cells + prefix)):
                found.append((path + key, value - cells))
    return tuple(found)


def _shapes_at(config: Mapping[str, Any], cls: type, image_key: str, value: Any) -> dict[str, tuple[int, ...]]:
    return twin.meta_shapes(twin.set_path(config, image_key, value), cls, saved=False)


def _non_square_shapes(config: dict[str, Any], cls: type, image_key: str, size: tuple[int, int],
                       patch: tuple[int, int], tables: list[str], prefix: int) -> bool:
    """Whether a meta twin at ``[h, w + 2p]`` builds, its grids at ``prefix + H * (W + 2)`` rows."""
    (h, w), (ph, pw) = size, patch
    try:
        shapes = _shapes_at(config, cls, image_key, [h, w + STEP * pw])
    except UnsupportedArchitectureError:
        return False
    want = prefix + (h // ph) * (w // pw + STEP)
    return all(table_rows(shapes.get(t, ())) == want for t in tables)


def _tiny_twin(config: dict[str, Any], cls: type, tables: list[str], size: tuple[int, int],
               model_type: str) -> tuple[dict[str, Any], nn.Module]:
    """A tiny CPU twin (widths shrunk if such a twin runs, else layers only; image and patch sizes kept)
    that runs on an image of its own ``size`` without resampling its positions, and its config."""
    failures = []
    for widths in (True, False):
        small = twin.shrink(config, widths=widths)
        try:
            model = twin.build(small, cls=cls)
            twin.run_pixels(model, tables, size, twin.num_channels(small))
        except UnsupportedArchitectureError:
            raise
        except Exception as exc:  # a foreign constructor or forward: try a milder shrink
            if "resamples its positions" in str(exc):
                raise UnsupportedArchitectureError(
                    f"{model_type}: {exc}: it resamples its grid on every forward, so there is no table on disk that "
                    "a new image size uses as it is."
                ) from None
            failures.append(twin._first_line(exc) if not isinstance(exc, RuntimeError) else str(exc)[:300])
            continue
        return small, model
    if isinstance(config.get("num_frames"), int):  # TimeSformer, ViViT: the forward takes frames
        raise UnsupportedArchitectureError(
            f"{model_type}: a video model (its config has num_frames={config['num_frames']}; the forward takes "
            f"frames of images), whose grid {tables[0]} posextend does not resize: 3-D video grids are not "
            "supported; feed it larger frames if its own code resamples its positions.")
    raise UnsupportedArchitectureError(
        f"{model_type}: a tiny twin does not run on an image of its own size {size[0]}x{size[1]} "
        f"({failures[-1] if failures else 'no twin'}), so the grid {tables[0]} cannot be checked."
    )


def _buffer_rules(
    small: dict[str, Any], facts: _Facts, buffers: list[str], saved: Mapping[str, Any], grid_rows: tuple[int, int],
) -> tuple[list[tuple[str, str, int]], list[str]]:
    """``(name, kind, offset)`` for each buffer that follows the grid's rows (CLIP's ``position_ids``; ``grid_rows``:
    the table's rows at the field's size and at two patches more a side), the one rule that reproduces a twin's;
    and the non-persistent buffers no rule rebuilds (computed from the config at construction, as OWL-ViT's
    ``box_bias``: no file holds them)."""
    from posextend.families.probe import _reproduces

    if not buffers:
        return [], []
    cls, image_key, old_value, up, model_type = facts.cls, facts.image_key, facts.old_value, facts.up, facts.model_type
    rows, up_rows = grid_rows
    a = dict(twin.build(small, cls=cls).named_buffers())
    b = dict(twin.build(twin.set_path(small, image_key, _value(old_value, up)), cls=cls).named_buffers())
    rules, derived = [], []
    for name in buffers:
        old, new = a.get(name), b.get(name)
        found = [] if old is None or new is None or not old.dim() else [
            kind for kind in ("arange", "zeros") if _reproduces(BufferRule("", kind, old.shape[-1] - rows), old, new, up_rows)]
        if len(found) == 1:
            rules.append((name, found[0], old.shape[-1] - rows))
        elif name not in saved:
            derived.append(name)
        else:
            raise UnsupportedArchitectureError(
                f"{model_type}: buffer {name} follows {image_key} and is saved with the weights, but "
                + ("no rule (arange, zeros) rebuilds it." if not found else f"several rules fit ({found}).")
            )
    return rules, derived


class _Probe:
    """The family's own resampling, observed: a tiny twin with distinct random rows, its run-time
    output at new sizes, and twins built at those sizes with the table resized by each candidate."""

    relative: tuple[str, ...] = ()  # relative-position companions, resized linearly with the grid's side
    follow: tuple[tuple[str, str], ...] = ()  # other config fields that follow the image (GridSpec.follow)

    def __init__(self, small: dict[str, Any], facts: _Facts, tables: list[str], prefix: int,
                 rules: list[tuple[str, str, int]], source: nn.Module):
        import torch

        self.small, self.cls, self.image_key, (self.size, self.patch) = small, facts.cls, facts.image_key, facts.sizes
        self.tables, self.prefix, self.rules, self.model_type = tables, prefix, rules, facts.model_type
        self.old_value = twin.get_path(small, facts.image_key)
        self.channels = twin.num_channels(small)
        self.source = source
        params = dict(source.named_parameters())
        with torch.no_grad():  # some families start their table at zeros: make every row distinct
            gen = torch.Generator().manual_seed(0)
            for t in tables:
                params[t].copy_(torch.randn(params[t].shape, generator=gen))
        self.state = source.state_dict()
        self.built: dict[tuple[int, int], nn.Module] = {}

    def grid(self, size: tuple[int, int]) -> tuple[int, int]:
        return size[0] // self.patch[0], size[1] // self.patch[1]

    def sizes(self, square: bool) -> list[tuple[int, int]]:
        """Larger, smaller (where the grid has room) and, unless square-only, a wider image."""
        (h, w), (ph, pw) = self.size, self.patch
        out = [(h + STEP * ph, w + STEP * pw)]
        if h // ph > STEP + 1 and w // pw > STEP + 1:
            out.append((h - STEP * ph, w - STEP * pw))
        if not square:
            out.append((h, w + STEP * pw))
        return out

    def resized(self, size: tuple[int, int], strategy: str, antialias: bool) -> nn.Module:
        """A twin built at ``size`` holding the source's weights, its tables resized by the candidate."""
        from posextend.tables.strategies import resize_grid

        from posextend.tables.strategies import resize_relative

        model = self.built.get(size)
        if model is None:
            config = twin.set_path(self.small, self.image_key, _value(self.old_value, size))
            for key, kind in self.follow:
                config = twin.set_path(config, key, _value(twin.get_path(config, key), size if kind == "image" else
                                                           self.grid(size)))
            model = self.built[size] = twin.build(config, cls=self.cls)
        new_rows = self.prefix + self.grid(size)[0] * self.grid(size)[1]
        merged = {}
        for name, tensor in model.state_dict().items():
            old = self.state.get(name)
            rule = next((r for r in self.rules if r[0] == name), None)
            if name in self.tables:
                merged[name] = resize_grid(old, self.grid(self.size), self.grid(size), strategy, reserved=self.prefix,
                                           params={"antialias": antialias})
            elif name in self.relative:
                merged[name] = resize_relative(old, tensor.shape[0])
            elif rule is not None:
                merged[name] = BufferRule("", rule[1], rule[2]).rebuild(old, new_rows)
            else:
                merged[name] = old if old is not None and old.shape == tensor.shape else tensor
        model.load_state_dict(merged)
        return model

    def method(self, square: bool) -> tuple[str, bool, str, bool]:
        """``(strategy, antialias, reference, square)`` of the family, observed."""
        sizes = self.sizes(square)
        path = self._run_time_module(sizes[0])
        if path is None:
            return self._load_and_run(sizes, square)
        wide = None if square else sizes[-1]
        expected = {}
        for size in sizes:
            try:
                expected[size] = self._output(self.source, path, size, interpolate=True)
            except Exception as exc:  # its own run-time path fails at this size
                if size == wide:
                    square = True  # its run-time path handles square images only
                    continue
                raise UnsupportedArchitectureError(
                    f"{self.model_type}: its run-time interpolate_pos_encoding fails at {size[0]}x{size[1]} "
                    f"({twin._first_line(exc)}), so what a resized grid must compute is unknown."
                ) from None
        diffs: dict[tuple[str, bool], dict[tuple[int, int], float]] = {}
        outputs: dict[tuple[str, bool], dict[tuple[int, int], torch.Tensor]] = {}
        for candidate in CANDIDATES:
            diffs[candidate], outputs[candidate] = {}, {}
            for size, want in expected.items():
                try:
                    got = self._output(self.resized(size, *candidate), path, size, interpolate=False)
                except Exception as exc:  # a twin at the new size that does not run
                    raise UnsupportedArchitectureError(
                        f"{self.model_type}: a twin with its grid resized to {size[0]}x{size[1]} does not run "
                        f"({twin._first_line(exc)})."
                    ) from None
                outputs[candidate][size] = got
                diffs[candidate][size] = float((got - want).abs().max()) if got.shape == want.shape else float("inf")
        square_sizes = [s for s in expected if s != wide]
        fits = [c for c in CANDIDATES if all(diffs[c][s] <= TOLERANCE for s in expected)]
        if not fits and wide in expected:  # it resamples square images the same way, non-square ones otherwise
            fits = [c for c in CANDIDATES if all(diffs[c][s] <= TOLERANCE for s in square_sizes)]
            square = square or bool(fits)
            expected.pop(wide)
        if not fits:
            best = min(CANDIDATES, key=lambda c: max(diffs[c].values()))
            raise UnsupportedArchitectureError(
                f"{self.model_type}: its run-time interpolation (interpolate_pos_encoding) is none of "
                f"{', '.join(_label(c) for c in CANDIDATES)} (nearest: {_label(best)}, off by up to "
                f"{max(diffs[best].values()):.2g} in the output); a resized table would not compute what it computes."
            )
        first = fits[0]
        for other in fits[1:]:
            if any(float((outputs[other][s] - outputs[first][s]).abs().max()) > TOLERANCE for s in expected):
                raise UnsupportedArchitectureError(
                    f"{self.model_type}: both {_label(first)} and {_label(other)} reproduce its run-time "
                    "interpolation but differ from each other; which one it does is ambiguous."
                )
        return first[0], first[1], "run-time", square

    def _load_and_run(self, sizes: list[tuple[int, int]], square: bool) -> tuple[str, bool, str, bool]:
        """No run-time path: a twin with its grid resized (bicubic) must load and run at each new size."""
        wide = None if square else sizes[-1]
        for size in sizes:
            try:
                twin.run_pixels(self.resized(size, "bicubic", False), self.tables, size, self.channels)
            except Exception as exc:
                if size == wide:
                    square = True
                    continue
                raise UnsupportedArchitectureError(
                    f"{self.model_type}: a twin with its grid resized to {size[0]}x{size[1]} does not run "
                    f"({twin._first_line(exc) if not isinstance(exc, RuntimeError) else str(exc)[:300]})."
                ) from None
        return "bicubic", False, "load-and-run", square

    def _run_time_module(self, size: tuple[int, int]) -> str | None:
        """The outermost module around the tables that takes ``pixel_values`` and ``interpolate_pos_encoding``
        and runs on them alone at ``size``; None when none takes both."""
        offered = False
        for path in twin._paths_around(self.tables):
            module = self.source.get_submodule(path) if path else self.source
            if not (twin._accepts(module, "pixel_values") and twin._accepts(module, "interpolate_pos_encoding")):
                continue
            offered = True
            try:
                self._output(self.source, path, size, interpolate=True)
            except Exception as exc:  # needs more than pixels (input_ids): the next module inside
                log.debug("%s: %s: %s", self.model_type, path, twin._first_line(exc))
                continue
            return path
        if offered:
            log.debug("%s: interpolate_pos_encoding is offered but no module runs on pixels alone", self.model_type)
        return None

    def _output(self, model: nn.Module, path: str, size: tuple[int, int], *, interpolate: bool) -> torch.Tensor:
        import torch

        module = model.get_submodule(path) if path else model
        pixels = torch.randn(1, self.channels, *size, generator=torch.Generator().manual_seed(1))
        kwargs = {"interpolate_pos_encoding": True} if interpolate else {}
        torch.manual_seed(0)  # families that draw (ViT-MAE's patch order) draw the same
        with torch.no_grad(), twin._quiet():
            out = module(pixel_values=pixels, **kwargs)
        return twin.main_tensor(out)


def _label(candidate: tuple[str, bool]) -> str:
    return f"{candidate[0]}{' with antialias' if candidate[1] else ''}"


# ----------------------------------------------------------------------------- in memory


def sync_derived_buffers(model: nn.Module) -> list[str]:
    """After an in-memory grid resize (config already updated): set the non-persistent buffers a model
    computes from its config at construction (OWL-ViT's ``box_bias``) and the patch counts its modules copy
    (``num_patches_height``/``_width``), as a model built from the new config holds them. Returns the
    buffers set. Raises :class:`UnsupportedArchitectureError` when such a buffer depends on the twin's
    random init or width (it cannot be recomputed here).
    """
    import torch

    config = model.config.to_dict()
    cls = type(model)
    expected = twin.meta_shapes(config, cls, saved=False)
    stale = [name for name, buf in model.named_buffers()
             if name in expected and tuple(buf.shape) != expected[name]
             and name.rpartition(".")[2] in model.get_submodule(name.rpartition(".")[0])._non_persistent_buffers_set]
    meta = twin.build(config, device="meta", cls=cls)
    counts = {n: {k: getattr(m, k) for k in ("num_patches_height", "num_patches_width") if hasattr(m, k)}
              for n, m in meta.named_modules()}
    for name, module in model.named_modules():
        for key, value in counts.get(name, {}).items():
            setattr(module, key, value)
    if not stale:
        return []
    small = twin.shrink(config)
    a, b = (dict(twin.build(small, cls=cls, seed=s).named_buffers()) for s in (0, 1))
    for name in stale:
        new = a.get(name)
        if new is None or tuple(new.shape) != expected[name] or not torch.equal(new, b[name]):
            raise UnsupportedArchitectureError(
                f"{config.get('model_type')}: buffer {name} follows the image size and is computed at construction "
                "from more than the config; save the model and resize the file instead.")
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        old = getattr(owner, attr)
        owner.register_buffer(attr, new.to(dtype=old.dtype, device=old.device), persistent=False)
    return stale
