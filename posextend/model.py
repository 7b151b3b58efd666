"""In-memory surgery on a transformers model: the same specs and strategies as the file path."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from torch import nn

from .errors import NotLearnedPositionsError, UnsupportedArchitectureError
from .checkpoint import check_length
from .specs import ArchitectureSpec, BufferRule, spec_for
from .strategies import resize_table

log = logging.getLogger(__name__)

_GENERIC_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length", "n_ctx")
_GENERIC_BUFFERS = (
    BufferRule(r"(^|\.)position_ids$", "arange"),
    BufferRule(r"(^|\.)token_type_ids$", "zeros"),
)


def generic_spec(model: nn.Module, config: Mapping[str, Any]) -> ArchitectureSpec:
    """A spec for an unknown model type: the one position ``nn.Embedding`` the config sizes.

    Candidates are ``nn.Embedding`` modules whose own name mentions ``pos``; the config's
    length field must match their rows (plus the module's ``offset`` attribute, as
    OPT/BART-style learned positional embeddings have). Refuses when none or several match.
    """
    key = next((k for k in _GENERIC_LENGTH_KEYS if isinstance(config.get(k), int)), None)
    model_type = config.get("model_type")
    if key is None:
        raise UnsupportedArchitectureError(
            f"Model type {model_type!r} has no spec and its config has no length field "
            f"({', '.join(_GENERIC_LENGTH_KEYS)}); posextend cannot tell which table holds positions."
        )
    named = [
        (name, m) for name, m in model.named_modules()
        if isinstance(m, nn.Embedding) and "pos" in name.rsplit(".", 1)[-1].lower()
    ]
    matches = [(n, m) for n, m in named if m.num_embeddings == config[key] + int(getattr(m, "offset", 0))]
    if len(matches) != 1:
        found = ", ".join(f"{n} ({m.num_embeddings} rows)" for n, m in named) or "none"
        why = "none matches" if not matches else "several match"
        raise UnsupportedArchitectureError(
            f"Model type {model_type!r} has no spec, and the generic fallback found no single "
            f"position table: {why} {key}={config[key]}. Position-named embeddings: {found}. "
            "Please open an issue so a spec can be added."
        )
    name, module = matches[0]
    return ArchitectureSpec(
        model_type=str(model_type), prefix="", tables=(f"{name}.weight",), length_keys=(key,),
        reserved=int(getattr(module, "offset", 0)), buffers=_GENERIC_BUFFERS, note="generic",
    )


def spec_for_model(model: nn.Module) -> ArchitectureSpec:
    """The spec for an in-memory model: a registered one, else the generic fallback."""
    config = model.config.to_dict()
    try:
        return spec_for(config)
    except NotLearnedPositionsError:
        raise
    except UnsupportedArchitectureError:
        log.info("No spec for model type %r; using the generic fallback", config.get("model_type"))
        return generic_spec(model, config)


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
    spec = spec_for_model(model)
    config = model.config.to_dict()
    shapes = {n: tuple(t.shape) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    layout = spec.locate(shapes, config)
    check_length(new_length, layout.usable, allow_shrink=allow_shrink)
    new_rows = new_length + layout.reserved
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
        owner.register_buffer(attr, spec.buffer_rule(name).rebuild(getattr(owner, attr), new_rows), persistent=persistent)
    for key, value in spec.config_updates(config, new_length).items():
        setattr(model.config, key, value)
    log.info("Extended %s in memory: %d -> %d positions (%s)", spec.model_type, layout.usable, new_length, strategy)
    return model
