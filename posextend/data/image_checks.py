"""Image records checked before a run trusts them: every image decoded once (a JPEG at an eighth of its size, a few
threads at a time), the items that cannot be used (undecodable, or without the caption or label needed) left out with
one warning, and data mostly unusable refused; and how messages name an image and why it failed."""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from posextend.data.image_columns import NEEDS
from posextend.errors import DataError

if TYPE_CHECKING:
    import datasets

log = logging.getLogger(__name__)

MOST_UNUSABLE = 0.5  # refuse data whose share of unreadable images (or items lacking what is needed) is larger
BATCH = 512  # images checked per batch (and per progress call)


def usable(dataset: datasets.Dataset, *, origin: str, need: str | None, progress: Callable[[int, int], None] | None
           ) -> tuple[datasets.Dataset, int]:
    """``(the items whose image decodes and that have what need= asks for, how many others were left out)``: the
    others left out with one warning, or the data refused when they are more than half of it."""
    raw = undecoded(dataset)
    bad = _lacking(dataset, need)
    bad.update(_undecodable(raw, skip=bad, progress=progress))
    if bad:
        first = min(bad)
        where = f"{named(raw[first]['image'], first, origin)}: {bad[first]}"
        counted = f"{len(bad):,} of {len(dataset):,} images of {origin}"
        if len(bad) > MOST_UNUSABLE * len(dataset):
            raise DataError(f"{counted} cannot be used (the first: {where}): check that the paths name image files"
                            + (f", with the {NEEDS[need][0]}." if need else "."))
        log.warning("Left out %s that cannot be used (the first: %s)", counted, where)
        dataset = dataset.select([i for i in range(len(dataset)) if i not in bad])
    return dataset, len(bad)


def undecoded(dataset: datasets.Dataset) -> datasets.Dataset:
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

    readable = io.BytesIO(image["bytes"]) if image.get("bytes") is not None else image.get("path") or ""
    try:
        with PIL.Image.open(readable) as opened:
            opened.draft(opened.mode, (1, 1))
            opened.load()
    except Exception as exc:  # noqa: BLE001  (whatever Pillow raised on a file: the reason, never a traceback)
        return reason(exc)
    return None


def reason(exc: BaseException, *, image: bool = True) -> str:
    import PIL

    while not image and exc.__cause__ is not None:  # datasets' DatasetGenerationError: what went wrong is inside
        exc = exc.__cause__
    known = {PIL.UnidentifiedImageError: "not an image", FileNotFoundError: "no such file"} if image else {}
    return next((why for kind, why in known.items() if isinstance(exc, kind)), None) or \
        (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def named(image: dict[str, Any] | None, index: int, origin: str) -> str:
    """An image as a message names it: its file when it has one of its own, else its place in ``origin``."""
    path = (image or {}).get("path")
    if path and (image or {}).get("bytes") is None:
        return path
    return f"{origin} item {index}" + (f" ({path})" if path else "")
