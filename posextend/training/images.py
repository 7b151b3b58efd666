"""Image data as users hold it, read through ``datasets`` (and Pillow), for the fine-tunes that train an image
grid (``vision``) or a CLIP-style model on image-caption pairs (``image-text``). A path is: a folder in the
``imagefolder`` convention (class subfolders give labels; a ``metadata.jsonl`` / ``.csv`` / ``.parquet`` with
``file_name`` and ``text`` gives captions; ``train/``, ``test/`` … are splits); a ``.jsonl`` / ``.json`` / ``.csv``
/ ``.parquet`` file with an image column (paths relative to its folder, or images) and a caption and/or label
column; a folder written by ``save_to_disk``; or a Hub dataset id (``owner/name``, from the ``datasets`` cache
when ``HF_HUB_OFFLINE`` is set). Every image is decoded once when read: those that cannot be are left out with one
warning (the first named, all counted); data more than half unusable is refused. Items then decode lazily, in RGB
(:func:`rgb`). ``datasets`` and Pillow are imported only when called."""

from __future__ import annotations

import collections.abc
import contextlib
import io
import logging
import math
import os
import random
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from posextend.errors import DataError
from posextend.files.sources import hub_id
from posextend.training.heldout import MOST, SHARE

if TYPE_CHECKING:
    import datasets
    import PIL.Image

log = logging.getLogger(__name__)

IMAGE_COLUMNS = ("image", "file_name", "image_path", "path", "filepath", "img")  # where no column is an Image
TEXT_COLUMNS = ("text", "caption", "captions", "sentence")
LABEL_COLUMNS = ("label", "labels", "class")
NEEDS = {"text": ("captions", TEXT_COLUMNS), "labels": ("labels", LABEL_COLUMNS)}
TABLES = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}  # suffix -> datasets builder
METADATA = ("metadata.jsonl", "metadata.csv", "metadata.parquet")  # captions in a folder (imagefolder's names)
SAVED = ("state.json", "dataset_dict.json")  # a folder written by save_to_disk holds one of these
MOST_UNUSABLE = 0.5  # refuse data whose share of unreadable images (or items lacking what is needed) is larger
BATCH = 512  # images checked per batch (and per progress call)
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
            where = _named(_undecoded(self.dataset)[index]["image"], index, self.source)
            raise DataError(f"Cannot read image {where} any more ({_reason(exc)}): read the data again.") from None
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
        parts = [part for path in paths for part in _parts(path, revision=revision, split=split)]
        dataset, names = _joined([(name, *_normalized(d, base, source=name, need=need)) for name, d, base in parts])
        return _checked(dataset, names, source=", ".join(map(str, paths)), need=need, progress=progress)


def split_images(data: ImageData, *, share: float = SHARE, least: int = 0, seed: int = 0
                 ) -> tuple[ImageData, ImageData]:
    """``(train, held_out)``: a seeded ``share`` of the items (at least ``least``, and one; never more than
    :data:`~posextend.training.heldout.MOST` of them) held out whole. With labels each class gives its share
    (largest remainders first), so the held-out part has the classes in proportion. Both keep the data's order.

    Raises:
        DataError: too few items to hold one out and train on the rest.
    """
    n = len(data)
    want = min(max(1, round(share * n), least), math.floor(MOST * n))
    if want < 1:
        raise DataError(f"The image data ({data.source}) holds {n} item(s): too few to hold some out for judging "
                        "the fine-tune and train on the rest. Give more images, or held-out images of their own.")
    order = random.Random(seed).sample(range(n), n)  # a seeded shuffle
    held = set(_stratified(order, data.dataset["label"][:], want) if data.has_labels else order[:want])
    return data.select([i for i in range(n) if i not in held]), data.select(sorted(held))


def _stratified(order: list[int], labels: list[int | None], want: int) -> list[int]:
    """``want`` items of ``order`` (shuffled): each label's share of them, its first items in ``order``."""
    groups: dict[int | None, list[int]] = {}
    for i in order:
        groups.setdefault(labels[i], []).append(i)
    quota = {label: want * len(items) / len(order) for label, items in groups.items()}
    take = {label: math.floor(q) for label, q in quota.items()}
    for label in sorted(groups, key=lambda label: take[label] - quota[label])[: want - sum(take.values())]:
        take[label] += 1
    return [i for label, items in groups.items() for i in items[: take[label]]]


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


