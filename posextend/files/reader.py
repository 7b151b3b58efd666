"""Lazy checkpoint reading: the weights of a checkpoint directory by name, without loading them.

Tensors are addressed by name and their bytes located from the safetensors header
(:mod:`posextend.files.tensorfile`), so that the writer passes them through as byte ranges.
Legacy ``pytorch_model.bin`` files are read with ``torch.load(weights_only=True, mmap=True)``,
one shard at a time.

Importing this module does not import torch (it takes longer than copying a GB). A row
strategy (``tile``) on safetensors never needs it: the new table is byte ranges of the old
one. Otherwise the file path starts torch's import in the background (:func:`prefetch_torch`)
and copies bytes meanwhile; only code that makes a tensor imports it.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator, Mapping
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any

from posextend.errors import CorruptCheckpointError, SourceError
from posextend.files.oserrors import reading
from posextend.files.tensorfile import Entry, dtype_code, read_header, torch_dtypes

if TYPE_CHECKING:
    import torch

SAFE_SINGLE, SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"
BIN_SINGLE, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"


def prefetch_torch() -> None:
    """Start importing torch in a background thread (no-op once imported or started)."""
    if "torch" not in sys.modules:
        threading.Thread(target=import_module, args=("torch",), name="posextend-import-torch", daemon=True).start()


def read_tensor(entry: Entry) -> torch.Tensor:
    """Read one tensor of a safetensors file (only its bytes)."""
    import torch

    dtypes = torch_dtypes()
    if entry.dtype not in dtypes:
        raise CorruptCheckpointError(f"Tensor {entry.name!r} has dtype {entry.dtype}, which torch cannot hold.")
    with reading(entry.file), open(entry.file, "rb") as f:
        f.seek(entry.start)
        data = bytearray(f.read(entry.nbytes))
    if len(data) != entry.nbytes:
        raise CorruptCheckpointError(f"{entry.file} is truncated inside tensor {entry.name!r}.")
    if not data:
        return torch.empty(entry.shape, dtype=dtypes[entry.dtype])
    return torch.frombuffer(data, dtype=dtypes[entry.dtype]).reshape(entry.shape)


# IEEE formats: bytes a value takes, and its exponent bits (all ones means NaN or Inf).
_EXPONENT = {"F64": (8, 0x7FF0000000000000), "F32": (4, 0x7F800000), "F16": (2, 0x7C00), "BF16": (2, 0x7F80)}
_SCAN = 4 * 1024 * 1024  # bytes read at a time (a multiple of every size above)


def nonfinite_count(entry: Entry) -> int | None:
    """NaN/Inf values in a safetensors tensor, from its bits (no torch, no numpy); None for other dtypes.

    A value's exponent bits lie in its two highest bytes, the last two of each value (little-endian):
    a value is NaN or Inf where both hold all of their bits, which two byte lookups tell.
    """
    if entry.dtype not in _EXPONENT:
        return None if entry.dtype.startswith("F8") else 0
    size, mask = _EXPONENT[entry.dtype]
    high, low = (mask >> 8 * (size - 1)) & 0xFF, (mask >> 8 * (size - 2)) & 0xFF
    all_high, all_low = (bytes(b & bits == bits for b in range(256)) for bits in (high, low))
    count, left = 0, entry.nbytes
    with reading(entry.file), open(entry.file, "rb") as f:
        f.seek(entry.start)
        while left > 0 and (data := f.read(min(left, _SCAN))):
            hits = (int.from_bytes(data[size - 1::size].translate(all_high), "little")
                    & int.from_bytes(data[size - 2::size].translate(all_low), "little"))
            count, left = count + hits.bit_count(), left - len(data)
    return count


class CheckpointReader:
    """The weights of a checkpoint directory, by name, without loading them.

    Layouts: ``model.safetensors``, sharded safetensors (``model.safetensors.index.json``),
    and legacy ``pytorch_model.bin`` (single or sharded). Safetensors is preferred when a
    directory has both.
    """

    def __init__(self, directory: Path):
        self.dir = directory
        if (directory / SAFE_INDEX).is_file():
            self.format, self.files = "safetensors", self._index_files(SAFE_INDEX)
        elif (directory / SAFE_SINGLE).is_file():
            self.format, self.files = "safetensors", [directory / SAFE_SINGLE]
        elif (directory / BIN_INDEX).is_file():
            self.format, self.files = "bin", self._index_files(BIN_INDEX)
        elif (directory / BIN_SINGLE).is_file():
            self.format, self.files = "bin", [directory / BIN_SINGLE]
        else:
            raise SourceError(
                f"No weights in {directory}: expected {SAFE_SINGLE}, {SAFE_INDEX}, {BIN_SINGLE} or {BIN_INDEX}."
            )
        self.sharded = len(self.files) > 1 or self.files[0].name not in (SAFE_SINGLE, BIN_SINGLE)
        self.metadata: dict[Path, dict[str, str]] = {}  # each safetensors file's header metadata
        self.index_metadata: dict[str, Any] = self._index_metadata()
        self.entries: dict[str, Entry] = {}
        self._bin_cache: tuple[Path, Mapping[str, torch.Tensor]] | None = None
        for path in self.files:
            for entry in self._scan(path):
                if entry.name in self.entries:
                    raise CorruptCheckpointError(f"Tensor {entry.name!r} appears in two shards of {directory}.")
                self.entries[entry.name] = entry

    def _index_files(self, index_name: str) -> list[Path]:
        try:
            weight_map = json.loads((self.dir / index_name).read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CorruptCheckpointError(f"{self.dir / index_name} is not a valid index ({exc}).") from None
        files = [self.dir / f for f in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise SourceError(f"Shards listed in {index_name} are missing: {', '.join(missing)}.")
        return files

    def _index_metadata(self) -> dict[str, Any]:
        """The safetensors index's metadata (provenance an earlier write recorded), without its total size."""
        if self.format != "safetensors" or not self.sharded:
            return {}
        metadata = json.loads((self.dir / SAFE_INDEX).read_text()).get("metadata") or {}
        return {k: v for k, v in metadata.items() if k != "total_size"} if isinstance(metadata, dict) else {}

    def _scan(self, path: Path) -> list[Entry]:
        if self.format == "safetensors":
            entries, self.metadata[path] = read_header(path)
            return entries
        state = self._load_bin(path)
        return [Entry(name, path, dtype_code(t.dtype), tuple(t.shape)) for name, t in state.items()]

    def _load_bin(self, path: Path) -> Mapping[str, torch.Tensor]:
        # Keep at most one shard open (memory-mapped).
        if self._bin_cache is None or self._bin_cache[0] != path:
            import torch

            self._bin_cache = None
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as exc:
                raise CorruptCheckpointError(
                    f"{path} could not be read as a PyTorch state dict ({exc}); re-download or re-save it."
                ) from None
            if not isinstance(state, Mapping) or not all(isinstance(t, torch.Tensor) for t in state.values()):
                raise CorruptCheckpointError(f"{path} does not hold a flat state dict of tensors.")
            self._bin_cache = (path, state)
        return self._bin_cache[1]

    def names(self) -> frozenset[str]:
        return frozenset(self.entries)

    def get(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        if self.format == "safetensors":
            return read_tensor(entry)
        return self._load_bin(entry.file)[name]

    def by_file(self) -> Iterator[tuple[Path, list[Entry]]]:
        for path in self.files:
            yield path, [e for e in self.entries.values() if e.file == path]

    def close(self) -> None:
        self._bin_cache = None

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())
