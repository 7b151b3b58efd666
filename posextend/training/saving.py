"""A fine-tune's output, written by the checkpoint writer of ``resize-model``
(:func:`posextend.resize.writer.write_checkpoint`): the source checkpoint's files, in their layout, with
the trained tensors' new values.

Where each trained tensor sits in the files is observed once the model is loaded, before it is
extended or trained (:func:`file_names`): a file tensor belongs to the state-dict tensor that holds
its exact value under the file's name, the name with or without the base model's prefix (a bare
file under a headed class), or the name the family's conversion mapping gives it. A tensor that
training left bit-identical keeps its bytes; a trained one is written in its file's dtype; a
parameter the files lack (a fresh head, a pooler initialised on loading) is added, and the output
is loaded to check it. The config, tokenizer and sentence-transformers settings, and the length
buffers the model does not save, follow the resize the run made, as ``resize-model`` writes them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from posextend.errors import TrainingError, VerificationError
from posextend.files.checkpoint import Checkpoint
from posextend.files.reader import CheckpointReader
from posextend.files.tensorfile import Entry, TensorData, dtype_code, torch_dtypes
from posextend.families.renames import merged_on_save, names_on_load
from posextend.resize.writer import Change, Written, write_checkpoint

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FileNames:
    """Where a loaded model's tensors sit in its checkpoint's weight files, by name in the trained model.

    - ``names``: each tensor of the model's state dict that the files hold -> its file name (its value as
      loaded is the file's, bit for bit). A buffer the model does not save but an older file still holds
      (``position_ids``) is the resize plan's, as ``resize-model`` writes it.
    - ``added``: each parameter the files lack (a freshly initialised head) -> the name it is written under.
    - ``merged``: each file tensor the family splits on loading and merges back on saving (a fused q, k and v) ->
      the name :func:`~posextend.families.renames.merged_on_save` gives it; ``sources``: the model's tensors it
      is made from.
    """

    names: dict[str, str]
    added: dict[str, str]
    merged: dict[str, str] = field(default_factory=dict)
    sources: frozenset[str] = frozenset()
    root: str = ""  # where the transformers model sits in the model that trains ("" : it is that model)


def _candidates(name: str, prefix: str, renamed: Mapping[str, list[str]]) -> list[str]:
    """The model names a file tensor ``name`` may load as: itself, with or without the base model's
    ``prefix``, and the names the family's conversion mapping gives it."""
    out = [name, prefix + name] if prefix else [name]
    if prefix and name.startswith(prefix):
        out.append(name.removeprefix(prefix))
    return list(dict.fromkeys(out + renamed.get(name, [])))


def file_names(model: torch.nn.Module, hf_model: torch.nn.Module, reader: CheckpointReader,
               config: Mapping[str, Any]) -> FileNames:
    """Observe where ``hf_model``'s tensors (inside ``model``, the model that trains) sit in ``reader``'s
    files, as loaded. A tensor of the model that the files hold under a name of its own but with
    another value (transformers converts it on loading) is refused: its trained value would have no
    place to go."""
    import torch

    root = next((f"{n}." for n, m in model.named_modules() if m is hf_model and n), "")
    base = getattr(hf_model, "base_model_prefix", "")
    prefix = f"{base}." if base else ""
    tensors = hf_model.state_dict(keep_vars=True)
    renamed: dict[str, list[str]] = {}
    for model_name, file_name in names_on_load(reader.names(), config).items():
        renamed.setdefault(file_name, []).append(model_name)
    names: dict[str, str] = {}
    for file_name in sorted(reader.entries):
        value = None
        for name in _candidates(file_name, prefix, renamed):
            tensor = tensors.get(name)
            if tensor is None or root + name in names or tuple(tensor.shape) != reader.entries[file_name].shape:
                continue
            value = reader.get(file_name) if value is None else value
            if torch.equal(tensor.detach().cpu(), value.to(tensor.dtype)):
                names[root + name] = file_name
                break
    merged, sources = _merged(hf_model, root, reader, prefix, set(names.values()))
    return FileNames(names, _added(hf_model, root, names, reader, prefix, sources), merged, sources, root)


def _merged(hf_model: torch.nn.Module, root: str, reader: CheckpointReader, prefix: str, held: set[str]
            ) -> tuple[dict[str, str], frozenset[str]]:
    """The file tensors no model tensor holds that saving ``hf_model`` makes again, bit for bit, from tensors the
    family split them into on loading: each by the name saving gives it, and the model's tensors it is made from."""
    import torch

    left = [name for name in reader.entries if name not in held]
    saved, sources = merged_on_save(hf_model, hf_model.state_dict()) if left else ({}, set())
    merged = {}
    for file_name in left:
        for name in _candidates(file_name, prefix, {}):
            if name in saved and tuple(saved[name].shape) == reader.entries[file_name].shape and torch.equal(
                    saved[name].detach().cpu(), reader.get(file_name).to(saved[name].dtype)):
                merged[file_name] = name
                break
    return merged, frozenset(root + name for name in sources) if merged else frozenset()


