"""Image-patch grids no spec states, observed on twins of the model (see :mod:`posextend.families.twin`).

:func:`observe_grids` derives a family's grid specs from its own code, as :mod:`.probe` does for
1-D tables: for every (sub-)config holding an ``image_size`` and a ``patch_size``
(:mod:`posextend.families.grid_fields`), meta twins at the config's image size and two patches larger per
side show which learned tables follow it (their rows move as ``prefix + (H/p)*(W/p)`` with the same prefix
at both sizes) and which buffers do (:mod:`posextend.families.grid_buffers` finds the rule that rebuilds
each); a twin at ``[h, w + 2p]`` shows whether non-square images are handled. Then the family's method is
observed, not assumed (:mod:`posextend.families.grid_resampling`): where the module around the table takes
``interpolate_pos_encoding``, a tiny twin's run-time output at new sizes must equal that of a twin whose
table was resized by exactly one candidate resampling; a family without a run-time path must load and run
with a resized table. Anything inconclusive is refused with the reason. A family that adapts one learned
grid to each image on every forward (:mod:`posextend.families.run_time_grids`: a tiny twin runs on two image
sizes, fed pixels or patch sequences with their grid as Qwen-VL's ``grid_thw``, with one table that it uses)
is refused with :class:`RunTimeGridError`: there is nothing on disk to resize.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from posextend.errors import RunTimeGridError, UnsupportedArchitectureError
from posextend.families import configs, twin, twin_runs
from posextend.families.grid_buffers import buffer_rules
from posextend.families.grid_fields import STEP, FieldFacts, image_fields
from posextend.families.grid_resampling import ResamplingProbe, check_relative
from posextend.families.not_learned import positions_kind_problem
from posextend.families.run_time_grids import adapted_per_image
from posextend.families.specs import IMAGE_COUNT_FIELD, ArchitectureSpec, BufferRule, GridSpec, same_form, table_rows

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger(__name__)


def observe_grids(config: Mapping[str, Any], cls: type | None = None) -> tuple[ArchitectureSpec, ...]:
    """The specs of the image-patch grids of a family without a written grid spec, observed on twins.

    Returns ``()`` at once for a config without a patch size, and for one without an image size whose
    twin shows no grid used at two image sizes. Raises :class:`RunTimeGridError` when the family adapts
    its grid to each image on every forward, :class:`UnsupportedArchitectureError` naming what was
    inconclusive when it has an image size but no grid can be resized safely.
    """
    if not any("patch_size" in sub for _, sub in configs.sub_configs(config)):
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
    adapted = adapted_per_image(config, cls, failures, pixels=not reasons)
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
            moved = twin.meta_shapes(configs.set_path(config, key, 2 * configs.get_path(config, key)), cls, saved=False)
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
    if not any("patch_size" in sub for _, sub in configs.sub_configs(config)):
        return []
    try:
        model = twin.build(config, device="meta", cls=cls or twin.model_class(config))
    except Exception:  # a foreign constructor, or no class: no grid to speak of
        return []
    return [n for n, p in twin.absolute_position_tables(model) if twin.is_grid_shape(tuple(p.shape))]


def _rotary(config: Mapping[str, Any]) -> str:
    """``"<rotary embeddings> for its attention positions (...) and "`` when the config or a sub-config's
    positions are rotary (a RoPE language model or tower beside the grid), else ``""``."""
    problem = next((p for _, sub in configs.sub_configs(config)
                    if (p := positions_kind_problem(sub)) and "rotary" in p), None)
    if problem is None:
        return ""
    return (f"{problem} for its attention positions, which posextend does not resize (for longer inputs, use its "
            "own length scaling, e.g. rope_scaling), and ")


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

    facts = FieldFacts.of(config, cls, image_key, patch_key)
    model_type, old_value, up, ((h, w), (ph, pw)) = facts.model_type, facts.old_value, facts.up, facts.sizes
    shapes, saved = twin.meta_shapes(config, cls, saved=False), twin.meta_shapes(config, cls)
    moved = _shapes_at(config, cls, image_key, same_form(old_value, up))
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
    rules, derived = buffer_rules(small, facts, buffers, saved, (cells + prefix, up_cells + prefix))
    probe = ResamplingProbe(small, facts, tables, prefix, rules, source)
    probe.follow = _follow_fields(config, image_key, (h, w), (ph, pw))
    probe.relative = _relative_tables(small, cls, image_key, (h, w), (ph, pw)) if relative else ()
    strategy, antialias, reference, square = probe.method(square or bool(relative))
    reference = check_relative(probe, reference) if relative else reference
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


def _refuse_odd(facts: FieldFacts, tables: list[str], odd: list[str]) -> None:
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
    for path, sub in configs.sub_configs(config):
        for key, kind in _FOLLOW:
            if path + key != image_key and key in sub and configs.pair(sub[key]) == (size if kind == "image" else side):
                found.append((path + key, kind))
    return tuple(found)


def _relative_tables(small: dict[str, Any], cls: type, image_key: str, size: tuple[int, int],
                     patch: tuple[int, int]) -> tuple[str, ...]:
    """The relative-position tables of the tiny twin ``small`` that follow ``image_key`` (its global layers)."""
    grid = (size[0] // patch[0], size[1] // patch[1])
    up = (size[0] + STEP * patch[0], size[1] + STEP * patch[1])
    old = twin.meta_shapes(small, cls, saved=False)
    new = _shapes_at(small, cls, image_key, same_form(configs.get_path(small, image_key), up))
    return tuple(n for n, s in old.items() if new.get(n) != s
                 and _is_relative_table(s, new.get(n), grid, (up[0] // patch[0], up[1] // patch[1])))


def _counts(config: Mapping[str, Any], cells: int, prefix: int) -> tuple[tuple[str, int], ...]:
    """Config fields named as a count of image tokens that hold the patch count (with or without the
    prefix tokens): LLaVA's ``image_seq_length``, PaliGemma's ``num_image_tokens``; they follow the grid."""
    found = []
    for path, sub in configs.sub_configs(config):
        for key, value in sub.items():
            if (IMAGE_COUNT_FIELD.search(key) and isinstance(value, int) and not isinstance(value, bool)
                    and value in (cells, cells + prefix)):
                found.append((path + key, value - cells))
    return tuple(found)


def _shapes_at(config: Mapping[str, Any], cls: type, image_key: str, value: Any) -> dict[str, tuple[int, ...]]:
    return twin.meta_shapes(configs.set_path(config, image_key, value), cls, saved=False)


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
        small = configs.shrink(config, widths=widths)
        try:
            model = twin.build(small, cls=cls)
            twin_runs.run_pixels(model, tables, size, twin_runs.num_channels(small))
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
