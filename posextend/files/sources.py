"""Where a checkpoint's parts are: its folder (local, or a Hugging Face Hub id, downloaded into the Hugging
Face cache), its ``config.json``, the transformers model inside a sentence-transformers folder, that folder's
sentence-transformers config, the tokenizer's files, and whether a destination may be written.

A command asks these of its checkpoint once, through :class:`posextend.files.checkpoint.Checkpoint`."""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Any

from posextend.errors import DestinationError, SourceError
from posextend.files.reader import BIN_INDEX, BIN_SINGLE, SAFE_INDEX, SAFE_SINGLE

TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "merges.txt", "spiece.model",
                    "sentencepiece.bpe.model", "tokenizer.model")


def resolve_source(src: str | Path, *, revision: str | None = None) -> Path:
    """The folder of checkpoint ``src``: a local folder, or, for a text that is no folder here but a Hugging
    Face Hub id (``"openai-community/gpt2"``), the files of that model a command needs, downloaded into the
    Hugging Face cache (:func:`download`) at ``revision`` (a branch, tag or commit; default: main). A
    :class:`~pathlib.Path` is always a local folder.

    Raises:
        SourceError: ``src`` is a file, a folder that does not exist, or a hub id that cannot be had (one
            line saying how to get it: download it, log in, or unset ``HF_HUB_OFFLINE``).
    """
    path = Path(src).expanduser()
    if path.is_dir():
        if revision is not None:
            raise SourceError(f"{src} is a local folder; a revision ({revision}) selects a version of a model on the "
                              "Hugging Face Hub: give its hub id, or leave the revision unset.")
        return path.resolve()
    if path.exists():
        raise SourceError(f"{src} is a file; give the checkpoint's directory (the one holding config.json, or "
                          "a sentence-transformers folder's modules.json).")
    if hub_id(src):
        return download(src, revision)
    raise SourceError(f"{src} does not exist; give the folder of a saved model, or a Hugging Face Hub id such as "
                      "openai-community/gpt2.")


def hub_id(src: str | Path) -> str | None:
    """The Hugging Face Hub id ``src`` names (:func:`resolve_source` downloads it), or None: a
    :class:`~pathlib.Path`, or a text that is something here (a folder, a file) or no valid hub id."""
    if not isinstance(src, str) or Path(src).expanduser().exists():
        return None
    from huggingface_hub.utils import HFValidationError, validate_repo_id  # ~0.1 s: only for what is not here

    try:
        validate_repo_id(src)
    except HFValidationError:
        return None
    return src


def snapshot_commit(directory: Path) -> str:
    """The commit of the hub model whose files :func:`download` put in ``directory``: the name of its
    snapshot folder in the Hugging Face cache (``models--ORG--NAME/snapshots/COMMIT``)."""
    return directory.name


# What a resize, an inspection or a fine-tune reads of a model on the Hub, in the model's folder and in the
# folders of a sentence-transformers model's modules (1_Pooling/, 2_Dense/, an older 0_Transformer/): every
# config (model, generation, tokenizer, image processor, processor, sentence-transformers module), the
# tokenizer's files, the list of modules, and the model card (the output's card quotes it). Patterns as
# huggingface_hub matches them (``fnmatch``: ``*`` matches ``/`` too).
HUB_FILES = ("*config.json", "*config_sentence_transformers.json", "*modules.json", "*special_tokens_map.json",
             "*added_tokens.json", "*chat_template.json", "*chat_template.jinja",
             *(f"*{name}" for name in TOKENIZER_FILES), "README.md")
# The weights, in one format: safetensors (single, or shards with their index) where the model has them, else
# PyTorch's; in the model's folder or a module's.
WEIGHT_NAMES = {"safetensors": (SAFE_SINGLE, SAFE_INDEX, "model-*-of-*.safetensors"),
                "bin": (BIN_SINGLE, BIN_INDEX, "pytorch_model-*-of-*.bin")}


def download(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot folder in the Hugging Face cache of the files a command needs of hub model ``repo_id``
    (:data:`HUB_FILES`, and its weights in one format, :data:`WEIGHT_NAMES`: safetensors where the model
    has them, else PyTorch's), downloading what the cache lacks.

    huggingface_hub decides where the cache is (``HF_HOME``, ``HF_HUB_CACHE``) and whether to ask the Hub
    at all (``HF_HUB_OFFLINE``): offline, or with the Hub out of reach, the files come from the cache.

    Raises:
        SourceError: one line saying why the model cannot be had and how to get it.
    """
    from huggingface_hub import snapshot_download

    folder = Path()
    try:
        for names in WEIGHT_NAMES.values():  # PyTorch's only where the model has no safetensors weights
            weights = [pattern for name in names for pattern in (name, f"*/{name}")]
            folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=[*HUB_FILES, *weights]))
            model = folder / transformer_dir(folder)
            if any((model / name).is_file() for name in names[:2]):
                break
    except SourceError:
        raise
    except Exception as exc:  # whatever huggingface_hub or the network raised: one line saying what to do
        raise SourceError(_download_error(repo_id, revision, exc)) from exc
    return folder


def _download_error(repo_id: str, revision: str | None, exc: Exception) -> str:
    """Why hub model ``repo_id`` could not be had (``exc``, as huggingface_hub raised it), and how to get it."""
    from huggingface_hub import constants
    from huggingface_hub.utils import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    at = f" at revision {revision}" if revision else ""
    get = f"`hf download {repo_id}{f' --revision {revision}' if revision else ''} --local-dir DIR`"
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if isinstance(exc, GatedRepoError):
        return (f"{repo_id} is a gated model on the Hugging Face Hub: accept its conditions on "
                f"https://huggingface.co/{repo_id} and log in (`hf auth login`), then run again.")
    if isinstance(exc, RepositoryNotFoundError):
        return (f"{repo_id} is neither a folder here nor a model on the Hugging Face Hub (a private model needs "
                "`hf auth login` first): give the folder of a saved model, or a hub id such as openai-community/gpt2.")
    if isinstance(exc, RevisionNotFoundError):
        return f"The Hugging Face Hub model {repo_id} has no revision {revision or 'main'!r}: give a branch, tag or commit it has."
    if constants.HF_HUB_OFFLINE:
        return (f"{repo_id} is not a folder here, and HF_HUB_OFFLINE is set while the Hugging Face cache "
                f"({constants.HF_HUB_CACHE}) does not hold it{at}: unset HF_HUB_OFFLINE to download it, or download "
                f"it where the Hub can be reached ({get}) and give that folder.")
    if isinstance(exc, LocalEntryNotFoundError):
        return (f"{repo_id} is not a folder here, and the Hugging Face Hub could not be reached to download it{at}: "
                f"check the connection (or HF_ENDPOINT), or download it elsewhere ({get}) and give that folder.")
    return (f"Downloading {repo_id}{at} from the Hugging Face Hub failed ({type(exc).__name__}: {reason}); run "
            f"again, or download it ({get}) and give that folder.")


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
