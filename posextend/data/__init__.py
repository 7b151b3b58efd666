"""The data a fine-tune reads, as users hold it, and its held-out part.

Owns :mod:`.text` (documents and ``(source, target)`` pairs from text files and JSON Lines), :mod:`.images` (images
and image-caption pairs through ``datasets``: :mod:`.image_sources` reads them, :mod:`.image_columns` normalises
their columns, :mod:`.image_checks` decodes each once) and :mod:`.heldout` (the held-out split of each kind).
Tokenises nothing (:mod:`posextend.scoring.text` packs documents into token windows). May import:
``posextend.errors``, ``posextend.files``.

**The items protocol** (:class:`Items`), which every reader keeps, and a new one (audio clips …) follows:

- A reader takes ``paths`` (files, folders; a Hub id where it reads one) and returns an :class:`Items`: a sequence
  with ``len``, an item by index, and a slice of the same kind. Data it cannot use raises
  :class:`~posextend.errors.DataError`, one line naming the path and what to do.
- An item is, for text (:func:`.text.read_documents`), a document: a ``str``; for pairs
  (:func:`.text.read_pairs`), a ``(source, target)`` tuple of ``str``; for images (:func:`.images.read_images`), a
  dict ``{"image": PIL.Image in RGB, "text": str | None, "label": int | None}``, decoded when asked for. An
  objective's samples wrap items the same way (``captions.Pairs`` adds a caption's token count).
- ``need=`` names what every item must hold for the run (images: ``"text"``, a caption; ``"labels"``, a class; None,
  the image alone). Items without it are left out with one warning and counted (``skipped``); data mostly without
  it is refused. A reader whose items are always whole (text) takes none.
- A split (:mod:`.heldout`) is ``(train, held_out)`` of whole items: a seeded draw of a share of the data
  (:data:`.heldout.SHARE`, at most :data:`.heldout.MOST`), the same items for a seed every run, ``train`` in the
  data's order; images by class, in proportion. Only a long text document may give its tail.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Items(Protocol):
    """What a reader returns (see the package): ``len(items)``, ``items[i]`` an item, ``items[a:b]`` a slice of the
    same kind. A list satisfies it, as :class:`~posextend.data.images.ImageData` does."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: Any) -> Any: ...
