"""Buffers that follow an image's size: the rule that rebuilds each saved one (observed on twins, for
:mod:`posextend.families.grid_probe`), and, after an in-memory resize, the ones a model computes from its
config (:func:`sync_derived_buffers`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from posextend.errors import UnsupportedArchitectureError
from posextend.families import configs, twin
from posextend.families.specs import BufferRule, same_form

if TYPE_CHECKING:
    import torch
    from torch import nn

    from posextend.families.grid_fields import FieldFacts


def buffer_rules(
    small: dict[str, Any], facts: FieldFacts, buffers: list[str], saved: Mapping[str, Any], grid_rows: tuple[int, int],
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
    b = dict(twin.build(configs.set_path(small, image_key, same_form(old_value, up)), cls=cls).named_buffers())
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
    small = configs.shrink(config)
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
