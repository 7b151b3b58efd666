"""In-memory surgery on a transformers model: the same specs and strategies as the file path."""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from .checkpoint import check_length
from .errors import UnsupportedArchitectureError
from .specs import spec_for
from .strategies import resize_table

log = logging.getLogger(__name__)


def extend_model(
    model: nn.Module,
    new_length: int,
    strategy: str = "tile",
    *,
    seed: int | None = None,
    allow_shrink: bool = False,
    **params: Any,
) -> nn.Module:
    """Give a transformers ``PreTrainedModel`` ``new_length`` usable positions, in place.

    The table keeps its module class, dtype, device, ``padding_idx`` and ``requires_grad``;
    length-dependent buffers are rebuilt and the config updated, so a forward pass at
    ``new_length`` works and ``save_pretrained`` → ``from_pretrained`` loads cleanly.
    Create optimizers after calling this (the table is a new ``Parameter``). Returns the model.

    Example::

        >>> model = AutoModel.from_pretrained("bert-base-uncased")
        >>> posextend.extend_model(model, 2048, "interpolate")
        >>> model.config.max_position_embeddings
        2048
    """
    config = model.config.to_dict()
    shapes = {n: tuple(t.shape) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    offsets = {n: int(m.offset) for n, m in model.named_modules() if isinstance(m, nn.Embedding) and hasattr(m, "offset")}
    spec = spec_for(config, shapes, offsets)
    if spec.note == "generic":
        log.warning("No spec for model type %r: generic fallback resizes %s", spec.model_type, spec.tables[0])
    layout = spec.locate(shapes, config)
    check_length(new_length, layout.usable, allow_shrink=allow_shrink)
    new_rows = new_length + layout.reserved
    buffer_length = spec.config_value(config, new_length)
    for name in layout.tables:
        module = model.get_submodule(name.rsplit(".", 1)[0])
        if not isinstance(module, nn.Embedding):
            raise UnsupportedArchitectureError(f"{name} belongs to a {type(module).__name__}, not an nn.Embedding.")
        old = module.weight
        new = resize_table(old, new_length, strategy, reserved=layout.reserved, seed=seed, params=params, context=config)
        module.weight = nn.Parameter(new, requires_grad=old.requires_grad)
        module.num_embeddings = new_rows
    for name in layout.buffers:
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        persistent = attr not in owner._non_persistent_buffers_set
        owner.register_buffer(attr, spec.buffer_rule(name).rebuild(getattr(owner, attr), buffer_length), persistent=persistent)
    for key, value in spec.config_updates(config, new_length).items():
        setattr(model.config, key, value)
    log.info("Extended %s in memory: %d -> %d positions (%s)", spec.model_type, layout.usable, new_length, strategy)
    return model
