"""Architecture specs: the one place that knows where each family keeps its positions.

Both the file path (``resize_checkpoint``) and the in-memory path (``extend_model``)
read these specs; nothing else in the package names a model family.

Lengths are in *usable* positions (what a tokenizer's ``model_max_length`` holds).
``rows = usable + reserved`` where ``reserved`` are leading rows that no token
position ever uses directly (RoBERTa's padding rows, OPT/BART's offset of 2).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from posextend.errors import CorruptCheckpointError, InvalidLengthError
from posextend.families.twin import get_path, pair

if TYPE_CHECKING:
    import torch

BufferKind = Literal["arange", "zeros", "toeplitz"]


@dataclass(frozen=True)
class BufferRule:
    """A buffer whose trailing dimension(s) follow the config's length value ``n``.

    (``n`` is what the spec's first length key holds: the rows for BERT, GPT-2 and
    RoBERTa, the usable positions for Nystromformer-style models.)
    ``pattern`` is matched with ``re.search`` against the full tensor/buffer name.
    ``kind`` says how to rebuild it for a new ``n``:

    - ``arange``: ``[..., n]`` counting up from the old buffer's first value (``position_ids``);
    - ``zeros``: ``[..., n]`` of zeros (``token_type_ids``);
    - ``toeplitz``: ``[..., rows, rows]`` whose value depends only on ``i - j``
      (causal masks, GPT-Neo's local band); extended by its own boundary values.
    """

    pattern: str
    kind: BufferKind
    offset: int = 0  # the buffer's length minus the config value (observed by the probe)

    def matches(self, name: str) -> bool:
        return re.search(self.pattern, name) is not None

    def new_shape(self, shape: tuple[int, ...], rows: int) -> tuple[int, ...]:
        n = 2 if self.kind == "toeplitz" else 1
        return (*shape[:-n], *([rows + self.offset] * n))

    def rebuild(self, old: torch.Tensor, rows: int) -> torch.Tensor:
        """Return the buffer for config value ``rows``, same dtype, device and leading dims."""
        import torch

        rows += self.offset
        lead = old.shape[:-1]
        if self.kind == "arange":
            start = int(old.reshape(-1)[0]) if old.numel() else 0
            new = torch.arange(start, start + rows, dtype=old.dtype, device=old.device)
        elif self.kind == "zeros":
            new = torch.zeros(rows, dtype=old.dtype, device=old.device)
        else:
            return _extend_toeplitz(old, rows)
        return new.expand(*lead, rows).contiguous()


def _extend_toeplitz(old: torch.Tensor, rows: int) -> torch.Tensor:
    """Rebuild a ``[..., n, n]`` mask whose entries depend on ``i - j`` only, at ``rows``."""
    import torch

    n = old.shape[-1]
    if n == 0:
        raise CorruptCheckpointError("A causal-mask buffer has zero rows; the checkpoint is damaged.")
    flat = old.reshape(-1, n, n)[0]
    # value at offset k = i - j: column 0 for k >= 0, row 0 for k < 0 (clamped at the edges)
    diag_pos = flat[:, 0]  # k = 0..n-1
    diag_neg = flat[0, :]  # k = 0..-(n-1)
    i = torch.arange(rows, device=old.device)
    k = i[:, None] - i[None, :]
    out = torch.where(
        k >= 0,
        diag_pos[k.clamp(0, n - 1)],
        diag_neg[(-k).clamp(0, n - 1)],
    )
    return out.expand(*old.shape[:-2], rows, rows).contiguous()


@dataclass(frozen=True)
class Layout:
    """Where a spec found its tables and buffers in one model or checkpoint.

    ``grid``: the shape of the usable rows: ``(usable,)`` for a 1-D table, ``(H, W)`` patches
    for an image grid (``reserved`` are then its prefix tokens: class, distillation).
    """

    tables: tuple[str, ...]
    buffers: tuple[str, ...]
    dropped: tuple[str, ...]
    reserved: int
    usable: int
    grid: tuple[int, ...] = ()
    headed: bool = False  # the tables carry the base model's prefix (``mpnet.``); bare when False
    relative: tuple[str, ...] = ()  # of ``tables``: relative-position companions of a grid (SAM's rel_pos_h/w)

    @property
    def kind(self) -> str:
        """``headed`` (names under the base model's prefix, as a model with a head saves them) or
        ``bare`` (the base model's own names, as sentence-transformers saves them)."""
        return "headed" if self.headed else "bare"


# Config and processor fields that count an image's tokens (LLaVA's image_seq_length, PaliGemma's num_image_tokens)
IMAGE_COUNT_FIELD = re.compile(r"(image_tokens|image_seq_length|tokens_per_image|num_patches)$")


@dataclass(frozen=True)
class GridSpec:
    """How an image-patch grid maps to config fields: ``(image_size / patch_size)`` per side.

    - ``image_key`` / ``patch_key``: config fields (dotted for nested configs); each holds an
      int (square) or ``[height, width]``.
    - ``square``: the family's code only handles square images (CLIP, SigLIP, DINOv2).
    - ``antialias``: the family's run-time ``interpolate_pos_encoding`` antialiases (DINOv2 with
      registers); resampling strategies then do too unless told otherwise, to reproduce it.
    - ``strategy``: the family's own run-time resampling when it is not bicubic (DPT: bilinear);
      the default strategy for this family, so that a resized file computes what it computes.
    - ``reference``: how a probed grid (:mod:`.grid_probe`) was verified: ``run-time`` (a table resized
      with ``strategy``/``antialias`` computes what the family's own ``interpolate_pos_encoding`` does) or
      ``load-and-run`` (no run-time path: the resized twin loads and runs at the new size); ``""`` when written.
    - ``counts``: other config fields that count the image's patches, ``(field, extra)``: the field holds
      ``patches + extra`` (LLaVA's ``image_seq_length``) and follows the new grid.
    - ``relative``: relative-position tables ``[2 * side - 1, head_dim]`` that follow the grid's side (SAM's
      global-attention ``rel_pos_h`` / ``rel_pos_w``; names relative to the base model), resized linearly as the
      family resamples them at run time (:func:`.strategies.resize_relative`); square grids only.
    - ``follow``: other config fields that follow the image, ``(field, "image" | "side")``: the field holds the
      image size (SAM's ``prompt_encoder_config.image_size``) or the grid's side (``image_embedding_size``).
    """

    image_key: str = "image_size"
    patch_key: str = "patch_size"
    square: bool = False
    antialias: bool = False
    strategy: str | None = None
    reference: str = ""
    counts: tuple[tuple[str, int], ...] = ()
    relative: tuple[str, ...] = ()
    follow: tuple[tuple[str, str], ...] = ()

    def sizes(self, config: Mapping[str, Any]) -> tuple[tuple[int, int], tuple[int, int]]:
        """``((height, width), (patch_h, patch_w))`` from ``config``."""
        image, patch = get_path(config, self.image_key), get_path(config, self.patch_key)
        sizes = [pair(image), pair(patch)]
        if sizes[0] is None or sizes[1] is None:
            raise CorruptCheckpointError(
                f"config.json has no usable {self.image_key!r} ({image!r}) or {self.patch_key!r} ({patch!r}); "
                "add the image and patch sizes the model was trained with."
            )
        return sizes[0], sizes[1]

    def grid(self, config: Mapping[str, Any], image_size: tuple[int, int] | None = None) -> tuple[int, int]:
        """The patch grid of ``config``'s image size, or of ``image_size`` (checked to fit the family)."""
        (h, w), (ph, pw) = self.sizes(config)
        if image_size is None:
            return h // ph, w // pw
        h, w = image_size
        if h <= 0 or w <= 0 or h % ph or w % pw:
            raise InvalidLengthError(
                f"The image size {h}x{w} must be a positive multiple of the patch size {ph}x{pw}; "
                f"e.g. {max(ph, h // ph * ph)}x{max(pw, w // pw * pw)}."
            )
        if self.square and h != w:
            raise InvalidLengthError(
                f"This family's code handles square images only; give one size (e.g. {h}), not {h}x{w}."
            )
        return h // ph, w // pw

    def config_updates(self, config: Mapping[str, Any], image_size: tuple[int, int]) -> dict[str, Any]:
        """The image-size field for ``image_size`` (an int when square and the field was an int), the counts
        and the fields that follow the image or its grid's side, each in its own form."""
        h, w = image_size
        (ph, pw) = self.sizes(config)[1]
        counts = {key: (h // ph) * (w // pw) + extra for key, extra in self.counts}
        follow = {key: (h, w) if kind == "image" else (h // ph, w // pw) for key, kind in self.follow}
        fields = {self.image_key: (h, w), **follow}
        return {**{key: _same_form(get_path(config, key), v) for key, v in fields.items()}, **counts}


def _same_form(old: Any, value: tuple[int, int]) -> int | list[int]:
    """``value`` as an int when square and ``old`` was an int, else ``[height, width]``."""
    return value[0] if value[0] == value[1] and isinstance(old, int) else [value[0], value[1]]


def names_on_load(names: set[str] | frozenset[str], config: Mapping[str, Any]) -> dict[str, str]:
    """``{name transformers loads it as: file name}`` for each of a file's tensors that the family's own
    conversion mapping renames on loading (and back on saving: Step3p7's and Qianfan-OCR's vision towers),
    with and without the base model's prefix; empty when it renames none."""
    import json

    rules = _conversion_rules(json.dumps(dict(config), sort_keys=True, default=str))
    if not rules:
        return {}
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    renamings = [r for r in rules[1] if isinstance(r, WeightRenaming)]
    converters = [r for r in rules[1] if isinstance(r, WeightConverter)]
    out: dict[str, str] = {}
    for name in names:
        new, converted = rename_source_key(name, renamings, converters)
        if new != name and converted is None:  # renamed only: a converter splits or merges the tensor
            out[new] = name
            if rules[0] and new.startswith(rules[0] + "."):
                out[new.removeprefix(rules[0] + ".")] = name
    return out


@functools.lru_cache(maxsize=16)
def _conversion_rules(config_json: str) -> tuple[str, tuple] | None:
    """The base model prefix and the weight conversions transformers applies when loading a model of this
    config (observed on a meta twin); None when there are none or no twin builds."""
    import json

    from transformers.conversion_mapping import get_model_conversion_mapping

    from posextend.families.twin import build

    try:
        model = build(json.loads(config_json), device="meta")
        rules = tuple(get_model_conversion_mapping(model))
    except Exception:  # a foreign constructor: nothing is renamed that posextend can know
        return None
    return (model.base_model_prefix, rules) if rules else None


def _missing_table(model_type: str, options: tuple[str, ...], names: frozenset[str] | set[str],
                   config: Mapping[str, Any] | None) -> str:
    """Why a table was not found: the names looked for, the nearest names the checkpoint holds, and
    whether its weights are this family's at all (a twin of ``config`` knows its names)."""
    import difflib

    looked = " or ".join(repr(o) for o in options)
    tail = ".".join(options[0].split(".")[-2:])  # position_embeddings.weight
    leaf = options[0].rpartition(".")[2]  # pos_embed: a table named by itself (not .weight), renamed around it
    near = sorted(n for n in names if n.endswith("." + tail))[:3] or difflib.get_close_matches(
        options[0], sorted(names), n=3, cutoff=0.75) or (
        sorted(n for n in names if n.endswith("." + leaf))[:3] if leaf not in ("weight", "bias") else [])
    if near:
        return (f"This {model_type} checkpoint has no position table {looked}; its nearest names are "
                f"{', '.join(repr(n) for n in near)}. The file names its tensors otherwise than the model's modules "
                "do (saved by other code, or renamed by transformers when saving), so which one is the table is not "
                "known: nothing was written. Please report this layout.")
    if config is not None and _family_share(config, names) >= 0.5:
        return (f"This {model_type} checkpoint holds a {model_type} model without its position table {looked} "
                "(a base model saved without the module that holds the positions): there is no table to resize; "
                "save the model with the module that holds it.")
    return (f"This {model_type} checkpoint has no position table {looked}, and no name like it among its "
            f"{len(names)} tensors: the weights do not look like a {model_type} model; check config.json's "
            "model_type.")


def _family_share(config: Mapping[str, Any], names: frozenset[str] | set[str]) -> float:
    """The share of ``names`` that a twin of ``config`` saves, in the layout that matches best."""
    from posextend.errors import UnsupportedArchitectureError
    from posextend.families.twin import layout_class, meta_shapes

    try:
        cls, add = layout_class(config, names)
        expected = meta_shapes(config, cls)
    except UnsupportedArchitectureError:
        return 0.0
    return sum(add + n in expected for n in names) / max(1, len(names))


def table_rows(shape: tuple[int, ...]) -> int | None:
    """The rows of a table stored as ``[rows, dim]``, ``[1, rows, dim]`` (ViT's Parameter) or ``[1, H, W, dim]``
    (SAM's grid, ``H * W`` rows); else None."""
    if len(shape) == 2 or (len(shape) == 3 and shape[0] == 1):
        return shape[-2]
    if len(shape) == 4 and shape[0] == 1:
        return shape[1] * shape[2]
    return None


@dataclass(frozen=True)
class ArchitectureSpec:
    """Where one family keeps its learned absolute position table(s).

    - ``tables``: tensor names relative to the base model (``wpe.weight``); in a
      checkpoint of a headed model they appear under ``prefix`` (``transformer.wpe.weight``).
      Companion tensors that follow a table row for row (I-BERT's ``weight_integer``) are tables too.
    - ``length_keys``: config fields holding the length, dotted for nested configs
      (``text_config.max_position_embeddings``); the first must be present, the others
      are updated when present (GPT-2's legacy ``n_ctx``).
    - ``reserved``: leading rows no token position uses (int, or a function of the config).
    - ``config_counts_reserved``: whether the config length includes the reserved rows
      (RoBERTa: ``max_position_embeddings = usable + pad_token_id + 1``).
    - ``buffers``: length-dependent buffers, rebuilt to the new number of rows.
    - ``dropped``: patterns of obsolete tensors left out of the output because current
      transformers rejects them as unexpected and no version needs them.
    - ``note``: ``""`` for a written spec, ``"probed"`` for one observed on twins (:mod:`.probe`).
    - ``group``: what a user calls these tables when a model has several lengths
      (``text``, ``encoder``, ``decoder``, ``vision``; ``model`` when it has one).
    - ``grid``: for an image-patch grid, how it maps to the config (:class:`GridSpec`); the
      ``reserved`` rows are then its prefix tokens and ``length_keys`` its image-size field.
    - ``optional``: tables of the same length that only some heads hold (ViT-MAE's pre-training
      decoder); resized when present.
    """

    model_type: str
    prefix: str
    tables: tuple[str, ...]
    length_keys: tuple[str, ...] = ("max_position_embeddings",)
    reserved: int | Callable[[Mapping[str, Any]], int] = 0
    config_counts_reserved: bool = False
    buffers: tuple[BufferRule, ...] = ()
    dropped: tuple[str, ...] = ()
    note: str = ""
    group: str = "model"
    grid: GridSpec | None = None
    optional: tuple[str, ...] = ()

    @property
    def rank(self) -> int:
        """1 for a table of positions, 2 for an image-patch grid."""
        return 1 if self.grid is None else 2

    def reserved_rows(self, config: Mapping[str, Any]) -> int:
        return self.reserved(config) if callable(self.reserved) else self.reserved

    @property
    def covered_by(self) -> str:
        """How this family is known: ``spec`` (written here) or ``probed`` (observed on a twin)."""
        return "probed" if self.note == "probed" else "spec"

    def table_names(self, names: set[str] | frozenset[str], config: Mapping[str, Any] | None = None) -> list[str]:
        """The full names of this spec's tables among ``names`` (bare or prefixed).

        Raises ``CorruptCheckpointError`` when a table is missing.
        """
        found = []
        for table in (*self.tables, *self.optional):
            options = (table, f"{self.prefix}.{table}") if self.prefix else (table,)
            candidates = [n for n in options if n in names]
            if not candidates and config is not None:  # a file whose names transformers renames on loading
                loaded = names_on_load(names, config)
                candidates = [loaded[n] for n in options if n in loaded]
            if not candidates and table in self.optional:
                continue
            if not candidates:
                raise CorruptCheckpointError(_missing_table(self.model_type, options, names, config))
            if len(candidates) > 1:
                raise CorruptCheckpointError(
                    f"Both {candidates[0]!r} and {candidates[1]!r} are present; "
                    "the checkpoint mixes a bare and a headed model."
                )
            found.append(candidates[0])
        return found

    def config_length(self, config: Mapping[str, Any]) -> int:
        key = self.length_keys[0]
        value = get_path(config, key)
        if not isinstance(value, int):
            raise CorruptCheckpointError(
                f"config.json of this {self.model_type} model has no integer {key!r}; "
                "add it (the number of positions the model was trained with)."
            )
        return value

    def grid_shape(self, config: Mapping[str, Any]) -> tuple[int, ...]:
        """The shape of the usable rows the config describes: ``(L,)`` or ``(H, W)`` patches."""
        return self.grid.grid(config) if self.grid else (self.usable_from_config(config),)

    def usable_from_config(self, config: Mapping[str, Any]) -> int:
        if self.grid:
            h, w = self.grid.grid(config)
            return h * w
        n = self.config_length(config)
        return n - self.reserved_rows(config) if self.config_counts_reserved else n

    def locate(self, shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, Any]) -> Layout:
        """Find this spec's tables and buffers among named tensor ``shapes``; check rows against config."""
        tables = self.table_names(frozenset(shapes), config)
        reserved = self.reserved_rows(config)
        rows = self.usable_from_config(config) + reserved
        grid = self.grid_shape(config)
        for name in tables:
            if table_rows(shapes[name]) != rows or (len(shapes[name]) == 4 and tuple(shapes[name][1:3]) != grid):
                source = (f"{self.grid.image_key}={get_path(config, self.grid.image_key)}, "
                          f"{self.grid.patch_key}={get_path(config, self.grid.patch_key)}" if self.grid
                          else f"{self.length_keys[0]}={self.config_length(config)}")
                raise CorruptCheckpointError(
                    f"{name} has shape {list(shapes[name])} but the config implies {rows} rows "
                    f"({source}, {reserved} reserved); the config and the weights disagree."
                )
        buffers = tuple(n for n in sorted(shapes) if any(rule.matches(n) for rule in self.buffers))
        dropped = tuple(n for n in sorted(shapes) if any(re.search(p, n) for p in self.dropped))
        headed = bool(self.prefix) and tables[0].startswith(self.prefix + ".")
        relative = self._relative_tables(shapes, grid, config)
        return Layout((*tables, *relative), buffers, dropped, reserved=reserved, usable=rows - reserved,
                      grid=grid, headed=headed, relative=relative)

    def _relative_tables(self, shapes: Mapping[str, tuple[int, ...]], grid: tuple[int, ...],
                         config: Mapping[str, Any]) -> tuple[str, ...]:
        """The grid's relative-position companions among ``shapes``, each ``[2 * side - 1, dim]``."""
        if not self.grid or not self.grid.relative:
            return ()
        spec = dataclasses.replace(self, tables=self.grid.relative, optional=())
        names = tuple(spec.table_names(frozenset(shapes), config))
        if grid[0] != grid[1]:
            raise CorruptCheckpointError(
                f"This {self.model_type} checkpoint has a {grid[0]}x{grid[1]} grid with relative-position tables "
                "that follow its side: only square grids are known; resize a square checkpoint.")
        wrong = [f"{n} {list(shapes[n])}" for n in names if len(shapes[n]) != 2 or shapes[n][0] != 2 * grid[0] - 1]
        if wrong:
            raise CorruptCheckpointError(
                f"{', '.join(wrong[:3])}: the config's {grid[0]}x{grid[1]} grid implies relative-position tables of "
                f"{2 * grid[0] - 1} rows; the config and the weights disagree.")
        return names

    def is_relative(self, name: str) -> bool:
        """Whether tensor ``name`` (bare, headed, or under a class's own prefix) is one of the grid's
        relative-position companions."""
        return bool(self.grid) and any(name == r or name.endswith("." + r) for r in self.grid.relative)

    def buffer_rule(self, name: str) -> BufferRule:
        return next(rule for rule in self.buffers if rule.matches(name))

    def config_value(self, config: Mapping[str, Any], usable: int) -> int:
        """What the first length key holds for ``usable`` positions (buffers follow it too).

        For a grid: the rows, prefix tokens included (what CLIP's ``position_ids`` counts).
        """
        return usable + self.reserved_rows(config) if self.config_counts_reserved or self.grid else usable

    def config_updates(self, config: Mapping[str, Any], usable: int | tuple[int, int]) -> dict[str, Any]:
        """Config fields and values that describe ``usable`` positions (for a grid: an image size)."""
        if self.grid:
            if not isinstance(usable, tuple):
                raise InvalidLengthError("An image grid is resized to an image size (height, width), not a length.")
            return self.grid.config_updates(config, usable)
        value = self.config_value(config, usable)
        return {k: value for i, k in enumerate(self.length_keys) if i == 0 or get_path(config, k) is not None}


def _roberta_reserved(config: Mapping[str, Any]) -> int:
    # RoBERTa's positions start at padding_idx + 1: rows 0..pad_token_id are reserved.
    return int(config.get("pad_token_id", 1)) + 1


_BERT_BUFFERS = (
    BufferRule(r"(^|\.)embeddings\.position_ids$", "arange"),
    BufferRule(r"(^|\.)embeddings\.token_type_ids$", "zeros"),
)
_CAUSAL_MASK = BufferRule(r"(^|\.)attn\.bias$", "toeplitz")


def _bert_like(model_type: str, prefix: str, **kw: Any) -> ArchitectureSpec:
    """BERT's embeddings module: ``embeddings.position_embeddings`` + position/token-type ids."""
    return ArchitectureSpec(model_type, prefix, ("embeddings.position_embeddings.weight",), buffers=_BERT_BUFFERS, **kw)


def _roberta_like(model_type: str, prefix: str) -> ArchitectureSpec:
    """RoBERTa: positions start at ``padding_idx + 1``; the config counts the reserved rows."""
    return _bert_like(model_type, prefix, reserved=_roberta_reserved, config_counts_reserved=True)


def _seq2seq(model_type: str, offset: int) -> ArchitectureSpec:
    """BART-style encoder-decoders: two tables, each ``offset`` rows longer than the config says."""
    return ArchitectureSpec(
        model_type, "model", ("encoder.embed_positions.weight", "decoder.embed_positions.weight"), reserved=offset,
    )


def _vision(model_type: str, prefix: str, table: str, reserved: int, *, grid: GridSpec = GridSpec(),
            group: str = "model", buffers: tuple[BufferRule, ...] = (),
            optional: tuple[str, ...] = ()) -> ArchitectureSpec:
    """An image-patch grid after ``reserved`` prefix tokens, sized by ``grid`` (``image_size / patch_size``)."""
    return ArchitectureSpec(model_type, prefix, (table,), length_keys=(grid.image_key,), reserved=reserved,
                            buffers=buffers, group=group, grid=grid, optional=optional)


def _vision_tower(model_type: str, reserved: int, *, group: str = "model", config: str = "") -> ArchitectureSpec:
    """CLIP-style towers: ``embeddings.position_embedding`` (an ``nn.Embedding``) + ``position_ids``, under
    ``vision_model.`` (in a composite model; a bare tower saves its tensors without it)."""
    inner = "vision_model." if config else ""
    ids = BufferRule(rf"(^|\.){re.escape(inner)}embeddings\.position_ids$", "arange")
    grid = GridSpec(f"{config}image_size", f"{config}patch_size", square=True)
    return _vision(model_type, "" if config else "vision_model", f"{inner}embeddings.position_embedding.weight",
                   reserved, grid=grid, group=group, buffers=(ids,))


# Image-patch grids, one written spec per family (kept apart from the text families' SPECS).
GRID_SPECS: dict[str, ArchitectureSpec] = {
    s.model_type: s
    for s in [
        # image-patch grids: [1, prefix + H*W, D] parameters after class (and distillation) tokens
        _vision("vit", "vit", "embeddings.position_embeddings", 1),
        _vision("vit_msn", "vit", "embeddings.position_embeddings", 1),
        _vision("deit", "deit", "embeddings.position_embeddings", 2),
        # DINOv2 interpolates whenever height != width: square only (registers follow the table, not in it)
        _vision("dinov2", "dinov2", "embeddings.position_embeddings", 1, grid=GridSpec(square=True)),
        # ... and with registers, its run-time interpolation antialiases (plain DINOv2's does not)
        _vision("dinov2_with_registers", "dinov2_with_registers", "embeddings.position_embeddings", 1,
                grid=GridSpec(square=True, antialias=True)),
        # MAE: a fixed 2-D sin-cos table, resampled as MAE's own fine-tuning code and transformers do;
        # the pre-training head's decoder holds a second grid of the same patches
        _vision("vit_mae", "vit", "embeddings.position_embeddings", 1, optional=("decoder.decoder_pos_embed",)),
        # DPT resamples its table to every input (bilinear, from a square grid): square only, bilinear
        _vision("dpt", "dpt", "embeddings.position_embeddings", 1, grid=GridSpec(square=True, strategy="bilinear")),
        _vision_tower("clip_vision_model", 1),
        _vision_tower("siglip_vision_model", 0),
    ]
}

# Grids a family resamples to every image's own size on each forward: nothing on disk to resize.
_NAFLEX = ("SigLIP2 (NaFlex) resamples its position grid to each image's patch grid on every forward; "
           "raise the image processor's max_num_patches for larger images instead")
RUN_TIME_GRIDS = {
    "siglip2": _NAFLEX,
    "siglip2_vision_model": _NAFLEX,
    "yolos": "YOLOS resamples its position grids (keeping its detection-token rows) to each image's size on "
             "every forward; feed larger images (the image processor's size) instead",
}

# Image towers of composite models, a length group beside the text tables the probe observes.
VISION_TOWERS: dict[str, ArchitectureSpec] = {
    s.model_type: s
    for s in [
        _vision_tower("clip", 1, group="vision", config="vision_config."),
        _vision_tower("siglip", 0, group="vision", config="vision_config."),
    ]
}

SPECS: dict[str, ArchitectureSpec] = {
    s.model_type: s
    for s in [
        ArchitectureSpec(
            "gpt2",
            prefix="transformer",
            tables=("wpe.weight",),
            length_keys=("n_positions", "n_ctx"),
            # Older checkpoints store the causal mask; match it exactly, never attn.c_attn.bias.
            buffers=(BufferRule(r"(^|\.)(attn|crossattention)\.bias$", "toeplitz"),),
            # A constant (-1e4) older checkpoints stored; 4.x ignored it, 5.x reports it unexpected.
            dropped=(r"(^|\.)(attn|crossattention)\.masked_bias$",),
        ),
        ArchitectureSpec(
            "gpt_neo", "transformer", ("wpe.weight",),
            # causal mask, banded for local-attention layers: both depend only on i - j
            buffers=(BufferRule(r"(^|\.)attn\.attention\.bias$", "toeplitz"),),
            dropped=(r"(^|\.)attn\.attention\.masked_bias$",),
        ),
        ArchitectureSpec(
            "gpt_bigcode", "transformer", ("wpe.weight",), length_keys=("n_positions",),
            buffers=(BufferRule(r"^(transformer\.)?bias$", "toeplitz"),),
        ),
        ArchitectureSpec(
            "openai-gpt", "transformer", ("positions_embed.weight",), length_keys=("n_positions",),
            buffers=(BufferRule(r"^(transformer\.)?position_ids$", "arange"), _CAUSAL_MASK),
        ),
        _bert_like("bert", "bert"),
        _bert_like("big_bird", "bert"),
        _bert_like("megatron-bert", "bert"),
        _bert_like("ernie", "ernie"),
        _bert_like("electra", "electra"),
        _bert_like("albert", "albert"),
        _bert_like("convbert", "convbert"),
        _bert_like("mobilebert", "mobilebert"),
        _bert_like("rembert", "rembert"),
        _bert_like("splinter", "splinter"),
        _bert_like("fnet", "fnet"),
        _bert_like("layoutlm", "layoutlm"),
        _bert_like("distilbert", "distilbert"),
        # positions start at 2: two unused rows, the config counts usable positions only
        _bert_like("nystromformer", "nystromformer", reserved=2),
        _bert_like("yoso", "yoso", reserved=2),
        _bert_like("mra", "mra", reserved=2),
        _roberta_like("roberta", "roberta"),
        _roberta_like("xlm-roberta", "roberta"),
        _roberta_like("camembert", "roberta"),
        _roberta_like("roberta-prelayernorm", "roberta_prelayernorm"),
        _roberta_like("data2vec-text", "data2vec_text"),
        _roberta_like("longformer", "longformer"),
        _roberta_like("markuplm", "markuplm"),
        ArchitectureSpec(
            "xlm", "transformer", ("position_embeddings.weight",),
            buffers=(BufferRule(r"^(transformer\.)?position_ids$", "arange"),),
        ),
        ArchitectureSpec(
            "flaubert", "transformer", ("position_embeddings.weight",),
            buffers=(BufferRule(r"^(transformer\.)?position_ids$", "arange"),),
        ),
        ArchitectureSpec("opt", "model", ("decoder.embed_positions.weight",), reserved=2),
        ArchitectureSpec("biogpt", "biogpt", ("embed_positions.weight",), reserved=2),
        _bert_like("bert-generation", "bert"),
        _seq2seq("bart", 2),
        _seq2seq("mbart", 2),
        _seq2seq("plbart", 2),
        _seq2seq("mvp", 2),
        _seq2seq("blenderbot", 0),
        _seq2seq("blenderbot-small", 0),
    ]
}

# Model types whose positions are not a learned absolute table, by what they use instead.
_NOT_LEARNED = {
    "rotary embeddings (RoPE)": ("llama", "mistral", "qwen2", "gemma", "gpt_neox", "gptj", "phi", "modernbert",
                                 "roformer"),
    "rotary embeddings or ALiBi": ("falcon",),
    "ALiBi attention biases": ("bloom", "mpt"),
    "relative attention": ("t5", "mt5", "funnel", "xlnet", "transfo-xl"),
    "fixed sinusoidal positions": ("xglm", "m2m_100", "marian", "pegasus", "speech_to_text"),
    "relative position biases inside attention windows": ("swin", "swinv2", "donut-swin"),
}


_RELATIVE_TYPES = {"relative_key": "relative positions", "relative_key_query": "relative positions",
                   "rotary": "rotary embeddings (RoPE)", "alibi": "ALiBi attention biases"}


def positions_kind_problem(config: Mapping[str, Any]) -> str | None:
    """Why this config's positions are not a learned absolute table, or None if they are."""
    model_type = config.get("model_type", "")
    for kind, model_types in _NOT_LEARNED.items():
        if model_type in model_types:
            return kind
    if model_type in ("deberta", "deberta-v2") and not config.get("position_biased_input"):
        return "relative attention (position_biased_input=false: no absolute table)"
    pet = config.get("position_embedding_type", "absolute")
    if pet in _RELATIVE_TYPES:  # other values (DETR-style "sine") describe an image side: observed, not refused
        return f"position_embedding_type={pet!r} ({_RELATIVE_TYPES[pet]})"
    for key in ("sinusoidal_pos_embds", "sinusoidal_embeddings"):  # DistilBERT, XLM/FlauBERT
        if config.get(key):
            return f"fixed sinusoidal positions ({key}=true)"
    # ESM-1b carries rope_theta although its position_embedding_type says absolute: the type decides.
    if pet != "absolute" or "position_embedding_type" not in config:
        if any(k in config for k in ("rope_theta", "rope_scaling", "rope_parameters", "rotary_dim", "rotary_pct")):
            return "rotary embeddings (RoPE)"
    if model_type in ("beit", "data2vec-vision") and not config.get("use_absolute_position_embeddings"):
        return "relative position biases (use_absolute_position_embeddings=false)"
    if config.get("alibi"):
        return "ALiBi attention biases"
    return None
