"""Architecture spec types: how a family's positions are described, and found in a checkpoint.

An :class:`ArchitectureSpec` says where one family keeps its learned absolute position table(s), a
:class:`GridSpec` how an image-patch grid maps to config fields, a :class:`BufferRule` how a length-dependent
buffer is rebuilt, and a :class:`Layout` where a spec found its tables in one model or checkpoint. The
written specs are in :mod:`posextend.families.catalogue`; others are observed on twins
(:mod:`posextend.families.probe`, :mod:`posextend.families.grid_probe`).

Lengths are in *usable* positions (what a tokenizer's ``model_max_length`` holds).
``rows = usable + reserved`` where ``reserved`` are leading rows that no token
position ever uses directly (RoBERTa's padding rows, OPT/BART's offset of 2).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from posextend.errors import CorruptCheckpointError, InvalidLengthError
from posextend.families.configs import get_path, pair
from posextend.families.renames import missing_table, names_on_load

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
      family resamples them at run time (:func:`posextend.tables.relative.resize_relative`); square grids only.
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
        return {**{key: same_form(get_path(config, key), v) for key, v in fields.items()}, **counts}


def same_form(old: Any, value: tuple[int, int]) -> int | list[int]:
    """``value`` as an int when square and ``old`` was an int, else ``[height, width]``: an image-size field's
    new value in the field's own form."""
    return value[0] if value[0] == value[1] and isinstance(old, int) else [value[0], value[1]]


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
                raise CorruptCheckpointError(missing_table(self.model_type, options, names, config))
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
