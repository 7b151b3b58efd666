"""In-memory surgery on a transformers model: the same specs and strategies as the file path."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from torch import nn

from posextend.resize.plan import Request, plan_resize

log = logging.getLogger(__name__)


def extend_model(
    model: nn.Module,
    new_length: int | None = None,
    strategy: str | None = None,
    *,
    image_size: int | tuple[int, int] | None = None,
    seed: int | None = None,
    allow_shrink: bool = False,
    table: str | Sequence[str] | None = None,
    **params: Any,
) -> nn.Module:
    """Give a transformers ``PreTrainedModel`` ``new_length`` usable positions and/or image grids
    for ``image_size`` pixels, in place.

    The table keeps its module class, dtype, device, ``padding_idx`` and ``requires_grad``;
    length-dependent buffers are rebuilt and the config updated, so a forward pass at
    ``new_length`` (or on images of ``image_size``) works and ``save_pretrained`` →
    ``from_pretrained`` loads cleanly. Create optimizers after calling this (the table is a new
    ``Parameter``). A family without a written spec is first observed on a twin of
    ``type(model)`` (seconds).

    Only the model changes: its tokenizer (or image processor) is a separate object and is left
    as it was, so a BERT tokenizer still says ``model_max_length == 512`` and truncates there
    (or warns) with ``truncation=True``. Set ``tokenizer.model_max_length = new_length`` (and a
    sentence-transformers model's ``max_seq_length``) yourself, or resize the checkpoint on disk
    with :func:`~posextend.resize.on_disk.resize_checkpoint`, which updates
    ``tokenizer_config.json`` and the image processor's size with the model.

    Args:
        model: a transformers model (``PreTrainedModel``), headed or bare; changed in place.
        new_length: usable positions of the table(s) of positions; reserved rows are added for you.
        strategy: how new rows are made (:func:`~posextend.tables.strategies.available_strategies`);
            it applies to the tables whose grid rank it handles, the others get their rank's
            default (``tile`` for positions, ``bicubic`` for image grids).
        image_size: pixels, ``448`` or ``(height, width)``, for an image-patch grid.
        seed: seeds a strategy that draws random rows (default: a random seed).
        allow_shrink: allow a ``new_length`` (or image size) below the current one.
        table: which tables, for a model with several lengths (``"decoder"``, ``"text"``), or several, each
            given ``new_length`` (``("encoder", "decoder")``).
        **params: the strategy's parameters (``std="matched"`` for ``random``, ``keep=20`` for ``kps``).

    Returns:
        ``model`` itself, extended.

    Raises:
        PosExtendError: a subclass saying what to fix (no learned table, a length or strategy
            that does not fit); the model is unchanged then.

    Examples:
        >>> model = AutoModel.from_pretrained("bert-base-uncased")
        >>> posextend.extend_model(model, 2048, "interpolate")
        >>> model.config.max_position_embeddings
        2048
        >>> tokenizer = AutoTokenizer.from_pretrained("bert-base-uncased")
        >>> tokenizer.model_max_length = 2048  # the tokenizer is yours to update
        >>> vit = AutoModel.from_pretrained("google/vit-base-patch16-224")
        >>> posextend.extend_model(vit, image_size=448).config.image_size
        448
    """
    resize_in_memory(model, Request(new_length, image_size, strategy, params, group=table, allow_shrink=allow_shrink), seed)
    return model


def resize_in_memory(model: nn.Module, request: Request, seed: int | None) -> None:
    """:func:`extend_model`'s work, for a caller holding a :class:`~posextend.resize.plan.Request` (the fine-tune,
    which keeps it: its written checkpoint follows the same request)."""
    config = model.config.to_dict()
    shapes = {n: tuple(t.shape) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    plans = plan_resize(config, shapes, request, cls=type(model))
    # every new table is computed and checked before any is swapped in: a refusal changes nothing
    new_tables = {name: plan.resize(_tensor(model, name), seed=seed, context=config)
                  for plan in plans for name in plan.layout.tables}
    for name, new in new_tables.items():
        _swap(model, name, new)
    for plan in plans:
        for name in plan.layout.buffers:
            owner_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_name)
            persistent = attr not in owner._non_persistent_buffers_set
            rebuilt = plan.spec.buffer_rule(name).rebuild(getattr(owner, attr), plan.buffer_value(config))
            owner.register_buffer(attr, rebuilt, persistent=persistent)
        if plan.spec.grid:
            _sync_image_attributes(model, plan, config)
        set_config(model, plan.config_updates(config))
        if plan.spec.grid and plan.spec.covered_by == "probed":
            from posextend.families.grid_buffers import sync_derived_buffers

            sync_derived_buffers(model)  # buffers it computes from its config (OWL-ViT's box_bias)
        log.info("Extended %s in memory: %s -> %s (%s)", plan.spec.model_type, plan.layout.grid, plan.new_grid,
                 plan.strategy)


def _tensor(model: nn.Module, name: str):
    return model.get_parameter(name) if name in dict(model.named_parameters()) else model.get_buffer(name)


def _swap(model: nn.Module, name: str, new) -> None:
    """Put table ``new`` in place of ``name``: a Parameter stays one (same ``requires_grad``), a buffer
    a buffer; the owner's row count (``nn.Embedding.num_embeddings``) follows."""
    owner_name, _, attr = name.rpartition(".")
    module = model.get_submodule(owner_name)
    old = getattr(module, attr)
    if isinstance(old, nn.Parameter):
        setattr(module, attr, nn.Parameter(new, requires_grad=old.requires_grad))
    else:  # a companion buffer that follows the table (I-BERT's weight_integer)
        module.register_buffer(attr, new, persistent=attr not in module._non_persistent_buffers_set)
    for count in ("num_embeddings", "num_"):  # nn.Embedding; I-BERT's QuantEmbedding
        if getattr(module, count, None) == old.shape[-2]:
            setattr(module, count, new.shape[-2])


