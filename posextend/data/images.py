"""Image data as users hold it, read through ``datasets`` (and Pillow), for the fine-tunes that train an image
grid (``vision``) or a CLIP-style model on image-caption pairs (``image-text``). A path is: a folder in the
``imagefolder`` convention (class subfolders give labels; a ``metadata.jsonl`` / ``.csv`` / ``.parquet`` with
``file_name`` and ``text`` gives captions; ``train/``, ``test/`` … are splits); a ``.jsonl`` / ``.json`` / ``.csv``
/ ``.parquet`` file with an image column (paths relative to its folder, or images) and a caption and/or label
column; a folder written by ``save_to_disk``; or a Hub dataset id (``owner/name``, from the ``datasets`` cache
when ``HF_HUB_OFFLINE`` is set). Every image is decoded once when read: those that cannot be are left out with one
warning (the first named, all counted); data more than half unusable is refused. Items then decode lazily, in RGB
(:func:`rgb`). ``datasets`` and Pillow are imported only when called.

One module a job: :mod:`.image_sources` reads a path or Hub id, :mod:`.image_columns` normalises its columns
(captions, labels), :mod:`.image_checks` decodes every image once, :func:`posextend.data.heldout.split_images` holds
some out."""

from __future__ import annotations

import collections.abc
import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from posextend.data.image_checks import named, reason, undecoded, usable
from posextend.data.image_columns import NEEDS, joined, normalized
from posextend.data.image_sources import parts
from posextend.errors import DataError

if TYPE_CHECKING:
    import datasets
    import PIL.Image

log = logging.getLogger(__name__)

INSTALL = 'Reading images needs the datasets library and Pillow: pip install "posextend[images]".'


class ImageData(collections.abc.Sequence):
    """Images (and their captions and/or labels) as a fine-tune reads them: item ``i`` is a dict
    ``{"image": PIL.Image in RGB, "text": str | None, "label": int | None}``, decoded when asked for.

    Attributes:
        dataset: the ``datasets.Dataset`` behind it: ``image`` (a ``datasets.Image``), and ``text`` (strings)
            and/or ``label`` (a ``datasets.ClassLabel``) where the data has them.
        label_names: the class names in label order (``label_names[item["label"]]``), or None without labels;
            integer labels without names are named by their number (``"0"`` … ``"9"``).
        skipped: the items left out when the data was read (unreadable images; with captions or labels needed,
            items without one). A view (:meth:`select`) keeps its source's count.
        source: what the data was read from (its paths, or Hub id), for messages.
        has_text, has_labels: whether the items have captions, labels.
    """

    def __init__(self, dataset: datasets.Dataset, *, label_names: list[str] | None, source: str, skipped: int = 0):
        self.dataset, self.label_names, self.source, self.skipped = dataset, label_names, source, skipped
        self.has_text, self.has_labels = "text" in dataset.column_names, "label" in dataset.column_names

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        index = range(len(self))[index]  # an item's place (IndexError past the end), or a range for a slice
        if isinstance(index, range):
            return self.select(index)
        try:
            row = self.dataset[index]
            image = rgb(row["image"])
        except (OSError, ValueError, SyntaxError) as exc:  # changed on disk since it was read
            where = named(undecoded(self.dataset)[index]["image"], index, self.source)
            raise DataError(f"Cannot read image {where} any more ({reason(exc)}): read the data again.") from None
        label = row.get("label")
        return {"image": image, "text": row.get("text"), "label": None if label is None or label < 0 else label}

    def select(self, indices: Sequence[int] | range) -> ImageData:
        """A view of the items at ``indices`` (``datasets.Dataset.select``: nothing is copied)."""
        return ImageData(self.dataset.select(indices), label_names=self.label_names, source=self.source,
                         skipped=self.skipped)

    def __repr__(self) -> str:
        return f"ImageData({len(self)} images of {self.source}, columns {self.dataset.column_names})"


def read_images(paths: Sequence[str | Path], *, need: str | None = None, revision: str | None = None,
                split: str | None = None, progress: Callable[[int, int], None] | None = None) -> ImageData:
    """Images from folders, tables of image paths, saved datasets and Hub datasets (see the module), every
    image decoded once here to leave out those that cannot be read.

    Args:
        paths: one or more sources, concatenated (with the same columns: captions, labels; labels are
            renumbered to the union of the class names).
        need: ``"text"`` (captions required: image-text), ``"labels"`` (classes required), or None (images
            alone are enough: label-free). Items without what is needed are left out and counted.
        revision: a Hub dataset's branch, tag or commit (a local path takes none).
        split: the split of data that has several (a Hub dataset, a saved ``DatasetDict``, a folder with
            ``train/`` and ``test/``); default ``train``, or the only one.
        progress: called as ``progress(checked, total)`` while the images are checked.

    Returns:
        :class:`ImageData`, decoding each item when asked for, in RGB.

    Raises:
        DataError: one line naming the path, file or column, and what to do.
    """
    if need not in (None, *NEEDS):
        raise ValueError(f"need={need!r}: give 'text', 'labels' or None.")
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)  # one path, given alone
    if not paths:
        raise DataError("No image data given: give a folder of images, a .jsonl/.csv/.parquet file of image paths, "
                        "a saved dataset, or a Hugging Face Hub dataset id.")
    with _reading():
        found = [part for path in paths for part in parts(path, revision=revision, split=split)]
        dataset, names = joined([(name, *normalized(d, base, origin=name, need=need)) for name, d, base in found])
        origin = ", ".join(map(str, paths))
        dataset, skipped = usable(dataset, origin=origin, need=need, progress=progress)
    log.info("Read %d images from %s", len(dataset), origin)
    return ImageData(dataset, label_names=names, source=origin, skipped=skipped)


def rgb(image: PIL.Image.Image) -> PIL.Image.Image:
    """``image`` in RGB as CLIP's and ViT's image processors make it (transformers' ``convert_to_rgb``): an image
    with transparency (RGBA, LA, a palette with a transparent colour) composited on white; grayscale, palette
    and CMYK converted; 16- and 32-bit integer images scaled from 0..65535 to 8 bits (Pillow's conversion clips
    them: most pixels would turn white); a float image taken as 0..1 when it is."""
    import PIL.Image

    if image.mode == "RGB":
        return image
    if image.mode.startswith("I") or image.mode == "F":
        import numpy as np

        pixels = np.asarray(image, dtype=np.float64)
        scale = 1 / 257 if image.mode != "F" else (255 if pixels.max(initial=0) <= 1 else 1)
        return PIL.Image.fromarray(np.clip(pixels * scale, 0, 255).round().astype(np.uint8)).convert("RGB")
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return PIL.Image.alpha_composite(PIL.Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


@contextlib.contextmanager
def _reading() -> Iterator[Any]:
    """The ``datasets`` module, its progress bars off meanwhile (the command line shows its own)."""
    try:
        import datasets
        import PIL.Image  # noqa: F401  (datasets decodes images with it)
    except ImportError:
        raise DataError(INSTALL) from None
    shown = not datasets.utils.are_progress_bars_disabled()
    datasets.utils.disable_progress_bars()
    try:
        yield datasets
    finally:
        if shown:
            datasets.utils.enable_progress_bars()