def _parts(raw: str | Path, *, revision: str | None, split: str | None) -> list[tuple[str, Any, Path | None]]:
    """The records at ``raw`` (any of the module's kinds) as ``(what they were read from, datasets.Dataset, the
    folder relative image paths start from)``: one part, or a folder's metadata files a part each."""
    path = Path(raw).expanduser()
    if path.exists() and revision is not None:
        raise DataError(f"{raw} is a local path; a revision ({revision}) selects a version of a dataset on the "
                        "Hugging Face Hub: give its id, or leave the revision unset.")
    if path.is_dir():
        return [(str(raw), _saved(path, split), path)] if any((path / n).is_file() for n in SAVED) else \
            _folder(path, split)
    if path.is_file():
        if path.suffix.lower() not in TABLES:
            raise DataError(f"{raw} is neither a folder of images nor a table of them: give a folder (class "
                            f"subfolders give labels) or a {'/'.join(TABLES)} file with an image path column.")
        return [(str(raw), _table(path), path.parent)]
    if isinstance(raw, str) and hub_id(raw):
        return [(raw, _hub(raw, revision, split), None)]
    raise DataError(f"Data path {raw} does not exist.")


def _saved(path: Path, split: str | None) -> datasets.Dataset:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # whatever datasets raised on a damaged folder: one line
        raise DataError(f"Cannot read the saved dataset {path} ({_reason(exc, image=False)}): save it again with "
                        "save_to_disk, or give the images themselves.") from exc
    splits = loaded if hasattr(loaded, "keys") else {"train": loaded}  # a Dataset: one split
    return splits[_chosen(list(splits), split, str(path))]


def _chosen(splits: list[str], split: str | None, source: str) -> str:
    """``split`` (default ``train``, or the only one) of ``source``'s ``splits``."""
    chosen = split or ("train" if "train" in splits or len(splits) != 1 else splits[0])
    if chosen not in splits:
        raise DataError(f"{source} has no split {chosen!r}: its splits are {', '.join(splits)}; name one of them.")
    if len(splits) > 1 or chosen != "train":
        log.info("Reading split %r of %s (its splits: %s)", chosen, source, ", ".join(splits))
    return chosen


def _folder(path: Path, split: str | None) -> list[tuple[str, Any, Path | None]]:
    """A folder in the ``imagefolder`` convention, or its split subfolder: its metadata files, a part each; else
    its images, labelled by class subfolders (two or more, at one depth). Listed here in one walk of the tree:
    ``load_dataset("imagefolder")`` globs it some 60 times (17 s for 5,000 images)."""
    import datasets
    from datasets.data_files import SPLIT_KEYWORDS
    from datasets.packaged_modules.imagefolder.imagefolder import ImageFolder

    kinds = {keyword: str(name) for name, keywords in SPLIT_KEYWORDS.items() for keyword in keywords}
    splits = {kinds[p.name.lower()]: p for p in sorted(path.iterdir()) if p.is_dir() and p.name.lower() in kinds}
    root = (splits or {"train": path})[_chosen(list(splits or ["train"]), split, str(path))]
    images, metadata = _scan(root, set(ImageFolder.EXTENSIONS))
    if metadata:
        return [(str(m), _table(m), m.parent) for m in metadata]
    if not images:
        raise DataError(f"{root} holds no images (.png, .jpg, .webp, .bmp, .tif …): give a folder of image files, "
                        "a subfolder for each class, or captions in a metadata.jsonl (file_name, text).")
    records = datasets.Dataset.from_dict({"image": [str(p) for p in images]}).cast_column("image", datasets.Image())
    classes = {name: i for i, name in enumerate(sorted({p.parent.name for p in images}))}
    if len(classes) > 1 and len({len(p.relative_to(root).parts) for p in images}) == 1:
        records = _with_labels(records, [classes[p.parent.name] for p in images], list(classes))
    return [(str(path), records, None)]


