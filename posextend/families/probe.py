"""Facts no spec states, observed on twins of the model (see :mod:`posextend.families.twin`).

:func:`observe` derives the specs of a model type from its own code: for every length-like
config field (nested ones included), meta twins at two values show which tensors follow it;
a tiny twin's lookups show which rows positions ``0..n-1`` use (the first is the number of
reserved rows); tiny twins at two values show how each buffer that follows is rebuilt.
Anything inconclusive is refused with the reason.

:func:`verify` checks a written checkpoint: a twin of the *written* config must have the
written tensors' shapes, and a tiny twin of it must run at the full new length.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from posextend.families import configs, twin, twin_runs
from posextend.errors import UnsupportedArchitectureError, VerificationError
from posextend.families.specs import ArchitectureSpec, BufferRule, table_rows

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

DELTA = 7  # how far the second twin's length field moves (odd, so no tensor matches by chance)
LOOKUP_TOKENS = 5
BEHAVIOUR_TOKENS = 1024  # the longest input on which a moved length field must not change outputs
_LENGTH_FIELD = re.compile(r"(position|positions|ctx|seq_len|block_size|context_length|max_len)", re.I)
_GROUP_NAMES = {"max_target_positions": "decoder", "max_decoder_position_embeddings": "decoder",
                "max_source_positions": "encoder", "max_encoder_position_embeddings": "encoder"}


def length_fields(config: Mapping[str, Any]) -> list[str]:
    """Integer config fields (nested included) whose name says they may size positions."""
    fields = []
    for prefix, sub in configs.sub_configs(config):
        for key, value in sub.items():
            if isinstance(value, int) and not isinstance(value, bool) and value > LOOKUP_TOKENS and _LENGTH_FIELD.search(key):
                fields.append(prefix + key)
    return fields


def group_name(path: str) -> str:
    """What a user calls the tables one field drives: ``text``, ``encoder``, ``decoder`` or ``model``."""
    head, _, leaf = path.rpartition(".")
    if head:
        first = head.split(".")[0]
        return first.removesuffix("_config") or first
    return _GROUP_NAMES.get(leaf, "model")


def observe(config: Mapping[str, Any], cls: type | None = None) -> tuple[ArchitectureSpec, ...]:
    """The specs (one per length field that drives a learned table) observed on twins.

    Raises :class:`UnsupportedArchitectureError` naming what was inconclusive when no field
    drives a table whose lookups follow the token positions.
    """
    return _observe(json.dumps(dict(config), sort_keys=True, default=str), _qualname(cls))


def _qualname(cls: type | None) -> str | None:
    return f"{cls.__module__}.{cls.__qualname__}" if cls else None


@functools.lru_cache(maxsize=32)
def _observe(config_json: str, cls_name: str | None) -> tuple[ArchitectureSpec, ...]:
    config = json.loads(config_json)
    cls = twin._resolve(cls_name) or twin.model_class(config)
    model_type = config.get("model_type", "?")
    base_all = twin.meta_shapes(config, cls, saved=False)
    params = _param_names(config, cls)
    base = twin.base_prefix(config, cls)
    specs, reasons = [], []
    claimed: dict[str, str] = {}
    for path in length_fields(config):
        value = configs.get_path(config, path)
        moved_config = configs.set_path(config, path, value + DELTA)
        try:
            moved = twin.meta_shapes(moved_config, cls, saved=False)
        except UnsupportedArchitectureError as exc:
            reasons.append(f"{path}: {exc}")
            continue
        changed = {n: (s, moved.get(n)) for n, s in base_all.items() if moved.get(n) != s}
        if not changed:
            continue
        try:
            spec = _group(config, cls, path, value, changed, params, base)
        except UnsupportedArchitectureError as exc:
            reasons.append(str(exc))
            continue
        if spec is None:
            continue
        claim(claimed, spec, path)
        specs.append(spec)
    if not specs:
        why = "; ".join(reasons) if reasons else "no config field changes the size of a learned table"
        raise UnsupportedArchitectureError(
            f"No spec for model type {model_type!r}, and its twin shows no position table posextend can resize "
            f"safely ({why})."
        )
    return tuple(specs)


def claim(claimed: dict[str, str], spec: ArchitectureSpec, field: str) -> None:
    """Record that ``field`` sizes ``spec``'s tables; refuse a table two fields claim (ambiguous)."""
    for t in spec.tables:
        if t in claimed:
            raise UnsupportedArchitectureError(
                f"{spec.model_type}: table {t} follows both {claimed[t]} and {field}; which one sizes it is ambiguous."
            )
        claimed[t] = field


