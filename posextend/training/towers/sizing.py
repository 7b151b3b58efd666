"""Image sizes a model is read at: the size an image processor makes (:func:`output_size`), the processor made to make
another (:func:`set_size` in place, :func:`sized` a copy), as ``resize-model`` writes it, and a model copy whose grid
is resized in memory (:func:`resized_copy`)."""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch


def output_size(processor: Any) -> tuple[int, int] | None:
    """The image size ``processor`` makes: its crop when it crops, else its size (a shortest edge: square)."""
    data = processor.to_dict()
    for value in ((data.get("crop_size") if data.get("do_center_crop") else None), data.get("size")):
        if isinstance(value, int) and not isinstance(value, bool):
            return value, value
        if isinstance(value, dict) and value.get("height") and value.get("width"):
            return int(value["height"]), int(value["width"])
        if isinstance(value, dict) and value.get("shortest_edge"):
            return int(value["shortest_edge"]), int(value["shortest_edge"])
    return None


def set_size(processor: Any, old: tuple[int, int], new: tuple[int, int]) -> None:
    """``processor`` (which makes images of ``old`` pixels) made to make them of ``new``, in place, as
    ``resize-model`` writes its ``preprocessor_config.json`` (:func:`posextend.resize.writer.processor_config`)."""
    from posextend.resize.writer import processor_config

    data = processor.to_dict()
    updated = processor_config({k: data[k] for k in ("size", "crop_size") if data.get(k) is not None}, old, new)
    for key, value in updated.items():
        current = getattr(processor, key, None)
        setattr(processor, key, type(current)(**value) if isinstance(value, dict) and hasattr(current, "keys")
                and not isinstance(current, dict) else value)


def sized(processor: Any, size: tuple[int, int], old: tuple[int, int] | None = None) -> Any:
    """A copy of ``processor`` making images of ``size`` (height, width) instead of ``old`` (default: the size it
    makes, :func:`output_size`), as :func:`set_size` sets it; ``processor`` itself when it makes them already (or
    makes no fixed size)."""
    old = old or output_size(processor)
    if old is None or tuple(old) == tuple(size):
        return processor
    moved = copy.deepcopy(processor)
    set_size(moved, tuple(old), tuple(size))
    return moved


def resized_copy(model: torch.nn.Module, size: tuple[int, int], strategy: str | None, seed: int) -> torch.nn.Module:
    """A copy of ``model`` (in eval mode) whose image grid is resized in memory to ``size`` (height, width), as
    ``extend_model`` resizes it (shrinking allowed), its messages kept below warnings."""
    from posextend.resize.in_memory import resize_in_memory
    from posextend.resize.plan import Request

    moved = copy.deepcopy(model).eval()
    quiet = logging.getLogger("posextend.resize.in_memory")
    level, quiet.level = quiet.level, logging.WARNING
    try:
        resize_in_memory(moved, Request(pixels=size, strategy=strategy, allow_shrink=True), seed)
    finally:
        quiet.level = level
    return moved
