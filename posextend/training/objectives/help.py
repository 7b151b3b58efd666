"""What ``finetune --help`` says of the registered objectives, made from the registry (plug-ins included): each one's
help line (:func:`objectives_help`) and each one's defaults for the options that are an objective's
(:func:`defaults_help`), so that an installed plug-in shows up with its defaults and adding one edits no prose."""

from __future__ import annotations

from typing import Any

from posextend.training.objectives.base import Objective, available_objectives


def objectives_help() -> str:
    """Every registered objective (plug-ins included), one paragraph each: its name and its help line."""
    return "\n\n".join(f"{name}: {objective.description}" for name, objective in available_objectives().items())


def data_help() -> str:
    """What each registered objective reads as data (plug-ins included), one paragraph per kind of data with the
    objectives that read it: ``--data``'s and ``--eval-data``'s help, made from the registry."""
    kinds: dict[str, list[str]] = {}
    for name, objective in available_objectives().items():
        kinds.setdefault(objective.data, []).append(name)
    return "\n\n".join(f"{', '.join(names)}: {kind}." for kind, names in kinds.items())


_MODES = ("all", "lora", "positions", "new-rows")  # the train modes, as the defaults' help lists them
_FALLBACK = {"schedule": "constant", "strategy": "tile"}  # what a run takes where an objective's table lacks a mode


def defaults_help(option: str) -> str:
    """Each registered objective's default for ``option`` (one of :data:`posextend.training.options.DEFAULTED`),
    plug-ins included, one paragraph each: ``finetune --help`` shows it under the option, made from the registry as
    the run resolves it (so an installed plug-in shows up with its defaults, and adding one edits no prose)."""
    lines, weights = [], option in ("anchor", "window_anchor")
    for name, objective in available_objectives().items():
        if weights:
            weight = getattr(objective, option)
            value = f"none (no {option.replace('_', ' ')} term)" if weight is None else f"{weight:g}"
        else:
            table = getattr(objective, option)
            fallback = Objective.lr if option == "lr" else {}
            value = ", ".join(f"{mode} {_shown(table.get(mode, fallback.get(mode, _FALLBACK.get(option))))}"
                              for mode in _MODES)
            if option == "lr" and objective.lr_width:
                value += f" (all: times {objective.lr_width} / width on models wider than {objective.lr_width})"
        lines.append(f"{name}: {value}")
    head = "Defaults by objective:" if weights else "Defaults by objective and train mode:"
    return head + "\n\n" + ";\n\n".join(lines) + "."


def _shown(value: Any) -> str:
    """A learning rate as people write it (``1e-3``, ``2.5e-4``); anything else as it is."""
    if not isinstance(value, float):
        return str(value)
    mantissa, exponent = f"{value:e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
