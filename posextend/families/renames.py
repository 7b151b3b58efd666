"""A file's tensor names against a model's, observed on a meta twin (:mod:`posextend.families.twin`).

:func:`names_on_load` gives the names transformers loads a file's tensors as, where the family's own
conversion mapping renames them on loading; :func:`merged_on_save` what saving makes of tensors that the mapping
split on loading (a fused q, k and v); :func:`missing_table` says why a spec's table is not among a
file's names (named otherwise, a model saved without it, or weights of another family).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any


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


def merged_on_save(model: Any, state: Mapping[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """What transformers' ``save_pretrained`` makes of ``state`` (``model``'s tensors by name) where the family's
    conversion mapping merges tensors back on saving (Step3.5's vision tower loads a fused ``attn.in_proj_weight`` as
    q, k and v, permuted for its rotary embedding): the merged tensors by the name they are saved under, and the
    names of ``state``'s tensors they are made from. Both empty where the mapping merges nothing."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, apply_converters, revert_weight_conversion

    conversions = getattr(model, "_weight_conversions", None) or get_model_conversion_mapping(model, add_legacy=False)
    converters = [r for r in (c.reverse_transform() for c in (conversions or [])[::-1]) if isinstance(r, WeightConverter)]
    sources = {name for name in state if apply_converters(name, converters)[1] is not None}
    if not sources:
        return {}, set()
    return revert_weight_conversion(model, {name: state[name] for name in sources}), sources


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


def missing_table(model_type: str, options: tuple[str, ...], names: frozenset[str] | set[str],
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