def _relative(name: str, base: str) -> str:
    """``name`` relative to the base model (``mpnet.embeddings.x`` -> ``embeddings.x``), so that a
    checkpoint saved bare or with any head of that base matches; names outside the base stay whole."""
    return name.removeprefix(base + ".") if base else name


def _name_pattern(name: str, base: str) -> str:
    """A regex for ``name`` (relative to ``base``) as a headed or a bare checkpoint holds it."""
    relative = _relative(name, base)
    head = rf"(?:{re.escape(base)}\.)?" if base and relative != name else ""
    return rf"^{head}{re.escape(relative)}$"


def _param_names(config: Mapping[str, Any], cls: type) -> frozenset[str]:
    model = twin.build(config, device="meta", cls=cls)
    return frozenset(n for n, _ in model.named_parameters())


def _group(
    config: dict[str, Any], cls: type, path: str, value: int,
    changed: dict[str, tuple[tuple[int, ...], tuple[int, ...] | None]],
    params: frozenset[str], base: str,
) -> ArchitectureSpec | None:
    """The spec of the tables and buffers that ``path`` drives, or None if it drives no lookup table.

    Names in the spec are relative to the base model ``base`` (see :func:`_relative`)."""
    model_type = config.get("model_type", "?")
    tables, buffers, odd = [], [], []
    for name, (old, new) in changed.items():
        if new is None or len(new) != len(old):
            odd.append(f"{name} {list(old)} -> {new and list(new)}")
        elif len(old) == 2 and new == (old[0] + DELTA, old[1]) and name in params:
            tables.append(name)
        else:
            buffers.append(name)
    if not tables:
        return None  # the field sizes something, but no learned table (e.g. a rotary cache)
    rows = changed[tables[0]][0][0]
    if any(changed[t][0][0] != rows for t in tables):
        raise UnsupportedArchitectureError(f"{model_type}: the tables {path} drives have different lengths.")
    companions = [b for b in buffers if changed[b] == changed[tables[0]]]  # e.g. I-BERT's weight_integer
    buffers = [b for b in buffers if b not in companions]
    if odd:
        raise UnsupportedArchitectureError(f"{model_type}: {path} also changes {', '.join(odd[:3])}.")
    first, small_config = _first_row(config, cls, tables, model_type, path)
    if first is None:
        return None  # its lookups do not follow token positions (e.g. LayoutLM's 2-D box tables)
    usable = rows - first
    if value == rows:
        counts_reserved = True
    elif value == usable:
        counts_reserved = False
    else:
        raise UnsupportedArchitectureError(
            f"{model_type}: {path}={value} but its table has {rows} rows with positions starting at row {first}; "
            "how the field counts positions is ambiguous."
        )
    rules = _buffer_rules(small_config, cls, path, value, buffers, base)
    _check_only_tables_follow(small_config, cls, path, value, tables + companions, first, model_type)
    return ArchitectureSpec(
        model_type=model_type, prefix=base, tables=tuple(_relative(t, base) for t in tables + companions),
        length_keys=(path,), reserved=first,
        config_counts_reserved=counts_reserved, buffers=rules,
        note="probed", group=group_name(path),
    )


def _first_row(
    config: Mapping[str, Any], cls: type, tables: list[str], model_type: str, path: str,
) -> tuple[int | None, dict[str, Any]]:
    """The first row positions ``0..n-1`` use (after checking they use consecutive rows), and the
    tiny twin's config."""
    import torch

    try:
        used, small_config = twin_runs.tiny_lookups(config, cls, tables, LOOKUP_TOKENS)
    except RuntimeError as exc:
        raise UnsupportedArchitectureError(
            f"{model_type}: cannot run the module around {tables[0]} to see which rows positions use ({exc})."
        ) from None
    for name, rows in used.items():
        start = int(rows[0])
        if not torch.equal(rows[:LOOKUP_TOKENS], torch.arange(start, start + LOOKUP_TOKENS)):
            log.debug("%s: %s is looked up at rows %s, not by position", model_type, name, rows.tolist()[:10])
            return None, small_config
    for name, rows in used.items():
        first = _counting_run(rows)  # the first lookup (LED's runs on, over the padding to its attention window)
        last, later = int(rows[first - 1]), rows[first:]
        if later.numel() and int(later.max()) > last:  # a later lookup past the positions' rows: fewer fit
            raise UnsupportedArchitectureError(
                f"{model_type}: positions use rows {int(rows[0])}..{last} of {name}, but the model also looks up "
                f"row {int(later.max())} (a decoder stream that reads the next position's row), so "
                f"{int(later.max()) - last} row(s) past the last position are needed and {path} does not say how "
                "many positions fit; a resized table would fail at its full length."
            )
    starts = {int(rows[0]) for rows in used.values()}
    if len(starts) != 1:
        raise UnsupportedArchitectureError(f"{model_type}: the tables {path} drives start at different rows {starts}.")
    return starts.pop(), small_config