def _sync_image_attributes(model: nn.Module, plan, config) -> None:
    """Modules of an image grid's tower copy the config at construction (``image_size``,
    ``num_patches``, ``num_positions``) and check inputs against it: set the new values
    wherever the old ones are held, in the same form (int or pair)."""
    (h, w), _ = plan.spec.grid.sizes(config)
    new_h, new_w = plan.target
    old_usable, reserved = plan.layout.usable, plan.layout.reserved
    tower = plan.layout.tables[0].split(".embeddings.")[0] if ".embeddings." in plan.layout.tables[0] else ""
    root = model.get_submodule(tower) if tower else model
    for module in root.modules():
        size = getattr(module, "image_size", None)
        if size == h == w and isinstance(size, int):
            module.image_size = new_h
        elif isinstance(size, (tuple, list)) and tuple(size) == (h, w):
            module.image_size = type(size)((new_h, new_w))
        if getattr(module, "num_patches", None) == old_usable:
            module.num_patches = plan.new_usable
        if getattr(module, "num_positions", None) == old_usable + reserved:
            module.num_positions = plan.new_rows


def set_config(model: nn.Module, updates: dict[str, Any]) -> None:
    """Set (dotted) config fields on the model's config and on every sub-module's copy of it.

    ``text_config.max_position_embeddings`` is set on ``model.config.text_config`` and on any
    module whose ``config`` is a copy of it (a tower holding its own: equal to it before the update). Another
    config of the same class is left alone (an EncoderDecoderModel's decoder, when its encoder's length changes).
    """
    for path, value in updates.items():
        *parents, leaf = path.split(".")
        target = model.config
        for part in parents:
            target = getattr(target, part)
        before = target.to_dict()
        setattr(target, leaf, value)
        for module in model.modules():
            cfg = getattr(module, "config", None)
            if (cfg is not None and cfg is not target and type(cfg) is type(target) and hasattr(cfg, leaf)
                    and cfg.to_dict() == before):
                setattr(cfg, leaf, value)
