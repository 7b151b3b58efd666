"""Where image data comes from: a path or Hub id read as ``datasets`` records, not yet normalised. A folder in the
``imagefolder`` convention (class subfolders give labels; metadata files give captions; ``train/``, ``test/`` … are
splits), a table of image paths, a folder written by ``save_to_disk``, or a Hub dataset id."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from posextend.data.image_checks import reason
from posextend.data.image_columns import with_labels
from posextend.errors import DataError
from posextend.files.sources import hub_id

if TYPE_CHECKING:
    import datasets

log = logging.getLogger(__name__)

TABLES = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}  # suffix -> datasets builder
METADATA = ("metadata.jsonl", "metadata.csv", "metadata.parquet")  # captions in a folder (imagefolder's names)
SAVED = ("state.json", "dataset_dict.json")  # a folder written by save_to_disk holds one of these


def parts(raw: str | Path, *, revision: str | None, split: str | None) -> list[tuple[str, Any, Path | None]]:
    """The records at ``raw`` (any of the kinds the module names) as ``(what they were read from, datasets.Dataset, the
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
        raise DataError(f"Cannot read the saved dataset {path} ({reason(exc, image=False)}): save it again with "
                        "save_to_disk, or give the images themselves.") from exc
    splits = loaded if hasattr(loaded, "keys") else {"train": loaded}  # a Dataset: one split
    return splits[_chosen(list(splits), split, str(path))]


def _chosen(splits: list[str], split: str | None, origin: str) -> str:
    """``split`` (default ``train``, or the only one) of ``origin``'s ``splits``."""
    chosen = split or ("train" if "train" in splits or len(splits) != 1 else splits[0])
    if chosen not in splits:
        raise DataError(f"{origin} has no split {chosen!r}: its splits are {', '.join(splits)}; name one of them.")
    if len(splits) > 1 or chosen != "train":
        log.info("Reading split %r of %s (its splits: %s)", chosen, origin, ", ".join(splits))
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
        records = with_labels(records, [classes[p.parent.name] for p in images], list(classes))
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
        raise DataError(f"Cannot read {path} as a {path.suffix.lower()[1:]} table ({reason(exc, image=False)}): "
                        "give one record per image, with its path and caption or label.") from exc


def _hub(name: str, revision: str | None, split: str | None) -> datasets.Dataset:
    import datasets
    from huggingface_hub import constants

    at = f" at revision {revision}" if revision else ""
    try:
        return datasets.load_dataset(name, revision=revision, split=split or "train")
    except ValueError as exc:  # no such split, and the like
        raise DataError(f"Cannot read the Hub dataset {name}{at}: {reason(exc, image=False)}") from None
    except Exception as exc:  # offline and not cached, no such dataset, gated, no network: one line
        why = ("HF_HUB_OFFLINE is set and the datasets cache does not hold it (unset HF_HUB_OFFLINE to download it)"
               if constants.HF_HUB_OFFLINE or getattr(datasets.config, "HF_HUB_OFFLINE", False) else
               f"{reason(exc, image=False)} (check the id; a private or gated one needs `hf auth login`)")
        raise DataError(f"{name} is not a path here, and the Hub dataset {name}{at} cannot be had: {why}; or give a "
                        "local folder or file of images.") from exc

