"""Twins: a model built from a checkpoint's own ``config.json``, to observe and to verify.

Two kinds, both from the same transformers class the checkpoint names (``architectures``):

- a *meta* twin at the config's full size, on PyTorch's meta device: exact names and
  shapes of every tensor, no memory, no weights read (~0.05 s);
- a *tiny* twin with widths, layers and vocabulary shrunk (every length field kept:
  :func:`posextend.families.configs.shrink`), on the CPU with random init: buffer values, which table rows a
  lookup uses, and a forward pass at a given length (run by :mod:`posextend.families.twin_runs`).

This module resolves the class a checkpoint's names belong to, builds twins, and names the tensors a twin
holds (its saved names and shapes, the parameters that could be absolute position tables).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from posextend.errors import UnsupportedArchitectureError

if TYPE_CHECKING:
    import torch
    from torch import nn

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- building


def config_object(config: Mapping[str, Any]):
    """The transformers config object for a ``config.json`` dict."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if config.get("model_type") not in CONFIG_MAPPING_NAMES:
        raise UnsupportedArchitectureError(
            f"Unsupported architecture {config.get('model_type')!r}: transformers {transformers.__version__} does not "
            "know this model type; check config.json's model_type or upgrade transformers."
        )
    data = {k: v for k, v in config.items() if k != "model_type"}
    decode = getattr(getattr(transformers, "PreTrainedConfig", None), "_decode_special_floats", None)
    data = decode(data) if decode else data  # {"__float__": "Infinity"} as from_pretrained reads it (NemotronH)
    try:
        return AutoConfig.for_model(config.get("model_type", ""), **data)
    except (ValueError, KeyError, TypeError) as exc:
        raise UnsupportedArchitectureError(
            f"transformers cannot build a config of type {config.get('model_type')!r} ({_first_line(exc)}); "
            "upgrade transformers or check config.json."
        ) from None


def model_class(config: Mapping[str, Any]) -> type:
    """The class the checkpoint names in ``architectures`` (else the AutoModel class of its type)."""
    import transformers

    for name in config.get("architectures") or []:
        cls = getattr(transformers, name, None)
        if isinstance(cls, type):
            return cls
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    names = MODEL_MAPPING_NAMES.get(config.get("model_type", ""))
    for name in [names] if isinstance(names, str) else list(names or []):
        cls = getattr(transformers, name, None)
        if isinstance(cls, type):
            return cls
    raise UnsupportedArchitectureError(
        f"transformers has no model class for {config.get('model_type')!r} "
        f"(architectures: {config.get('architectures')}); cannot observe where its positions live."
    )


def base_class(config: Mapping[str, Any]) -> type | None:
    """The type's bare base model class (``MPNetModel``: what sentence-transformers saves), if any."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    names = MODEL_MAPPING_NAMES.get(config.get("model_type", ""))
    found = [getattr(transformers, n, None) for n in ([names] if isinstance(names, str) else list(names or []))]
    return next((c for c in found if isinstance(c, type)), None)


def _head_classes(config: Mapping[str, Any]) -> list[type]:
    """Every class transformers maps this model type to (each head of the same base)."""
    import transformers
    from transformers.models.auto import modeling_auto

    model_type, out = config.get("model_type", ""), []
    for key, mapping in sorted(vars(modeling_auto).items()):
        if key.startswith("MODEL_") and key.endswith("_MAPPING_NAMES") and isinstance(mapping, Mapping):
            names = mapping.get(model_type)
            for name in [names] if isinstance(names, str) else list(names or []):
                cls = getattr(transformers, name, None)
                if isinstance(cls, type) and cls not in out:
                    out.append(cls)
    return out


def base_prefix(config: Mapping[str, Any], cls: type | None = None) -> str:
    """Where ``cls`` (default: :func:`model_class`) keeps its base model: its ``base_model_prefix``
    when its tensors live under it (``mpnet`` for ``MPNetForMaskedLM``), else ``""``."""
    cls = cls or model_class(config)
    prefix = getattr(cls, "base_model_prefix", "") or ""
    if prefix and any(n.startswith(prefix + ".") for n in meta_shapes(config, cls, saved=False)):
        return prefix
    return ""


def layout_class(config: Mapping[str, Any], names: frozenset[str] | set[str]) -> tuple[type, str]:
    """The class whose saved tensor names a checkpoint holds, and the prefix its names lack.

    Candidates: the class ``architectures`` names (headed), the bare base class (sentence-transformers,
    many hub uploads), other heads of the same base; the first that holds every name wins, else the
    one holding most. Bare weights of a family with no bare class (TrOCR) are the named class's with
    its base prefix (``"model."``) added, as ``from_pretrained`` adds it.
    """
    named = model_class(config)
    prefix = base_prefix(config, named)
    candidates = [(named, ""), *([(named, prefix + ".")] if prefix else []),
                  *((c, "") for c in (base_class(config), *_head_classes(config)) if c and c is not named)]
    best, best_count = candidates[0], -1
    for cls, add in candidates:
        try:
            expected = meta_shapes(config, cls)
        except UnsupportedArchitectureError:
            continue
        count = sum(add + n in expected for n in names)
        if count == len(names):
            return cls, add
        if count > best_count:
            best, best_count = (cls, add), count
    return best


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


MAX_TWIN_PARAMS = 100_000_000  # a CPU twin larger than this (400 MB in float32) is not built


def build(config: Mapping[str, Any], *, device: str = "cpu", cls: type | None = None, seed: int = 0) -> nn.Module:
    """Instantiate ``cls`` (default: :func:`model_class`) from a config dict, random init, eval mode.

    A CPU twin is first built on the meta device: over :data:`MAX_TWIN_PARAMS` parameters it
    is refused (``UnsupportedArchitectureError``) instead of filling the memory.
    """
    import torch

    cls = cls or model_class(config)
    if device != "meta":
        size = sum(p.numel() for p in build(config, device="meta", cls=cls).parameters())
        if size > MAX_TWIN_PARAMS:
            raise UnsupportedArchitectureError(
                f"A twin of {config.get('model_type')!r} would still have {size / 1e6:.0f}M parameters after "
                "shrinking; its position table cannot be observed on this machine."
            )
    cfg = config_object(config)
    torch.manual_seed(seed)
    with torch.device(device), _quiet():
        model = cls._from_config(cfg) if hasattr(cls, "_from_config") else cls(cfg)
    return model.float().eval() if device != "meta" else model.eval()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No warnings, nor transformers' log lines (LED's "Input ids are automatically padded"), while a twin
    is built or run: what a user sees is the model's, not its twin's."""
    import warnings

    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers.logging.set_verbosity(verbosity)


