"""Image records normalised to the columns :class:`~posextend.data.images.ImageData` reads: ``image`` (a
``datasets.Image``), ``text`` (one caption, a string) and ``label`` (a ``datasets.ClassLabel``), found by feature type,
then by name; and several sources' records joined, their labels renumbered to the union of class names."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from posextend.errors import DataError

if TYPE_CHECKING:
    import datasets

IMAGE_COLUMNS = ("image", "file_name", "image_path", "path", "filepath", "img")  # where no column is an Image
TEXT_COLUMNS = ("text", "caption", "captions", "sentence")
LABEL_COLUMNS = ("label", "labels", "class")
NEEDS = {"text": ("captions", TEXT_COLUMNS), "labels": ("labels", LABEL_COLUMNS)}  # need= -> (what, its columns)


def normalized(dataset: datasets.Dataset, base: Path | None, *, origin: str, need: str | None
                ) -> tuple[datasets.Dataset, list[str] | None]:
    """``dataset`` with the columns :class:`~posextend.data.images.ImageData` reads: ``image``, and ``text`` /
    ``label`` where found (by feature type, then by name); and the label names."""
    import datasets

    if len(dataset) == 0:
        raise DataError(f"{origin} holds no records: give data with at least a few images.")
    typed = {type(f): c for c, f in reversed(dataset.features.items())}  # the first column of each feature type
    image = typed.get(datasets.Image) or _column(dataset, IMAGE_COLUMNS)
    if image is None:
        raise DataError(f"{origin} has no image column: none holds images or is named {', '.join(IMAGE_COLUMNS)} "
                        f"(its columns are {', '.join(dataset.column_names)}); name the column of image paths so.")
    text = _column(dataset, TEXT_COLUMNS)
    label = typed.get(datasets.ClassLabel) or _column(dataset, LABEL_COLUMNS)
    if need and not {"text": text, "labels": label}[need]:
        what, names = NEEDS[need]
        hint = ("captions in a metadata.jsonl or metadata.csv (file_name, text), or a caption column" if need == "text"
                else "a subfolder of images for each class (two at least), or a label column")
        raise DataError(f"{origin} has no {what}: no column is named {', '.join(names)} (its columns are "
                        f"{', '.join(dataset.column_names)}); give {hint}.")
    columns = {image: "image", **({text: "text"} if text else {}), **({label: "label"} if label else {})}
    dataset = dataset.select_columns(list(columns)).rename_columns({k: v for k, v in columns.items() if k != v})
    if not isinstance(dataset.features["image"], datasets.Image):
        dataset = _as_images(dataset, base, origin)
    dataset = _captions(dataset, origin) if text else dataset
    return _classes(dataset, origin) if label else (dataset, None)


def _column(dataset: datasets.Dataset, names: Sequence[str]) -> str | None:
    lower = {c.lower(): c for c in dataset.column_names}
    return next((lower[n] for n in names if n in lower), None)


def _as_images(dataset: datasets.Dataset, base: Path | None, origin: str) -> datasets.Dataset:
    """The ``image`` column (paths, relative to ``base``; or ``{"bytes", "path"}`` records) as images."""
    import datasets

    feature = dataset.features["image"]
    if isinstance(feature, dict) and {"bytes", "path"} >= set(feature):
        return dataset.cast_column("image", datasets.Image())
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise DataError(f"The image column of {origin} holds {getattr(feature, 'dtype', feature)} values: give image "
                        "paths (relative to the file's folder) or images.")
    paths = [_resolved(p, base) for p in dataset["image"][:]]
    return dataset.remove_columns("image").add_column("image", paths).cast_column("image", datasets.Image())


def _resolved(path: str | None, base: Path | None) -> str | None:
    if not path or "://" in path:
        return path
    path = os.path.expanduser(path)
    return path if base is None or os.path.isabs(path) else str(base / path)


def _captions(dataset: datasets.Dataset, origin: str) -> datasets.Dataset:
    """The ``text`` column as strings: of a list of captions, the first."""
    import datasets

    feature = dataset.features["text"]
    if isinstance(feature, (datasets.Sequence, list)):  # datasets 4+: List, a Sequence
        firsts = [c[0] if c else None for c in dataset["text"][:]]
        return dataset.remove_columns("text").add_column("text", firsts).cast_column("text", datasets.Value("string"))
    if getattr(feature, "dtype", None) in ("string", "large_string", "int64", "int32", "float64", "bool", "null"):
        return dataset.cast_column("text", datasets.Value("string")) if feature.dtype != "string" else dataset
    raise DataError(f"The caption column of {origin} holds {feature} values: give one caption (text) per image.")


def _classes(dataset: datasets.Dataset, origin: str) -> tuple[datasets.Dataset, list[str]]:
    """The ``label`` column as a ``ClassLabel``: names kept, strings sorted, integers named by their number."""
    import datasets

    if isinstance(dataset.features["label"], datasets.ClassLabel):
        return dataset, list(dataset.features["label"].names)
    # not datasets' class_encode_column: it renumbers class numbers as sorted strings ("10" before "2"), 7 -> "7" here
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
        raise DataError(f"The label column of {origin} holds {dataset.features['label']} values: give class names, "
                        "or class numbers from 0.")
    return with_labels(dataset, ids, names), names


def with_labels(dataset: datasets.Dataset, ids: list[int | None], names: list[str]) -> datasets.Dataset:
    import datasets

    dataset = dataset.select_columns([c for c in dataset.column_names if c != "label"]).add_column("label", ids)
    return dataset.cast_column("label", datasets.ClassLabel(names=names))


def joined(parts: list[tuple[str, datasets.Dataset, list[str] | None]]) -> tuple[datasets.Dataset, list[str] | None]:
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
            parts[k] = (p, d if part == names else with_labels(d, [None if i is None or i < 0 else to[i]
                                                                  for i in d["label"][:]], names), names)
    return datasets.concatenate_datasets([d.select_columns(dataset.column_names) for _, d, _ in parts]), names