def _counting_run(rows: torch.Tensor) -> int:
    """How many leading entries of ``rows`` count up by one from ``rows[0]`` (the first lookup, when
    :func:`posextend.families.twin_runs.run_lookups` gives every lookup of a forward one after another)."""
    import torch

    steps = torch.nonzero(rows[1:] - rows[:-1] != 1)
    return int(steps[0]) + 1 if steps.numel() else rows.numel()


def _check_only_tables_follow(
    small_config: dict[str, Any], cls: type, path: str, value: int, tables: list[str], reserved: int, model_type: str,
) -> None:
    """A twin at the moved length, given the first twin's weights with its tables tiled, must compute
    the same outputs on an input of the old length (up to :data:`BEHAVIOUR_TOKENS`): the field sizes
    the tables and changes nothing else.

    (DeBERTa-v2 with relative buckets fails this: ``max_position_embeddings`` also sets the scale
    of its log-bucketed relative positions, which no tensor's shape shows.)
    """
    import torch

    a = twin.build(small_config, cls=cls)
    b = twin.build(configs.set_path(small_config, path, value + DELTA), cls=cls)
    old = a.state_dict()
    merged = {}
    for name, tensor in b.state_dict().items():
        src = old.get(name)
        if name in tables and src is not None:
            usable = src.shape[0] - reserved
            merged[name] = src[torch.cat([torch.arange(reserved), reserved + torch.arange(tensor.shape[0] - reserved) % usable])]
        else:  # unchanged tensors from the first twin; buffers that follow the length are the twin's own
            merged[name] = src if src is not None and src.shape == tensor.shape else tensor
    b.load_state_dict(merged)
    rows = next(tensor.shape[0] for name, tensor in old.items() if name in tables)
    n = min(rows - reserved, BEHAVIOUR_TOKENS)  # the old length: relative buckets differ only far apart
    ids = twin_runs.random_tokens(small_config, n)
    try:
        _, module = twin_runs.run_lookups(a, tables, n, token=twin_runs.safe_token(small_config))
        x, y = twin_runs.forward_output(a, module, ids), twin_runs.forward_output(b, module, ids)
    except Exception as exc:  # a foreign forward
        raise UnsupportedArchitectureError(
            f"{model_type}: a twin does not run on {n} tokens ({twin._first_line(exc)}), so it cannot be checked "
            f"that {path} changes nothing but the tables."
        ) from None
    if x.shape != y.shape:  # the output follows the table's length, not the input's
        raise UnsupportedArchitectureError(
            f"{model_type}: changing {path} changes the shape of the model's output on a {n}-token input "
            f"({list(x.shape)} -> {list(y.shape)}): the model uses a table whole, one output per row (Perceiver's "
            "decoder queries), so a resized table would change every output, not only what the new positions add."
        )
    if not torch.equal(x, y):
        raise UnsupportedArchitectureError(
            f"{model_type}: changing {path} changes the model's outputs on short inputs by up to "
            f"{float((x - y).abs().max()):.2g} even with its "
            "tables' rows kept: the field also sets something no tensor shape shows (e.g. the scale of relative "
            "position buckets), so a longer table would change the model."
        )


def _buffer_rules(
    small_config: dict[str, Any], cls: type, path: str, value: int, buffers: list[str], base: str,
) -> tuple[BufferRule, ...]:
    """How each buffer that follows the field is rebuilt: the one rule that reproduces a twin's."""
    if not buffers:
        return ()
    model_type = small_config.get("model_type", "?")
    a = dict(twin.build(small_config, cls=cls).named_buffers())
    b = dict(twin.build(configs.set_path(small_config, path, value + DELTA), cls=cls).named_buffers())
    rules = []
    for name in buffers:
        old, new = a.get(name), b.get(name)
        if old is None or new is None:
            raise UnsupportedArchitectureError(f"{model_type}: {name} follows {path} but is not a buffer posextend can rebuild.")
        offset = old.shape[-1] - value
        found = [kind for kind in ("arange", "zeros", "toeplitz")
                 if _reproduces(BufferRule("", kind, offset), old, new, value + DELTA)]
        if len(found) != 1:
            raise UnsupportedArchitectureError(
                f"{model_type}: buffer {name} {list(old.shape)} follows {path}, and "
                + ("no rule (arange, zeros, causal mask) rebuilds it." if not found else f"several rules fit ({found}).")
            )
        rules.append(BufferRule(_name_pattern(name, base), found[0], offset))
    return tuple(rules)


