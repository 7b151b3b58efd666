"""What the objectives that read images share (:class:`ImageObjective`): the ``vision`` and ``image-text`` objectives,
and a plug-in's (``class Mine(ImageObjective)``). Their data is images (a folder, a table, a dataset:
:func:`posextend.data.images.read_images`), held out whole by a seeded share (by class where they have labels); a
sample is an item (an image, a pair), not a window of a stream of tokens; the processor makes images of the run's size,
as ``resize-model`` writes it; an image's tokens are its patches. Text objectives keep :class:`Objective`'s defaults."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from posextend.training.loading import Loaded, load_headed_model, load_processor
from posextend.training.objectives.base import Objective, without_dropout
from posextend.training.sizes import Sizes
from posextend.training.towers.sizing import output_size, set_size


class ImageObjective(Objective):
    """Base class of an objective that reads images: ``loss`` and ``evaluate`` are its own, and what differs from the
    defaults here (its model, what the data must hold, what a sample is)."""

    stream = False  # samples are items (images, pairs), not windows of one stream of tokens
    processor_kind: ClassVar[str] = "image"  # what reads its data (load_processor): "image", or "both" with text
    needs: ClassVar[str | None] = None  # what every item must hold (read_images): "text" (captions), "labels", None
    mates: int = 0  # items more each sample draws (in-batch negatives, label-free batch-mates): what count() counts
    patches: int = 0  # an image's patches at the run's size (size_processor sets them on the run's own copy)

    def documents(self, paths: Sequence[str | Path]) -> Sequence[Any]:
        """Images (:func:`posextend.data.images.read_images`), with what :attr:`needs` asks of each."""
        from posextend.data.images import read_images

        return read_images(paths, need=self.needs)

    def for_data(self, documents: Sequence[Any]) -> ImageObjective:
        """The run's own copy: what it learns of its data and sizes (:attr:`patches`) stays with the run."""
        return copy.copy(self)

    def load_model(self, directory: Path, *, init_head: bool) -> Loaded:
        """The checkpoint in ``model_class`` and its processor (:attr:`processor_kind`), trained without dropout."""
        loaded = load_headed_model(directory, self.auto_class(), self.head, self.name, init_head=init_head,
                                   processor=lambda d: load_processor(d, self.processor_kind))
        without_dropout(loaded.model)
        return loaded

    def split(self, documents: Any, *, processor: Any, length: int, config: Any) -> tuple[Any, Any]:
        """A seeded share of the items held out whole (by class, in proportion), at least ``config.eval_sequences``."""
        from posextend.data.heldout import split_images

        return split_images(documents, least=config.eval_sequences, seed=config.seed)

    def size_processor(self, processor: Any, sizes: Sizes) -> None:
        """The image processor's ``size`` / ``crop_size`` to the run's image size, as ``resize-model`` writes them; a
        text tokenizer's ``model_max_length`` to the run's length; and :attr:`patches`, :meth:`image_patches`."""
        length, new = sizes.length.new, sizes.image.new if sizes.image else None
        tokenizer = getattr(processor, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.model_max_length = length
        images = getattr(processor, "image_processor", processor)
        old = output_size(images)
        if new is not None and old is not None and tuple(old) != tuple(new):
            set_size(images, old, new)
        self.patches = self.image_patches(length=length, old=old, new=new)

    def image_patches(self, *, length: int, old: tuple[int, int] | None, new: tuple[int, int] | None) -> int:
        """An image's patches at the run's size ``new`` (pixels): a vision tower's ``length`` is its grid's patches at
        the processor's ``old`` size, so they scale with the image's area."""
        if new is None or old is None or tuple(old) == tuple(new):
            return length
        return round(length * new[0] * new[1] / (old[0] * old[1]))

    def samples(self, processor: Any, documents: Sequence[Any], length: int) -> Sequence[Any]:
        """The items themselves (``{"image", "text", "label"}``), their images decoded when a batch takes them."""
        return documents

    def count(self, batch: Sequence[Any]) -> tuple[int, int]:
        """``(images, images × patches)``, the :attr:`mates` each sample draws included."""
        images = (1 + self.mates) * len(batch)
        return images, images * self.patches
