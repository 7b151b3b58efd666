"""A run's sizes, one named axis each (:class:`Sizes`): the text ``length``, an encoder-decoder's own ``decoder``
length, the ``image`` (height, width) and room for ``frames``; each the source's size and the run's (:class:`Axis`).

Setup makes them once (:func:`run_sizes`); the run carries them (``run.sizes``) to the loop, the report and the save.
A new axis is one field here and a family spec whose tables it sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from posextend.errors import TrainingError

if TYPE_CHECKING:
    from posextend.training.loading import Loaded
    from posextend.training.options import FinetuneConfig

T = TypeVar("T")


@dataclass(frozen=True)
class Axis(Generic[T]):
    """One size of a run: the source's (``old``) and the run's (``new``). ``resized``: this run resizes the model's
    tables to ``new`` (False: the model came at that size, extended earlier or not at all)."""

    old: T
    new: T
    resized: bool = False

    @classmethod
    def at(cls, size: T) -> Axis[T]:
        """A size the run keeps as the source has it."""
        return cls(size, size)

    @property
    def new_from(self) -> T | None:
        """Where the new sizes start: the source's size when the run's is larger (a longer length), else None."""
        return self.old if self.old < self.new else None


@dataclass(frozen=True)
class Sizes:
    """A run's sizes. ``length``: usable positions (an image grid's patches for a vision tower), the source's old
    length and the run's; ``decoder``: an encoder-decoder's decoder with a length of its own (LED; None: its stacks
    share ``length``); ``image``: pixels (height, width) of a model with an image grid (None without one);
    ``frames``: room for a video's frames (no family has them yet)."""

    length: Axis[int]
    decoder: Axis[int] | None = None
    image: Axis[tuple[int, int]] | None = None
    frames: Axis[int] | None = None

    @property
    def grows_ranks(self) -> set[int]:
        """The grid ranks of the tables the run resizes: 1 (a longer length), 2 (an image grid)."""
        return {rank for rank, axis in ((1, self.length), (2, self.image)) if axis is not None and axis.resized}

    @property
    def resized(self) -> bool:
        """This run extends the model's length or image grid (not only its decoder's)."""
        return bool(self.grows_ranks)

    @property
    def grows(self) -> bool:
        """The run gives the model more than the source read: a longer length (beyond its old one) or an image size."""
        return self.length.old < self.length.new or 2 in self.grows_ranks


def run_sizes(loaded: Loaded, config: FinetuneConfig) -> Sizes:
    """The run's sizes: ``config.length``, ``config.decoder_length`` and ``config.image_size`` against the loaded
    model's (its old length: ``config.old_length``, else its provenance's, else its own)."""
    from posextend.resize.plan import image_size_pair

    current, length = loaded.usable, config.length
    extended = length is not None and length != current
    if extended and loaded.spec.rank == 2:
        raise TrainingError(f"{loaded.hf_model.config.model_type} has an image grid, not a length of tokens: give the "
                            "image size in pixels instead of a length.")
    old_len = current if extended else (config.old_length or loaded.old_length or current)
    old_image = _source_image(loaded, asked=config.image_size is not None)
    if config.image_size and old_image is None:
        raise TrainingError(f"{loaded.hf_model.config.model_type} has no image grid to give an image size; leave "
                            "the image size unset.")
    image = image_size_pair(config.image_size) if config.image_size else old_image
    return Sizes(Axis(old_len, length if extended else current, extended), _decoder(loaded, config.decoder_length),
                 None if image is None else Axis(old_image, image, image != old_image))


def read_sizes(loaded: Loaded, length: int) -> Sizes:
    """The sizes a loaded model is read at as it is (``posextend eval``): ``length`` of its usable positions (its old
    length: its provenance's, else ``length``), its decoder's and its image size kept."""
    image, decoder = _source_image(loaded), loaded.decoder
    return Sizes(Axis(loaded.old_length or length, length), None if decoder is None else Axis.at(decoder.usable),
                 None if image is None else Axis.at(image))


def _decoder(loaded: Loaded, want: int | None) -> Axis[int] | None:
    """The decoder's own length (LED): its usable positions and ``want`` (None: kept); None for a family whose stacks
    share one length (the run's)."""
    decoder = loaded.decoder
    if decoder is None:
        if want is not None:
            raise TrainingError(
                f"{loaded.hf_model.config.model_type} has no decoder with a length of its own (its stacks share one, "
                "or it has one stack): leave the decoder's length unset; length=N sizes every table.")
        return None
    return Axis(decoder.usable, want or decoder.usable, want is not None and want != decoder.usable)


def _source_image(loaded: Loaded, *, asked: bool = False) -> tuple[int, int] | None:
    """The pixels (height, width) of the loaded model's image grid (:func:`~posextend.training.loading.image_grid`):
    looked for in a vision tower or a model with a vision config, or anywhere when ``asked`` (a run gives an image
    size); None without one."""
    from posextend.training.loading import image_grid

    config = loaded.hf_model.config.to_dict()
    if not (asked or loaded.spec.rank == 2 or "vision_config" in config):
        return None
    grid = image_grid(loaded)
    return None if grid is None else grid.spec.grid.sizes(config)[0]
