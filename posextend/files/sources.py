"""Where a checkpoint's parts are: its folder (local, or a hub id in the local cache), its
``config.json``, the transformers model inside a sentence-transformers folder, that folder's
sentence-transformers config, the tokenizer's files, and whether a destination may be written.

A command asks these of its checkpoint once, through :class:`posextend.files.checkpoint.Checkpoint`."""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Any

from posextend.errors import DestinationError, SourceError

TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "merges.txt", "spiece.model",
                    "sentencepiece.bpe.model", "tokenizer.model")


def resolve_source(src: str | Path) -> Path:
    """A local checkpoint directory, or a hub id already present in the local HF cache."""
    path = Path(src).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.exists():
        raise SourceError(f"{src} is a file; give the checkpoint's directory (the one holding config.json, or "
                          "a sentence-transformers folder's modules.json).")
    if str(src).count("/") == 1 and not str(src).startswith((".", "/", "~")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(str(src), local_files_only=True))
        except Exception:
            pass
    raise SourceError(f"{src} does not exist (and is not a model in the local Hugging Face cache).")


def read_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        raise SourceError(
            f"No config.json in {directory}: this is not a transformers checkpoint. "
            "Save the model with save_pretrained() first."
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SourceError(f"{path} is not valid JSON ({exc}).") from None
    if not isinstance(config, dict):
        raise SourceError(f"{path} does not hold a JSON object.")
    return config


MODULES = "modules.json"  # sentence-transformers: its modules in order, each with its folder


def transformer_dir(directory: Path) -> str:
    """Where the transformers model of checkpoint folder ``directory`` sits, relative to it.

    The one lookup every door uses (resize, inspect, fine-tune loading). ``""``: at the root (a
    transformers checkpoint, or a sentence-transformers folder whose ``modules.json`` gives the
    Transformer module the path ``""``). Older sentence-transformers folders keep the Transformer
    module in the folder ``modules.json`` names (``"0_Transformer"``, ``"0_BERT"``), with its
    config.json, weights, tokenizer and ``sentence_bert_config.json``; the root holds the other
    modules. The Transformer module is the first whose type is a ``Transformer``, else the first
    whose folder holds a transformers config.json (one with a ``model_type``; a Pooling or Dense
    module's config.json has none).

    Raises:
        SourceError: ``modules.json`` is unreadable or names a folder outside ``directory``; the
            Transformer module's folder has no config.json; no module is a transformers model; or a
            model sits both at the root and in the Transformer module's folder.

    Examples:
        >>> transformer_dir(Path("all-MiniLM-L6-v2")), transformer_dir(Path("old-st"))
        ('', '0_Transformer')
    """
    path = directory / MODULES
    if not path.is_file():
        return ""
    try:
        modules = [(str(m.get("type") or ""), str(m.get("path") or "")) for m in json.loads(path.read_text())]
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise SourceError(f"{path} is not a valid sentence-transformers module list ({exc}); restore it from the "
                          "original model, or save the model again with SentenceTransformer.save().") from None
    folders = []
    for kind, where in modules:
        rel = PurePosixPath(where.replace("\\", "/"))
        if rel.is_absolute() or ".." in rel.parts:
            raise SourceError(f"{path} places a module at {where!r}, outside {directory}; a module's path must "
                              "name a folder inside the model folder. Restore modules.json from the original model.")
        folders.append((kind, rel.as_posix() if rel.parts else ""))
    found = next((f for kind, f in folders if kind.rsplit(".", 1)[-1] == "Transformer"), None)
    if found is None:
        found = next((f for _, f in folders if _is_transformers_config(directory / f / "config.json")), None)
    at_root = (directory / "config.json").is_file()
    if found is None and not at_root:
        raise SourceError(
            f"{directory} is a sentence-transformers folder, but none of its modules "
            f"({', '.join(f or '(root)' for _, f in folders) or 'none listed'}) is a transformers model (a folder "
            "with config.json): there is no learned position table to resize."
        )
    if not found:
        return ""
    if not (directory / found / "config.json").is_file():
        raise SourceError(f"{path} places the Transformer module in {found}/, but {found}/config.json is missing: "
                          "the folder is incomplete. Copy or download the whole model folder again.")
    if at_root:
        raise SourceError(
            f"{directory} holds a model at its root (config.json) and, as {MODULES} says, the sentence-transformers "
            f"Transformer module in {found}/: which one to resize is unclear. Remove the one you do not use, or give "
            f"{directory / found} to resize that model on its own."
        )
    return found


def check_destination(src: Path, dst: Path, *, overwrite: bool) -> None:
    src, dst = src.resolve(), dst.resolve()
    if dst == src or src in dst.parents:
        raise DestinationError(f"The destination {dst} is the source or inside it; choose a directory outside {src}.")
    if dst in src.parents:
        raise DestinationError(f"The destination {dst} contains the source {src}; choose another directory.")
    if (dst.exists() or dst.is_symlink()) and not overwrite:
        raise DestinationError(f"{dst} already exists; pass overwrite=True to replace it.")


def json_int(path: Path | None, key: str) -> int | None:
    """The int ``key`` of JSON file ``path`` (None when the file, the key or an int is missing)."""
    if path is not None and path.is_file():
        try:
            value = json.loads(path.read_text()).get(key)
            return value if isinstance(value, int) else None
        except ValueError:
            return None
    return None


def _is_transformers_config(path: Path) -> bool:
    try:
        return path.is_file() and "model_type" in json.loads(path.read_text())
    except (OSError, ValueError, TypeError):
        return False


ST_CONFIG = "sentence_bert_config.json"  # sentence-transformers: encode() truncates to its max_seq_length
# the names older sentence-transformers versions gave it; the first one present is the one read
ST_CONFIGS = (ST_CONFIG, "sentence_roberta_config.json", "sentence_distilbert_config.json",
              "sentence_camembert_config.json", "sentence_albert_config.json", "sentence_xlm-roberta_config.json",
              "sentence_xlnet_config.json")


def st_config(model_dir: Path) -> Path | None:
    """The sentence-transformers config (``max_seq_length``) of the Transformer module in ``model_dir``."""
    return next((model_dir / name for name in ST_CONFIGS if (model_dir / name).is_file()), None)