def _reproduces(rule: BufferRule, old: torch.Tensor, new: torch.Tensor, value: int) -> bool:
    import torch

    try:
        if rule.new_shape(tuple(old.shape), value) != tuple(new.shape):
            return False
        return torch.equal(rule.rebuild(old, value), new)
    except (RuntimeError, IndexError, ValueError):
        return False


# ----------------------------------------------------------------------------- verification


def verify(
    directory: Path, spec: ArchitectureSpec, tables: list[str], shapes: Mapping[str, tuple[int, ...]],
    source_shapes: Mapping[str, tuple[int, ...]], usable: int, reserved: int, cls: type | None = None,
) -> None:
    """Check a written checkpoint against a twin of its written config; raise VerificationError.

    ``shapes``: the written tensors; ``source_shapes``: the source's (a tensor of the model
    the source had must be written).
    """
    config = json.loads((directory / "config.json").read_text())
    _check_shapes(config, spec, tables, shapes, source_shapes, cls)
    try:
        used, _ = twin_runs.tiny_lookups(config, cls, tables, usable, whole=True)
    except RuntimeError as exc:
        raise VerificationError(
            f"A twin of the written {spec.model_type} checkpoint fails at its full length {usable} ({exc}); "
            "nothing was written."
        ) from None
    import torch

    for name, rows in used.items():
        if not torch.equal(rows[:usable], torch.arange(reserved, reserved + usable)):
            raise VerificationError(
                f"A twin of the written {spec.model_type} checkpoint looks up {name} at rows "
                f"{int(rows[0])}..{int(rows[:usable].max())} for {usable} positions, not "
                f"{reserved}..{reserved + usable - 1}; nothing was written."
            )


def verify_grid(
    directory: Path, spec: ArchitectureSpec, tables: list[str], shapes: Mapping[str, tuple[int, ...]],
    source_shapes: Mapping[str, tuple[int, ...]], size: tuple[int, int], rows: int, cls: type | None = None,
) -> None:
    """Check a written image-grid checkpoint: a twin of its written config has the written shapes,
    a table of ``rows`` rows, and a tiny twin runs on an image of ``size`` without resampling
    its positions (so it uses the written grid as it is); raise VerificationError."""
    config = json.loads((directory / "config.json").read_text())
    _check_shapes(config, spec, tables, shapes, source_shapes, cls)
    small = configs.shrink(config)
    try:
        model = twin.build(small, cls=cls)
        found = {n: table_rows(tuple(t.shape)) for n, t in [*model.named_parameters(), *model.named_buffers()]
                 if n in tables and not spec.is_relative(n)}  # relative companions: checked by the shapes
        if any(r != rows for r in found.values()) or not found:
            raise RuntimeError(f"its tables have {sorted(set(found.values()))} rows, not {rows}")
        twin_runs.run_pixels(model, tables, size, twin_runs.num_channels(small))
    except (RuntimeError, ValueError) as exc:
        raise VerificationError(
            f"A twin of the written {spec.model_type} checkpoint does not run at its image size "
            f"{size[0]}x{size[1]} ({exc}); nothing was written."
        ) from None


def _check_shapes(
    config: Mapping[str, Any], spec: ArchitectureSpec, tables: list[str], shapes: Mapping[str, tuple[int, ...]],
    source_shapes: Mapping[str, tuple[int, ...]], cls: type | None,
) -> None:
    """Every written tensor has the shape a twin of the written config expects, and none is lost."""
    expected = twin.meta_shapes(config, cls)
    # Names on disk can differ from the model's (transformers renames some on load, e.g. LayerNorm.gamma):
    # shapes are compared where the names agree, which covers every tensor a length field sizes.
    wrong = [f"{n}: written {list(s)}, model expects {list(expected[n])}" for n, s in shapes.items()
             if n in expected and expected[n] != s]
    missing = [n for n in tables if n not in expected]
    lost = [n for n in source_shapes if n not in shapes and n in expected]
    problems = wrong + [f"{n}: not a tensor of the model" for n in missing] + [f"{n}: not written" for n in lost]
    if problems:
        raise VerificationError(
            f"The written {spec.model_type} checkpoint does not match its own config ({'; '.join(problems[:3])}); "
            "nothing was written. Please report this model type."
        )