def _added(hf_model: torch.nn.Module, root: str, names: Mapping[str, str], reader: CheckpointReader,
           prefix: str, sources: frozenset[str]) -> dict[str, str]:
    """Each parameter that no file tensor holds, that shares no storage with one that does (a tied weight is
    written once) and that no merged file tensor is made from (``sources``): a fresh head, named as the files
    name theirs (without the base model's prefix in a bare file, with it in a headed file under a base class).
    Refused: a parameter whose own name is in the files with another value."""
    held = {t.data_ptr() for n, t in hf_model.state_dict(keep_vars=True).items() if root + n in names}
    pairs = [(model.removeprefix(root), file) for model, file in names.items()]
    bare = bool(prefix) and any(model == prefix + file for model, file in pairs)  # the file leaves the prefix off
    headed = bool(prefix) and any(file == prefix + model for model, file in pairs)  # the model does (a base class)
    added = {}
    for name, param in hf_model.named_parameters():
        if root + name in names or param.data_ptr() in held or root + name in sources:
            continue
        file_name = name.removeprefix(prefix) if bare else prefix + name if headed else name
        if file_name in reader.entries or name in reader.entries:
            raise TrainingError(
                f"{reader.dir}'s tensor {file_name} is not the value {type(hf_model).__name__} loads as {name} "
                "(the family converts it on loading), so its trained value could not be written in the file's "
                "layout; fine-tune a checkpoint saved by this version of transformers.")
        added[root + name] = file_name
    return added


def changes(state: Mapping[str, torch.Tensor], model: torch.nn.Module, files: FileNames, reader: CheckpointReader
            ) -> tuple[dict[str, tuple[tuple[int, ...], TensorData]], tuple[tuple[Entry, TensorData], ...]]:
    """The trained model's tensors that differ from the files (new value or shape), by file name, in the
    file's dtype; and the parameters the files lack. ``state``: the trained model's state dict (full, when
    sharded across processes); ``model``: the trained model (the parameters that did not train hold the
    file's values, as :func:`file_names` observed them)."""
    import torch

    dtypes = torch_dtypes()
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}  # the file's values: observed on loading
    tensors: dict[str, tuple[tuple[int, ...], TensorData]] = {}
    for name, file_name in files.names.items():
        entry, shape = reader.entries[file_name], tuple(state[name].shape)
        if name in frozen and shape == entry.shape:
            continue

        def value(t=state[name], dtype=dtypes[entry.dtype]) -> torch.Tensor:  # made again when written: one at a time
            return t.detach().to("cpu", dtype)

        if shape != entry.shape or not torch.equal(value(), reader.get(file_name)):
            tensors[file_name] = (shape, value)
    if files.merged and not files.sources <= frozen:  # made again as saving makes them (a fused q, k and v)
        hf_model = model.get_submodule(files.root.removesuffix(".")) if files.root else model
        saved = merged_on_save(hf_model, {name.removeprefix(files.root): state[name] for name in files.sources})[0]
        for file_name, name in files.merged.items():
            value = saved[name].detach().to("cpu", dtypes[reader.entries[file_name].dtype])
            if not torch.equal(value, reader.get(file_name)):
                tensors[file_name] = (tuple(value.shape), lambda v=value: v)
    added = tuple((Entry(file_name, reader.files[-1], dtype_code(state[name].dtype), tuple(state[name].shape)),
                   lambda n=name: state[n].detach().cpu())
                  for name, file_name in files.added.items())
    return tensors, added


def write_trained(checkpoint: Checkpoint, out: Path, change: Change, cls: type) -> Written:
    """Write ``checkpoint`` into ``out`` as ``change`` makes it; when it adds tensors (a fresh head),
    check that ``cls``, the class that trained, loads every weight it has from the output."""
    written = write_checkpoint(checkpoint, out, change)
    if change.added:
        _check_loads(out / checkpoint.transformer_dir, cls)
    return written


def _check_loads(model_dir: Path, cls: type) -> None:
    try:
        _, info = cls.from_pretrained(model_dir, output_loading_info=True)
    except (OSError, ValueError, RuntimeError) as exc:
        raise VerificationError(f"The fine-tune's output does not load in {cls.__name__} "
                                f"({str(exc).splitlines()[0]}); nothing was written.") from None
    if info["missing_keys"]:
        raise VerificationError(f"The fine-tune's output does not give {cls.__name__} its weight "
                                f"{sorted(info['missing_keys'])[0]}; nothing was written.")


def save_state(accelerator: Any, state_dir: Path, *, step: int, fingerprint: str, planned: int) -> None:
    """A resumable run's state after ``step``: accelerate's (model, optimizer, schedule, random states) and ours
    (the step, the options' fingerprint a resume must match, the steps planned), in ``state_dir``."""
    import json

    from posextend.files.atomic import write_file
    from posextend.files.oserrors import output_errors

    with output_errors(state_dir):
        accelerator.save_state(str(state_dir))
        if accelerator.is_main_process:
            write_file(state_dir / "posextend.json", json.dumps({"step": step, "fingerprint": fingerprint,
                                                                 "planned": planned}))