def _scan(root: Path, extensions: set[str]) -> tuple[list[Path], list[Path]]:
    """The image files (by extension) and metadata files under ``root``, hidden ones left aside, in order."""
    images, metadata = [], []
    for folder, subfolders, files in os.walk(root, followlinks=True):  # class folders are often links
        subfolders[:] = sorted(d for d in subfolders if not d.startswith((".", "__")))
        for name in sorted(files):
            if name in METADATA:
                metadata.append(Path(folder, name))
            elif not name.startswith(".") and os.path.splitext(name)[1].lower() in extensions:
                images.append(Path(folder, name))
    return images, metadata


def _table(path: Path) -> datasets.Dataset:
    import datasets

    if path.stat().st_size == 0:
        raise DataError(f"{path} is empty: give one record per image, with its path and caption or label.")
    try:
        return datasets.load_dataset(TABLES[path.suffix.lower()], data_files=str(path), split="train")
    except Exception as exc:  # not JSON, not CSV, not Parquet: one line naming the file
        raise DataError(f"Cannot read {path} as a {path.suffix.lower()[1:]} table ({_reason(exc, image=False)}): "
                        "give one record per image, with its path and caption or label.") from exc


def _hub(name: str, revision: str | None, split: str | None) -> datasets.Dataset:
    import datasets
    from huggingface_hub import constants

    at = f" at revision {revision}" if revision else ""
    try:
        return datasets.load_dataset(name, revision=revision, split=split or "train")
    except ValueError as exc:  # no such split, and the like
        raise DataError(f"Cannot read the Hub dataset {name}{at}: {_reason(exc, image=False)}") from None
    except Exception as exc:  # offline and not cached, no such dataset, gated, no network: one line
        why = ("HF_HUB_OFFLINE is set and the datasets cache does not hold it (unset HF_HUB_OFFLINE to download it)"
               if constants.HF_HUB_OFFLINE or getattr(datasets.config, "HF_HUB_OFFLINE", False) else
               f"{_reason(exc, image=False)} (check the id; a private or gated one needs `hf auth login`)")
        raise DataError(f"{name} is not a path here, and the Hub dataset {name}{at} cannot be had: {why}; or give a "
                        "local folder or file of images.") from exc


def _normalized(dataset: datasets.Dataset, base: Path | None, *, source: str, need: str | None
                ) -> tuple[datasets.Dataset, list[str] | None]:
    """``dataset`` with the columns :class:`ImageData` reads: ``image``, and ``text`` / ``label`` where found
    (by feature type, then by name); and the label names."""
    import datasets

    if len(dataset) == 0:
        raise DataError(f"{source} holds no records: give data with at least a few images.")
    typed = {type(f): c for c, f in reversed(dataset.features.items())}  # the first column of each feature type
    image = typed.get(datasets.Image) or _column(dataset, IMAGE_COLUMNS)
    if image is None:
        raise DataError(f"{source} has no image column: none holds images or is named {', '.join(IMAGE_COLUMNS)} "
                        f"(its columns are {', '.join(dataset.column_names)}); name the column of image paths so.")
    text = _column(dataset, TEXT_COLUMNS)
    label = typed.get(datasets.ClassLabel) or _column(dataset, LABEL_COLUMNS)
    if need and not {"text": text, "labels": label}[need]:
        what, names = NEEDS[need]
        hint = ("captions in a metadata.jsonl or metadata.csv (file_name, text), or a caption column" if need == "text"
                else "a subfolder of images for each class (two at least), or a label column")
        raise DataError(f"{source} has no {what}: no column is named {', '.join(names)} (its columns are "
                        f"{', '.join(dataset.column_names)}); give {hint}.")
    columns = {image: "image", **({text: "text"} if text else {}), **({label: "label"} if label else {})}
    dataset = dataset.select_columns(list(columns)).rename_columns({k: v for k, v in columns.items() if k != v})
    if not isinstance(dataset.features["image"], datasets.Image):
        dataset = _as_images(dataset, base, source)
    dataset = _captions(dataset, source) if text else dataset
    return _classes(dataset, source) if label else (dataset, None)


def _column(dataset: datasets.Dataset, names: Sequence[str]) -> str | None:
    lower = {c.lower(): c for c in dataset.column_names}
    return next((lower[n] for n in names if n in lower), None)


