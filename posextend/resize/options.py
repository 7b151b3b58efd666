"""The options of a resize on disk, in one frozen dataclass (:class:`ResizeOptions`).

``resize_checkpoint``'s keywords build it (:func:`posextend.resize.on_disk.resize_checkpoint`), its report
holds it resolved (the seed drawn), and the ``resize-model`` command's options are generated from its
fields, which carry their help and flag (:func:`posextend.options.option`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from posextend.errors import InvalidLengthError, StrategyError
from posextend.options import option

if TYPE_CHECKING:
    from posextend.resize.plan import Request


def parse_image_size(text: str | None) -> int | tuple[int, int] | None:
    """``"448"`` → 448; ``"448x336"`` → (448, 336) (height x width)."""
    if text is None:
        return None
    parts = text.lower().replace("×", "x").split("x")
    if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
        raise InvalidLengthError(f"--image-size takes pixels, 448 or HEIGHTxWIDTH (448x336), not {text!r}.")
    numbers = [int(p) for p in parts]
    return numbers[0] if len(numbers) == 1 else (numbers[0], numbers[1])


def parse_params(items: list[str] | None) -> dict[str, Any]:
    """Strategy parameters given as ``key=value`` texts, as a mapping."""
    return dict(parse_param(item) for item in items or [])


_option = functools.partial(option, commands=("resize-model",))
REVISION_HELP = "For a Hugging Face Hub id: the branch, tag or commit to download (default: main)."  # every command
PARAM_HELP = "A parameter of the strategy (repeatable), e.g. std=matched."  # resize-model's and finetune's --param


@dataclass(frozen=True)
class ResizeOptions:
    """Every option of ``resize_checkpoint`` (see it for their meaning), as its keywords name them."""

    new_length: int | None = _option(
        None, "New length in tokens: the positions the model can use (its tokenizer's model_max_length after).",
        flag="--length", short="-n")
    image_size: int | tuple[int, int] | None = _option(  # pixels: 448, or (height, width)
        None, "New image size in pixels for an image-patch grid (ViT, DINOv2, CLIP's vision tower): 448, or "
        "HEIGHTxWIDTH such as 448x336.", metavar="SIZE", cli_type=str)  # the command reads it (parse_image_size)
    strategy: str | None = _option(
        None, "How to fill the new rows of the table(s), listed by `posextend strategies` (default: tile for "
        "positions, bicubic for image grids).", short="-s", metavar="NAME")
    seed: int | None = _option(None, "Seed for strategies that draw random numbers.")
    params: Mapping[str, Any] | None = _option(
        None, PARAM_HELP, flag="--param", short="-p",
        metavar="KEY=VALUE", cli_type=list[str])  # the command reads them (parse_params)
    overwrite: bool = _option(False, "Replace DST if it exists.")
    allow_shrink: bool = _option(False, "Allow a length below the current one (cuts positions).", flag="--shrink")
    link: bool = _option(False, "Hard-link shards that need no change instead of copying them.")
    table: str | tuple[str, ...] | None = _option(  # one group, or several resized to the same length
        None, "Which tables, for a model with several lengths: encoder, decoder, text... (inspect lists them); "
        "repeat it to resize several to the new length.", metavar="NAME", cli_type=list[str])
    verify: bool | None = _option(
        None, "Before the output appears, check that a tiny random model built from its new config takes the new "
        "tables and runs at the full new length (default: for families without a built-in description; see "
        "docs/concepts/positions.md).", flag="--verify/--no-verify")
    st_max_seq_length: int | None = _option(
        None, "sentence-transformers max_seq_length of the output (default: the new length).")
    revision: str | None = _option(None, REVISION_HELP)
    allow_same: bool = _option(False, "Write a copy even when the length (or image size) is the current one.")
    allow_large: bool = _option(
        False, "Do not ask before writing position tables over 4x the size of the rest of the model (and over "
        "1 GiB).", flag="--yes", short="-y")

    def request(self) -> Request:
        """What the plan of this resize is asked (:func:`posextend.resize.plan.plan_resize`)."""
        from posextend.resize.plan import Request

        return Request(self.new_length, self.image_size, self.strategy, self.params, group=self.table,
                       allow_shrink=self.allow_shrink)

    def resolved(self) -> ResizeOptions:
        """The options with a seed: the given one, else one drawn at random (and reported)."""
        if self.seed is not None:
            return self
        return dataclasses.replace(self, seed=int.from_bytes(os.urandom(8), "big") >> 1)  # 63 random bits


def parse_param(text: str) -> tuple[str, Any]:
    """Parse a CLI ``key=value`` into a typed pair (int, float, bool, None or str)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise StrategyError(f"Strategy parameter {text!r} is not key=value (e.g. std=matched).")
    value: Any = raw.strip()
    lowered = value.lower()
    if lowered in ("true", "false"):
        value = lowered == "true"
    elif lowered in ("none", "null"):
        value = None
    else:
        for cast in (int, float):
            try:
                value = cast(value)
                break
            except ValueError:
                pass
    return key.strip(), value
