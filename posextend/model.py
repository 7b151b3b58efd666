"""In-memory surgery on a transformers model: the same specs and strategies as the file path."""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from .checkpoint import check_length
from .lookup import spec_for
from .strategies import resize_table

log = logging.getLogger(__name__)


def extend_model(
    model: nn.Module,
    new_length: int,
    strategy: str = "tile",
    *,
    seed: int | None = None,
    allow_shrink: bool = False,
    table: str | None = None,
    **params: Any,
) -> nn.Module:
    """Give a transformers ``PreTrainedModel`` ``new_length`` usable positions, in place.

    The table keeps its module class, dtype, device, ``padding_idx`` and ``requires_grad``;
    length-dependent buffers are rebuilt and the config updated, so a forward pass at
    ``new_length`` works and ``save_pretrained`` → ``from_pretrained`` loads cleanly.
    Create optimizers after calling this (the table is a new ``Parameter``). Returns the model.
    ``table`` names the tables to resize in a model with several lengths (``"decoder"``, ``"text"``).
    A family without a written spec is first observed on a twin of ``type(model)`` (seconds).

    Example::

        >>> model = AutoModel.from_pretrained("bert-base-uncased")
        >>> posextend.extend_model(model, 2048, "interpolate")
        >>> model.config.max_position_embeddings
        2048
    """
    config = model.config.to_dict()
    shapes = {n: tuple(t.shape) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    spec = spec_for(config, cls=type(model), table=table)
    layout = spec.locate(shapes, config)
    check_length(new_length, layout.usable, allow_shrink=allow_shrink)
    new_rows = new_length + layout.reserved
    buffer_length = spec.config_value(config, new_length)
    # every new table is computed and checked before any is swapped in: a refusal changes nothing
    new_tables = {
        name: resize_table(model.get_parameter(name) if name in dict(model.named_parameters()) else model.get_buffer(name),
                           new_length, strategy, reserved=layout.reserved, seed=seed, params=params, context=config)
        for name in layout.tables
    }
    for name, new in new_tables.items():
        owner_name, _, attr = name.rpartition(".")
        module = model.get_submodule(owner_name)
        old = getattr(module, attr)
        if isinstance(old, nn.Parameter):
            setattr(module, attr, nn.Parameter(new, requires_grad=old.requires_grad))
        else:  # a companion buffer that follows the table (I-BERT's weight_integer)
            module.register_buffer(attr, new, persistent=attr not in module._non_persistent_buffers_set)
        for count in ("num_embeddings", "num_"):  # nn.Embedding; I-BERT's QuantEmbedding
            if getattr(module, count, None) == old.shape[0]:
                setattr(module, count, new_rows)
    for name in layout.buffers:
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        persistent = attr not in owner._non_persistent_buffers_set
        owner.register_buffer(attr, spec.buffer_rule(name).rebuild(getattr(owner, attr), buffer_length), persistent=persistent)
    set_config(model, spec.config_updates(config, new_length))
    log.info("Extended %s in memory: %d -> %d positions (%s)", spec.model_type, layout.usable, new_length, strategy)
    return model


def set_config(model: nn.Module, updates: dict[str, int]) -> None:
    """Set (dotted) config fields on the model's config and on every sub-module's copy of it.

    ``text_config.max_position_embeddings`` is set on ``model.config.text_config`` and on any
    module whose ``config`` is another object of that class (a tower holding its own copy).
    """
    for path, value in updates.items():
        *parents, leaf = path.split(".")
        target = model.config
        for part in parents:
            target = getattr(target, part)
        setattr(target, leaf, value)
        for module in model.modules():
            cfg = getattr(module, "config", None)
            if cfg is not None and cfg is not target and type(cfg) is type(target) and hasattr(cfg, leaf):
                setattr(cfg, leaf, value)