def _as_images(dataset: datasets.Dataset, base: Path | None, source: str) -> datasets.Dataset:
    """The ``image`` column (paths, relative to ``base``; or ``{"bytes", "path"}`` records) as images."""
    import datasets

    feature = dataset.features["image"]
    if isinstance(feature, dict) and {"bytes", "path"} >= set(feature):
        return dataset.cast_column("image", datasets.Image())
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise DataError(f"The image column of {source} holds {getattr(feature, 'dtype', feature)} values: give image "
                        "paths (relative to the file's folder) or images.")
    paths = [_resolved(p, base) for p in dataset["image"][:]]
    return dataset.remove_columns("image").add_column("image", paths).cast_column("image", datasets.Image())


def _resolved(path: str | None, base: Path | None) -> str | None:
    if not path or "://" in path:
        return path
    path = os.path.expanduser(path)
    return path if base is None or os.path.isabs(path) else str(base / path)


def _captions(dataset: datasets.Dataset, source: str) -> datasets.Dataset:
    """The ``text`` column as strings: of a list of captions, the first."""
    import datasets

    feature = dataset.features["text"]
    if isinstance(feature, (datasets.Sequence, list)):  # datasets 4+: List, a Sequence
        firsts = [c[0] if c else None for c in dataset["text"][:]]
        return dataset.remove_columns("text").add_column("text", firsts).cast_column("text", datasets.Value("string"))
    if getattr(feature, "dtype", None) in ("string", "large_string", "int64", "int32", "float64", "bool", "null"):
        return dataset.cast_column("text", datasets.Value("string")) if feature.dtype != "string" else dataset
    raise DataError(f"The caption column of {source} holds {feature} values: give one caption (text) per image.")


def _classes(dataset: datasets.Dataset, source: str) -> tuple[datasets.Dataset, list[str]]:
    """The ``label`` column as a ``ClassLabel``: names kept, strings sorted, integers named by their number."""
    import datasets

    if isinstance(dataset.features["label"], datasets.ClassLabel):
        return dataset, list(dataset.features["label"].names)
    values = dataset["label"][:]  # a list (datasets 4+ gives a lazy column)
    present = [v for v in values if v is not None]
    if all(isinstance(v, str) for v in present):
        names = sorted(set(present))
        index = {n: i for i, n in enumerate(names)}
        ids = [None if v is None else index[v] for v in values]
    elif all(isinstance(v, (int, float)) and float(v).is_integer() and v >= 0 for v in present):
        ids = [None if v is None else int(v) for v in values]
        names = [str(i) for i in range(max((i for i in ids if i is not None), default=0) + 1)]
    else:
        raise DataError(f"The label column of {source} holds {dataset.features['label']} values: give class names, "
                        "or class numbers from 0.")
    return _with_labels(dataset, ids, names), names


def _with_labels(dataset: datasets.Dataset, ids: list[int | None], names: list[str]) -> datasets.Dataset:
    import datasets

    dataset = dataset.select_columns([c for c in dataset.column_names if c != "label"]).add_column("label", ids)
    return dataset.cast_column("label", datasets.ClassLabel(names=names))


def _joined(parts: list[tuple[str, datasets.Dataset, list[str] | None]]) -> tuple[datasets.Dataset, list[str] | None]:
    """The parts' records in one dataset (the same columns in each; labels renumbered to the union of names)."""
    import datasets

    first, dataset, names = parts[0]
    if len(parts) == 1:
        return dataset, names
    for path, other, _ in parts[1:]:
        if set(other.column_names) != set(dataset.column_names):
            raise DataError(f"{path} has the columns {', '.join(sorted(other.column_names))} but {first} has "
                            f"{', '.join(sorted(dataset.column_names))}: give data with the same columns (captions, "
                            "labels) in every part.")
    if names is not None:
        names = sorted({n for _, _, part in parts for n in part}, key=lambda n: (0, int(n), n) if n.isdigit() else
                       (1, 0, n))
        for k, (p, d, part) in enumerate(parts):
            to = [names.index(n) for n in part]
            parts[k] = (p, d if part == names else _with_labels(d, [None if i is None or i < 0 else to[i]
                                                                  for i in d["label"][:]], names), names)
    return datasets.concatenate_datasets([d.select_columns(dataset.column_names) for _, d, _ in parts]), names


