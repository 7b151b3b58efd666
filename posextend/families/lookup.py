"""The one lookup of a family's facts, used by every door (file path, in-memory, analysis, fine-tune).

A model type with a written spec (:data:`posextend.families.catalogue.SPECS`) gets it; any other is
observed on twins of its own config (:func:`posextend.families.probe.observe`), never guessed.
Models whose positions are not a learned table are refused with what they use instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from posextend.errors import NotLearnedPositionsError, RunTimeGridError, UnsupportedArchitectureError
from posextend.families.catalogue import GRID_SPECS, RUN_TIME_GRIDS, SPECS, VISION_TOWERS
from posextend.families.configs import get_path
from posextend.families.not_learned import positions_kind_problem
from posextend.families.specs import ArchitectureSpec


def all_specs(config: Mapping[str, Any], *, cls: type | None = None) -> tuple[ArchitectureSpec, ...]:
    """Every position length of a model: one spec per group of tables that one config field sizes.

    A family with a written spec gets it; any other is observed on tiny twins of its config (seconds).

    Args:
        config: the model's ``config.json``, as a dict.
        cls: the model's class when it is not the one ``config["architectures"]`` names (in memory).

    Returns:
        One :class:`~posextend.families.specs.ArchitectureSpec` per length (LED: ``decoder`` and
        ``encoder``; CLIP: ``text`` and its ``vision`` grid; BERT: one, ``model``).

    Raises:
        NotLearnedPositionsError: its positions are no learned table (rotary, relative, sinusoidal).
        UnsupportedArchitectureError: no table could be found or observed unambiguously (the message
            says why); :class:`RunTimeGridError` for a grid the family adapts to each image.

    Examples:
        >>> config = json.load(open("clip-vit-base-patch16/config.json"))
        >>> [s.group for s in all_specs(config)]
        ['text', 'vision']
    """
    model_type = config.get("model_type")
    problem = positions_kind_problem(config)
    if problem and "rotary" in problem:  # a rotary LM or tower may hold a learned image grid beside it
        return _grids_beside(config, cls, problem)
    if problem:
        raise NotLearnedPositionsError(_not_learned(config, problem))
    if model_type in SPECS:
        return (SPECS[model_type],)
    if model_type in GRID_SPECS:
        return (GRID_SPECS[model_type],)
    from posextend.families.probe import observe

    try:
        specs, error = observe(config, cls), None
    except UnsupportedArchitectureError as e:
        specs, error = (), e
    grids, grid_error = _grids(config, cls)
    if not specs and not grids:
        if model_type in RUN_TIME_GRIDS:  # the table it has is not one to resize on disk: say why
            raise RunTimeGridError(f"Model type {model_type!r}: {RUN_TIME_GRIDS[model_type]}.") from error
        raise grid_error or error
    groups = {s.group for s in specs}  # a grid named like a length of positions (both at the top): "image"
    return specs + tuple(replace(g, group="image") if g.group in groups else g for g in grids)


def _not_learned(config: Mapping[str, Any], problem: str) -> str:
    """Why posextend does not apply to positions that are ``problem`` (rotary, relative ...), and what to do."""
    advice = "use its own length scaling (e.g. rope_scaling) instead" if "rotary" in problem else (
        "there is no learned table to extend")
    return (f"Model type {config.get('model_type')!r} uses {problem}, not a learned absolute position table; "
            f"posextend does not apply: {advice}.")


def _grids_beside(config: Mapping[str, Any], cls: type | None, problem: str) -> tuple[ArchitectureSpec, ...]:
    """The learned image grids of a model whose other positions are ``problem`` (Phi-4-multimodal: a SigLIP
    tower beside a rotary LM), observed; a grid it adapts to each image refused as such
    (:class:`RunTimeGridError`, saying both); else refused for ``problem``, with why its grid (if any) cannot
    be resized either."""
    from posextend.families.grid_probe import grid_tables

    if not grid_tables(config, cls):  # no learned grid beside its rotary positions: nothing to observe
        raise NotLearnedPositionsError(_not_learned(config, problem))
    grids, error = _grids(config, cls)
    if grids:
        return grids
    if isinstance(error, RunTimeGridError):
        raise error
    why = f" Its image grid cannot be resized either: {error}" if error else ""
    raise NotLearnedPositionsError(_not_learned(config, problem) + why) from None


def _grids(config: Mapping[str, Any], cls: type | None) -> tuple[tuple[ArchitectureSpec, ...], UnsupportedArchitectureError | None]:
    """The image grids of a family without a written grid spec: a written tower (CLIP, SigLIP), else
    observed on twins (:func:`posextend.families.grid_probe.observe_grids`); and why none, when it has an image size."""
    model_type = config.get("model_type")
    if model_type in VISION_TOWERS:
        return (VISION_TOWERS[model_type],), None
    if model_type in RUN_TIME_GRIDS:
        return (), None
    from posextend.families.grid_probe import observe_grids

    try:
        return observe_grids(config, cls), None
    except UnsupportedArchitectureError as e:
        return (), e


def spec_for(
    config: Mapping[str, Any], *, cls: type | None = None, table: str | None = None, rank: int | None = None,
) -> ArchitectureSpec:
    """The spec of the tables to resize: the model's only length, or the group named ``table``.

    Args:
        config: the model's ``config.json``, as a dict.
        cls: the model's class when it is not the one ``config["architectures"]`` names (in memory).
        table: the group to resize, for a model with several lengths (``"encoder"``, ``"decoder"``,
            ``"text"``, ``"vision"``).
        rank: 1 for a length of positions, 2 for an image grid. Without ``table`` or ``rank``,
            a model with a text length and an image grid (CLIP) gives its text length.

    Returns:
        The :class:`~posextend.families.specs.ArchitectureSpec` of those tables.

    Raises:
        UnsupportedArchitectureError: no such table, or several lengths and no ``table`` named;
            and what :func:`all_specs` raises.

    Examples:
        >>> spec_for(json.load(open("led/config.json")), table="decoder").length_keys
        ('max_decoder_position_embeddings',)
    """
    every = all_specs(config, cls=cls)
    wanted = rank or (1 if any(s.rank == 1 for s in every) else 2)
    specs = tuple(s for s in every if s.rank == wanted or (rank is None and table is not None))
    problem = positions_kind_problem(config)
    if not specs and wanted == 1 and problem:  # its image grid is resizable, its other positions are not
        raise NotLearnedPositionsError(_not_learned(config, problem))
    if not specs:
        what = "an image grid" if wanted == 2 else "a length of positions"
        if wanted == 2 and config.get("model_type") in RUN_TIME_GRIDS:
            raise RunTimeGridError(f"Model type {config.get('model_type')!r}: {RUN_TIME_GRIDS[config.get('model_type')]}.")
        grid_error = _grids(config, cls)[1] if wanted == 2 else None
        if grid_error is not None:  # it has an image size, but its grid was refused: say why
            raise grid_error
        has = ", ".join(f"{'positions' if s.rank == 1 else 'an image grid'} ({s.length_keys[0]}="
                        f"{get_path(config, s.length_keys[0])})" for s in every)
        raise UnsupportedArchitectureError(
            f"Model type {config.get('model_type')!r} has no learned table of {what} posextend resizes; "
            + (f"it has {has}: give {'a length' if wanted == 2 else 'an image size'} instead." if every else
               "nor any other.")
        )
    if table is None and len(specs) == 1:
        return specs[0]
    names = {s.group: s for s in specs}
    if table in names:
        return names[table]
    lengths = ", ".join(f"{s.group} ({s.length_keys[0]}={get_path(config, s.length_keys[0])})" for s in specs)
    if table is None:
        groups = sorted(names)
        raise UnsupportedArchitectureError(
            f"Model type {config.get('model_type')!r} has several position lengths: {lengths}; choose the "
            f"table to resize: {' or '.join(f'table={g!r}' for g in groups)}, or several to the same length: "
            f"table={tuple(groups)!r}."
        )
    raise UnsupportedArchitectureError(
        f"Model type {config.get('model_type')!r} has no table {table!r}; its tables: {lengths}."
    )
