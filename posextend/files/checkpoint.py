"""One checkpoint, resolved once: :class:`Checkpoint`.

A command (``resize-model``, ``inspect``, ``finetune``, ``eval``) resolves the checkpoint it is given
once and passes the :class:`Checkpoint` down. Each fact about it (where its transformers model sits,
its config, its sentence-transformers settings, its weights, their shapes, its provenance) is read
from disk the first time it is asked for, with the errors :mod:`posextend.files.sources` and
:mod:`posextend.files.reader` raise, and then kept: a command asks for them in the order it needs them,
so a damaged checkpoint fails where it failed before.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from posextend.errors import PosExtendError
from posextend.files import sources
from posextend.files.reader import CheckpointReader, SAFE_INDEX
from posextend.files.tensorfile import read_header


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """A checkpoint folder and what is known about it.

    ``directory`` is the folder the user named, resolved (:meth:`resolve`: a local folder, or the files of a
    Hugging Face Hub model in the Hugging Face cache). The model's own files are in :attr:`model_dir`: the folder
    itself, or the Transformer module's folder of an older sentence-transformers folder (``0_Transformer/``).
    Where a path is expected (``str()``, ``os.fspath``, ``/``, messages), a checkpoint stands for its ``directory``.

    Used as a context manager, it releases the weights it holds open (a ``.bin`` file's memory map)
    on leaving; it stays usable and opens them again when asked.

    Examples:
        >>> with Checkpoint.open("sentence-transformers/all-MiniLM-L6-v2") as ckpt:
        ...     ckpt.transformer_dir, ckpt.config["model_type"], ckpt.sentence_transformers
        ('', 'bert', True)
    """

    directory: Path
    hub_id: str | None = None  # the Hugging Face Hub id it was downloaded as (None: a local folder)
    commit: str | None = None  # with a hub id, the commit its files are

    @classmethod
    def resolve(cls, src: str | Path | Checkpoint, *, revision: str | None = None) -> Checkpoint:
        """The checkpoint ``src`` names: a local folder, or a Hugging Face Hub id whose files are downloaded
        into the cache at ``revision`` (:func:`~posextend.files.sources.resolve_source`, the one place that
        looks a source up); a :class:`Checkpoint` is returned as it is."""
        if isinstance(src, Checkpoint):
            return src
        directory = sources.resolve_source(src, revision=revision)
        repo = sources.hub_id(src)
        return cls(directory, repo, sources.snapshot_commit(directory) if repo else None)

    @property
    def name(self) -> str:
        """How another machine finds this checkpoint (its provenance records it as a source): the hub id it
        was downloaded as (at :attr:`commit`), else its folder."""
        return self.hub_id or str(self.directory)

    @classmethod
    def of(cls, directory: str | Path | Checkpoint) -> Checkpoint:
        """The checkpoint in ``directory``, a folder already resolved (not looked up again)."""
        return directory if isinstance(directory, Checkpoint) else cls(Path(directory))

    @classmethod
    def open(cls, src: str | Path | Checkpoint, *, revision: str | None = None) -> Checkpoint:
        """The checkpoint ``src`` names (:meth:`resolve`) with its model located, its config read and its weights
        opened lazily (:class:`~posextend.files.reader.CheckpointReader`), in that order; use it in a ``with``."""
        checkpoint = cls.resolve(src, revision=revision)
        checkpoint.config  # noqa: B018 - read now: the errors come in the order of the files
        checkpoint.reader  # noqa: B018
        return checkpoint

    @cached_property
    def transformer_dir(self) -> str:
        """Where the transformers model sits, relative to ``directory``: ``""`` at its root, or the Transformer
        module's folder (:func:`~posextend.files.sources.transformer_dir`)."""
        return sources.transformer_dir(self.directory)

    @property
    def model_dir(self) -> Path:
        """The folder of the transformers model: ``directory``, or its Transformer module's folder."""
        return self.directory / self.transformer_dir

    @cached_property
    def sentence_transformers(self) -> bool:
        """A sentence-transformers folder (``modules.json`` at its root)."""
        return (self.directory / sources.MODULES).is_file()

    @cached_property
    def st_config(self) -> Path | None:
        """The sentence-transformers settings file (``max_seq_length``) of the model, when there is one."""
        return sources.st_config(self.model_dir)

    @cached_property
    def config(self) -> dict[str, Any]:
        """The model's ``config.json`` (:func:`~posextend.files.sources.read_config`)."""
        return sources.read_config(self.model_dir)

    @cached_property
    def reader(self) -> CheckpointReader:
        """The model's weights by name, not loaded."""
        return CheckpointReader(self.model_dir)

    @cached_property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Each tensor's shape by name, from the weights' headers."""
        return {name: entry.shape for name, entry in self.reader.entries.items()}

    @cached_property
    def provenance(self) -> dict[str, str]:
        """posextend's provenance metadata, from the safetensors index or first file (empty when none)."""
        try:
            directory = self.model_dir
            if (directory / SAFE_INDEX).is_file():
                return json.loads((directory / SAFE_INDEX).read_text()).get("metadata", {})
            files = sorted(directory.glob("*.safetensors"))
            return read_header(files[0])[1] if files else {}
        except (PosExtendError, ValueError):
            return {}

    def close(self) -> None:
        """Release the weights held open, if they were opened."""
        reader = self.__dict__.get("reader")
        if reader is not None:
            reader.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __str__(self) -> str:
        return str(self.directory)

    def __fspath__(self) -> str:
        return str(self.directory)

    def __truediv__(self, name: str) -> Path:  # an objective's ``load`` may join names to it as to its folder
        return self.directory / name