def _checked(dataset: datasets.Dataset, names: list[str] | None, *, source: str, need: str | None,
             progress: Callable[[int, int], None] | None) -> ImageData:
    """:class:`ImageData` of the items whose image decodes (and that have what ``need`` asks for): the others
    left out with one warning, or the data refused when they are more than half of it."""
    raw = _undecoded(dataset)
    bad = _lacking(dataset, need)
    bad.update(_undecodable(raw, skip=bad, progress=progress))
    if bad:
        first = min(bad)
        where = f"{_named(raw[first]['image'], first, source)}: {bad[first]}"
        counted = f"{len(bad):,} of {len(dataset):,} images of {source}"
        if len(bad) > MOST_UNUSABLE * len(dataset):
            raise DataError(f"{counted} cannot be used (the first: {where}): check that the paths name image files"
                            + (f", with the {NEEDS[need][0]}." if need else "."))
        log.warning("Left out %s that cannot be used (the first: %s)", counted, where)
        dataset = dataset.select([i for i in range(len(dataset)) if i not in bad])
    log.info("Read %d images from %s", len(dataset), source)
    return ImageData(dataset, label_names=names, source=source, skipped=len(bad))


def _undecoded(dataset: datasets.Dataset) -> datasets.Dataset:
    import datasets

    return dataset.select_columns(["image"]).cast_column("image", datasets.Image(decode=False))


def _lacking(dataset: datasets.Dataset, need: str | None) -> dict[int, str]:
    """The items without the caption or label ``need`` asks for, with why."""
    values = dataset[{"text": "text", "labels": "label"}[need]][:] if need else []
    return {i: f"no {NEEDS[need][0][:-1]}" for i, v in enumerate(values)
            if v is None or (not v.strip() if isinstance(v, str) else v < 0)}


def _undecodable(raw: datasets.Dataset, *, skip: dict[int, str], progress: Callable[[int, int], None] | None
                 ) -> dict[int, str]:
    """The items of ``raw`` (``{"bytes", "path"}`` records) whose image does not decode, with why; batch by
    batch, each split between a few threads (Pillow decodes without holding the GIL)."""
    bad: dict[int, str] = {}
    workers = min(4, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for start in range(0, len(raw), BATCH):
            todo = [(start + k, image) for k, image in enumerate(raw[start:start + BATCH]["image"])
                    if start + k not in skip]
            for found in pool.map(lambda items: {i: r for i, image in items if (r := _why_not(image))},
                                  [todo[w::workers] for w in range(workers)]):
                bad.update(found)
            if progress:
                progress(min(start + BATCH, len(raw)), len(raw))
    return bad


def _why_not(image: dict[str, Any]) -> str | None:
    """Why ``image`` (``{"bytes", "path"}``) does not decode, or None when it does. A JPEG decodes at an eighth
    of its size (every byte is still read: a truncated one shows)."""
    import PIL.Image

    source = io.BytesIO(image["bytes"]) if image.get("bytes") is not None else image.get("path") or ""
    try:
        with PIL.Image.open(source) as opened:
            opened.draft(opened.mode, (1, 1))
            opened.load()
    except Exception as exc:  # noqa: BLE001  (whatever Pillow raised on a file: the reason, never a traceback)
        return _reason(exc)
    return None


def _reason(exc: BaseException, *, image: bool = True) -> str:
    import PIL

    while not image and exc.__cause__ is not None:  # datasets' DatasetGenerationError: what went wrong is inside
        exc = exc.__cause__
    known = {PIL.UnidentifiedImageError: "not an image", FileNotFoundError: "no such file"} if image else {}
    return next((why for kind, why in known.items() if isinstance(exc, kind)), None) or \
        (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _named(image: dict[str, Any] | None, index: int, source: str) -> str:
    """An image as a message names it: its file when it has one of its own, else its place in ``source``."""
    path = (image or {}).get("path")
    if path and (image or {}).get("bytes") is None:
        return path
    return f"{source} item {index}" + (f" ({path})" if path else "")