def _key(config: Mapping[str, Any], cls: type | None) -> str:
    return json.dumps([config, cls.__module__ + "." + cls.__qualname__ if cls else None], sort_keys=True, default=str)


@functools.lru_cache(maxsize=64)
def _meta_shapes(key: str) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    config, cls_name = json.loads(key)
    cls = _resolve(cls_name)
    model = build(config, device="meta", cls=cls)
    saved = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    every = {n: tuple(t.shape) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    return saved, every


def _resolve(qualified: str | None) -> type | None:
    if qualified is None:
        return None
    import importlib

    module, _, name = qualified.rpartition(".")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def meta_shapes(config: Mapping[str, Any], cls: type | None = None, *, saved: bool = True) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the twin's tensors: what ``save_pretrained`` writes (``saved``), or
    every parameter and buffer (persistent or not), for in-memory models."""
    try:
        shapes = _meta_shapes(_key(config, cls))
    except UnsupportedArchitectureError:
        raise
    except Exception as exc:  # any failure of a foreign model's constructor
        raise UnsupportedArchitectureError(
            f"Could not build a twin of {config.get('model_type')!r} from its config ({_first_line(exc)}); "
            "its position table cannot be observed."
        ) from None
    return dict(shapes[0] if saved else shapes[1])


def absolute_position_tables(model: nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """``(name, parameter)`` of the parameters named for positions that could be absolute tables:
    an ``nn.Embedding``'s weight or a bare parameter, not a relative table (Swin's
    ``relative_position_bias_table``, SAM's ``rel_pos_h``), no table of a box's coordinates (LayoutLM's and
    UDOP's ``x_position_embeddings``, ``h_position_embeddings``: indexed by a bounding box's 0-1000 scale, not
    by position) and no layer's weight (a Linear named ``..._pos_proj``, or sitting under
    ``post_attention_layernorm``)."""
    from torch import nn

    layers = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.LayerNorm)
    for module_name, module in model.named_modules():
        if isinstance(module, layers):
            continue
        for name, p in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            lowered = full.lower()
            if ("pos" in lowered or full.endswith("wpe.weight")) and not any(
                    word in lowered for word in ("relative", "rel_pos", "bias", "x_position", "y_position", "h_position",
                                                 "w_position")):
                yield full, p


def is_grid_shape(shape: tuple[int, ...]) -> bool:
    """``[1, H, W, D]``, or a table whose rows (``shape[-2]``: ``[rows, D]``, ``[1, rows, D]``; a side of
    ``[H, W, D]``) less 0, 1, 2 or 5 prefix tokens (class, distillation, registers) are a square of more than 4."""
    if len(shape) == 4 and shape[0] == 1:
        return True
    rows = shape[-2] if len(shape) >= 2 else 0
    return rows > 4 and any(math.isqrt(rows - k) ** 2 == rows - k for k in (0, 1, 2, 5) if rows > k)

