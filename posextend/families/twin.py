"""Tiny twins: a model built from a checkpoint's own ``config.json``, to observe and to verify.

Two kinds, both from the same transformers class the checkpoint names (``architectures``):

- a *meta* twin at the config's full size, on PyTorch's meta device: exact names and
  shapes of every tensor, no memory, no weights read (~0.05 s);
- a *tiny* twin with widths, layers and vocabulary shrunk (every length field kept), on
  the CPU with random init: buffer values, which table rows a lookup uses, and a forward
  pass at a given length.

Config paths name nested fields with dots: ``text_config.max_position_embeddings``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
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

# ----------------------------------------------------------------------------- config paths


def get_path(config: Mapping[str, Any], path: str) -> Any:
    """``config["a"]["b"]`` for ``path="a.b"``; None when any part is missing."""
    node: Any = config
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def set_path(config: Mapping[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A deep copy of ``config`` with ``path`` set to ``value``."""
    out = copy.deepcopy(dict(config))
    node = out
    *parents, leaf = path.split(".")
    for part in parents:
        node = node[part]
    node[leaf] = value
    return out


def sub_configs(config: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Mapping[str, Any]]]:
    """``(path, dict)`` for the config and every nested sub-config (``text_config``, ``decoder`` ...)."""
    yield prefix, config
    for key, value in config.items():
        if isinstance(value, Mapping) and "model_type" in value:
            yield from sub_configs(value, f"{prefix}{key}.")


# ----------------------------------------------------------------------------- shrinking

_WIDTH = ("hidden_size", "d_model", "n_embd", "dim", "emb_dim", "embed_dim", "embedding_size", "word_embed_proj_dim",
          "projection_dim", "input_embedding_size", "output_embedding_size", "true_hidden_size", "intra_bottleneck_size",
          "entity_emb_size", "text_embed_dim", "vision_embed_dim", "hidden_dim_size", "d_latents")
_HEADS = ("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads", "decoder_attention_heads",
          "num_self_attention_heads", "num_cross_attention_heads")
_FFN = ("intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "n_inner", "d_ff", "hidden_dim")
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_experts_per_tok",
            "n_shared_experts", "num_shared_experts", "moe_intermediate_size", "shared_expert_intermediate_size")
_LAYERS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
           "num_encoder_layers", "num_decoder_layers", "num_self_attends_per_block")
_VOCAB = ("vocab_size",)
_VOCAB_PARTS = ("unpadded_vocab_size",)  # counts of rows within vocab_size (Inkling-2: the rows before the padding)
TINY_WIDTH, TINY_HEADS, TINY_FFN, TINY_LAYERS, TINY_VOCAB = 64, 2, 96, 2, 512  # width // 64 heads still works


def _token_ids(config: Mapping[str, Any]) -> list[int]:
    return [v for k, v in config.items() if k.endswith("token_id") and isinstance(v, int) and v >= 0]


def shrink(config: Mapping[str, Any], *, widths: bool = True) -> dict[str, Any]:
    """``config`` with layers (and, with ``widths``, hidden sizes, heads, vocabulary) made tiny.

    Length fields, token ids, ``padding_idx`` and everything else that decides positions
    are kept. Lists with one entry per layer are cut to the new number of layers.
    """
    out = copy.deepcopy(dict(config))
    for key, value in list(out.items()):
        if isinstance(value, Mapping) and "model_type" in value:
            out[key] = shrink(value, widths=widths)
    layers = {k: out[k] for k in _LAYERS if isinstance(out.get(k), int) and out[k] > TINY_LAYERS}
    for key, old in layers.items():
        out[key] = TINY_LAYERS
        for name, value in list(out.items()):
            if isinstance(value, list) and len(value) == old and name not in ("architectures",):
                out[name] = value[:TINY_LAYERS]
        _keep_global_layers(out, config.get("global_attn_indexes"), old)
    if isinstance(out.get("vocab_size"), int) and out["vocab_size"] > TINY_VOCAB:
        out["vocab_size"] = max([TINY_VOCAB, *(i + 1 for i in _token_ids(out))])
        _keep_vocabulary_parts(out, config["vocab_size"])
    if not widths:
        return out
    for keys, size in ((_WIDTH, TINY_WIDTH), (_HEADS, TINY_HEADS), (_FFN, TINY_FFN)):
        for key in keys:
            if isinstance(out.get(key), int) and not isinstance(out[key], bool) and out[key] > size:
                out[key] = size
    for key in ("head_dim", "d_kv", "attention_head_size"):
        if isinstance(out.get(key), int) and out[key] > TINY_WIDTH // TINY_HEADS:
            out[key] = TINY_WIDTH // TINY_HEADS
    for key in _EXPERTS:
        if isinstance(out.get(key), int) and not isinstance(out[key], bool) and out[key] > 2:
            out[key] = 2 if "intermediate" not in key else TINY_FFN
    for key in ("num_key_value_heads", "num_kv_heads"):
        if isinstance(out.get(key), int) and out[key] > TINY_HEADS:
            out[key] = TINY_HEADS
    return out


def _keep_vocabulary_parts(config: dict[str, Any], old_vocab: int) -> None:
    """After shrinking ``vocab_size`` from ``old_vocab``: a field that counts part of that vocabulary
    (``unpadded_vocab_size``: the rows before the padding) keeps its distance below ``vocab_size``."""
    for key in _VOCAB_PARTS:
        value = config.get(key)
        if type(value) is int and config["vocab_size"] < value <= old_vocab:
            config[key] = max(1, config["vocab_size"] - (old_vocab - value))


def _keep_global_layers(config: dict[str, Any], indexes: Any, old_layers: int) -> None:
    """After cutting ``old_layers`` to :data:`TINY_LAYERS`: keep a global-attention layer (SAM's
    ``global_attn_indexes`` of the original config; the others attend in windows) and, where the config had
    one, a windowed layer, so a tiny twin still holds the tables each kind of layer sizes."""
    if not isinstance(indexes, (list, tuple)) or not indexes or not all(isinstance(i, int) for i in indexes):
        return
    windowed = len(set(indexes) & set(range(old_layers))) < old_layers
    config["global_attn_indexes"] = [TINY_LAYERS - 1] if windowed else list(range(TINY_LAYERS))


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
    import transformers

    cls = cls or model_class(config)
    if device != "meta":
        size = sum(p.numel() for p in build(config, device="meta", cls=cls).parameters())
        if size > MAX_TWIN_PARAMS:
            raise UnsupportedArchitectureError(
                f"A twin of {config.get('model_type')!r} would still have {size / 1e6:.0f}M parameters after "
                "shrinking; its position table cannot be observed on this machine."
            )
    cfg = config_object(config)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        torch.manual_seed(seed)
        with torch.device(device), _quiet():
            model = cls._from_config(cfg) if hasattr(cls, "_from_config") else cls(cfg)
    finally:
        transformers.logging.set_verbosity(verbosity)
    return model.float().eval() if device != "meta" else model.eval()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


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


def tiny_lookups(
    config: Mapping[str, Any], cls: type | None, tables: list[str], length: int, *, whole: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """:func:`run_lookups` on a tiny CPU twin: widths shrunk if such a twin runs, else layers only.
    ``whole``: :func:`run_whole` instead (the module that runs on a few tokens, at ``length``).

    Returns the rows used and the shrunk config. Raises ``RuntimeError`` naming the failures.
    """
    failures = []
    for widths in (True, False):
        small = shrink(config, widths=widths)
        try:
            model = build(small, cls=cls)
        except UnsupportedArchitectureError:
            raise
        except Exception as exc:  # a foreign constructor: try a milder shrink
            failures.append(f"building: {_first_line(exc)}")
            continue
        try:
            return (run_whole if whole else run_lookups)(model, tables, length, token=safe_token(small))[0], small
        except RuntimeError as exc:
            failures.append(str(exc))
    raise RuntimeError(failures[-1] if failures else "no twin")


# ----------------------------------------------------------------------------- watching lookups


class _Lookups:
    """Records the rows every ``F.embedding`` / ``weight[...]`` lookup into given tensors uses
    (the first sequence of each lookup: ``index[0, :]`` of a batch)."""

    def __init__(self, tables: Mapping[str, torch.Tensor]):
        from torch.overrides import TorchFunctionMode

        self.tables = dict(tables)
        self.seen: dict[str, list[torch.Tensor]] = {n: [] for n in tables}
        owner = self

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                owner._record(func, args, kwargs or {})
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def _record(self, func, args, kwargs) -> None:
        import torch
        import torch.nn.functional as F

        if func is F.embedding and len(args) >= 1:
            index, weight = args[0], args[1] if len(args) > 1 else kwargs.get("weight")
        elif func is torch.Tensor.__getitem__ and len(args) == 2:
            weight, index = args
            if isinstance(index, tuple) and index:
                index = index[0]
            if isinstance(index, slice):
                rows = weight.shape[0] if isinstance(weight, torch.Tensor) and weight.dim() else 0
                index = torch.arange(rows)[index]
        else:
            return
        for name, table in self.tables.items():
            if weight is table and isinstance(index, torch.Tensor) and index.dim() >= 1:
                self.seen[name].append(index.detach().reshape(-1, index.shape[-1])[0].cpu().clone())

    def __enter__(self) -> _Lookups:
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.mode.__exit__(*exc)


def _accepts(module: nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def forward_inputs(model: nn.Module, module: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """Keyword arguments that run ``module`` (a part of ``model``) on token ``ids``; None if it takes none."""
    import torch

    key = next((k for k in ("input_ids", "inputs") if _accepts(module, k)), None)  # Perceiver: inputs
    if key is None:
        return None
    kwargs = {key: ids}
    if _accepts(module, "decoder_input_ids") and getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        kwargs["decoder_input_ids"] = ids
    if _accepts(module, "bbox"):  # layout models: one box per token
        kwargs["bbox"] = torch.zeros((*ids.shape, 4), dtype=torch.long)
    return kwargs


def forward_output(model: nn.Module, path: str, ids: torch.Tensor) -> torch.Tensor:
    """The main output tensor (logits, last hidden state) of module ``path`` of ``model`` on ``ids``."""
    import torch

    module = model.get_submodule(path) if path and path != type(model).__name__ else model
    with torch.no_grad(), _quiet():
        out = module(**forward_inputs(model, module, ids))
    if isinstance(out, torch.Tensor):
        return out
    for key in ("logits", "last_hidden_state"):
        value = getattr(out, key, None)
        if isinstance(value, torch.Tensor):
            return value
    return next(v for v in (out.values() if hasattr(out, "values") else out) if isinstance(v, torch.Tensor))


def run_lookups(
    model: nn.Module, tables: list[str], length: int, *, token: int,
) -> tuple[dict[str, torch.Tensor], str]:
    """Run the outermost module around ``tables`` that takes token ids on ``length`` tokens.

    Only tables that are parameters are watched (a companion buffer such as I-BERT's
    ``weight_integer`` follows its table but is not looked up). Returns the rows each table's lookups
    used (for the first sequence; every lookup of the forward, concatenated, the first one first) and
    the name of the module that ran. Every token is ``token`` (never the padding id).
    Raises ``RuntimeError`` with the last failure when no module on the way runs.
    """
    import torch

    learned = dict(model.named_parameters())
    watched = {n: learned[n] for n in tables if n in learned}  # companion buffers are not looked up
    if not watched:
        raise RuntimeError(f"none of {', '.join(tables)} is a learned parameter of {type(model).__name__}")
    tables = list(watched)
    ids = torch.full((1, length), token, dtype=torch.long)
    failures = []
    for path in _paths_around(tables):
        module = model.get_submodule(path) if path else model
        kwargs = forward_inputs(model, module, ids)
        if kwargs is None:
            continue
        with _Lookups(watched) as seen, torch.no_grad(), _quiet():
            try:
                module(**kwargs)
            except Exception as exc:  # a foreign forward: try the next module inside
                failures.append(f"{path or type(model).__name__}: {_first_line(exc)}")
                continue
        if any(seen.seen[n] for n in tables):  # a table may also be used whole (Perceiver's output queries)
            # every lookup, the first one first: a second one (ProphetNet's predicting stream reads
            # position + 1) can reach rows past the positions
            return {n: torch.cat(seen.seen[n]) for n in tables if seen.seen[n]}, path or type(model).__name__
        failures.append(f"{path or type(model).__name__}: ran without looking up {', '.join(tables)}")
    raise RuntimeError("; ".join(failures[-3:]) or "no module around the table takes input_ids")


def run_whole(
    model: nn.Module, tables: list[str], length: int, *, token: int, short: int = 5,
) -> tuple[dict[str, torch.Tensor], str]:
    """:func:`run_lookups` at ``length`` on the module that runs on ``short`` tokens, no module inside
    it standing in for it: each of its token inputs (encoder, decoder) that looks ``tables`` up gets
    ``length`` tokens, the others ``short``. Raises ``RuntimeError`` when that module fails.
    """
    import torch

    _, name = run_lookups(model, tables, short, token=token)
    path = name if name in dict(model.named_modules()) else ""
    module = model.get_submodule(path) if path else model
    learned = dict(model.named_parameters())
    watched = {n: learned[n] for n in tables if n in learned}
    base = forward_inputs(model, module, torch.full((1, short), token, dtype=torch.long)) or {}
    stacks = [k for k, v in base.items() if k != "bbox" and v.dtype == torch.long and v.dim() == 2]

    def run(lengths: dict[str, int]) -> dict[str, list[torch.Tensor]]:
        kwargs = {k: torch.full((1, lengths.get(k, short)), token, dtype=torch.long) if k in stacks else v
                  for k, v in base.items()}
        if "bbox" in kwargs:
            kwargs["bbox"] = torch.zeros((*kwargs[stacks[0]].shape, 4), dtype=torch.long)
        with _Lookups(watched) as seen, torch.no_grad(), _quiet():
            module(**kwargs)
        return seen.seen

    users = stacks
    if len(stacks) > 1:  # which inputs look the tables up: by the length of each lookup
        by_length = {short + i: k for i, k in enumerate(stacks)}
        seen = run({k: short + i for i, k in enumerate(stacks)})
        found = {by_length.get(len(rows)) for rows_list in seen.values() for rows in rows_list}
        users = stacks if None in found or not found else [k for k in stacks if k in found]
    try:
        seen = run({k: length for k in users})
    except Exception as exc:
        raise RuntimeError(f"{name} with {', '.join(users)} of {length} tokens: {_first_line(exc)}") from None
    return {n: torch.cat(seen[n]) for n in watched if seen[n]}, name


def num_channels(config: Mapping[str, Any]) -> int:
    """The image channels a vision model (or tower) takes: its config's ``num_channels``, else 3."""
    return next((v for _, sub in sub_configs(config) if isinstance(v := sub.get("num_channels"), int)), 3)


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


def run_pixels(model: nn.Module, tables: list[str], image_size: tuple[int, int], channels: int = 3,
               *, resampling: bool = False) -> torch.Tensor:
    """Run the outermost module around ``tables`` that takes ``pixel_values`` on one random image
    of ``image_size`` (height, width); return its main output.

    Raises ``RuntimeError`` when no module on the way runs, or when the one that runs resamples
    anything to another size (``F.interpolate``; DPT's call on every forward keeps the size): at
    its own image size a model must use its table as it is. ``resampling=True``: that is allowed
    (an image of another size).
    """
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    class Resampling(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if func is F.interpolate and out.shape[-2:] != (args[0] if args else kwargs["input"]).shape[-2:]:
                Resampling.calls += 1
            return out

    pixels = torch.randn(1, channels, *image_size, generator=torch.Generator().manual_seed(0))
    failures = []
    for path in _paths_around(tables):
        module = model.get_submodule(path) if path else model
        if not _accepts(module, "pixel_values"):
            continue
        Resampling.calls = 0  # only what the module that runs does counts
        try:
            with Resampling(), torch.no_grad(), _quiet():
                out = module(pixel_values=pixels)
        except Exception as exc:  # a foreign forward (CLIPModel wants input_ids too): try the next module inside
            failures.append(f"{path or type(model).__name__}: {_first_line(exc)}")
            continue
        if Resampling.calls and not resampling:
            raise RuntimeError(f"{path or type(model).__name__} resamples its positions at its own image size")
        return main_tensor(out)
    raise RuntimeError("; ".join(failures[-3:]) or "no module around the table takes pixel_values")


# ----------------------------------------------------------------------------- patch sequences

# What a tower's forward takes for an image of ``(h, w)`` patches, by parameter name: its grid as
# ``[[t, h, w]]`` (Qwen-VL's grid_thw) or ``[[h, w]]``, and companions of the patch sequence.
_GRID_THW = ("grid_thw", "image_grid_thw")
_GRID_HW = ("image_grid_hw", "spatial_shapes", "target_sizes")
# Config keys of one fact each: the pixels in a patch, its channels, frames per patch, patches merged a side.
_PATCH_KEYS = ("patch_size",)
_CHANNEL_KEYS = ("num_channels", "in_channels", "in_chans")
_TEMPORAL_KEYS = ("temporal_patch_size", "patch_temporal")
_MERGE_KEYS = ("spatial_merge_size", "merge_size", "merge_kernel_size")
# How the patches of an image are laid out, as families take them: the shape for ``n`` patches of
# ``c`` channels, ``t`` frames, ``p x q`` pixels, merged ``m`` a side; ``merged``: the grid counts merged tokens.
PATCH_LAYOUTS = {
    "flat": (lambda n, c, t, p, q, m: (n, c * t * p * q), False),  # Qwen-VL, GLM-4V: [patches, c*t*p*q]
    "sequence": (lambda n, c, t, p, q, m: (1, n, c, p, q), False),  # PaddleOCR-VL: [1, patches, c, p, q]
    "strip": (lambda n, c, t, p, q, m: (1, c, p, n * q), False),  # MiniCPM-V: patches side by side
    "patches": (lambda n, c, t, p, q, m: (n, c, p, q), False),  # Kimi: [patches, c, p, q]
    "tokens": (lambda n, c, t, p, q, m: (1, n, c * p * q), False),  # SigLIP2 (NaFlex): [1, patches, c*p*q]
    "merged": (lambda n, c, t, p, q, m: (n // (m * m), m * p, m * q, c), True),  # one crop per merged token
}


def _config_value(config: Any, keys: tuple[str, ...], default: Any) -> Any:
    """The first of ``keys`` a config object holds (not None), else ``default``."""
    return next((v for k in keys if (v := getattr(config, k, None)) is not None), default)


def patch_inputs(module: nn.Module, config: Any, grid: tuple[int, int], layout: str) -> dict[str, Any] | None:
    """Keyword arguments that give ``module`` one random image of ``grid`` patches as a patch sequence in
    ``layout`` (see :data:`PATCH_LAYOUTS`) with its grid; None when its forward takes no grid."""
    import torch

    params = inspect.signature(module.forward).parameters
    if not any(k in params for k in (*_GRID_THW, *_GRID_HW, "pixel_position_ids")):
        return None
    p, q = pair(_config_value(config, _PATCH_KEYS, 14))
    merge = pair(_config_value(config, _MERGE_KEYS, 1))[0]
    shape, merged = PATCH_LAYOUTS[layout]
    n = grid[0] * grid[1]
    channels, frames = _config_value(config, _CHANNEL_KEYS, 3), _config_value(config, _TEMPORAL_KEYS, 1)
    pixels = torch.randn(*shape(n, channels, frames, p, q, merge), generator=torch.Generator().manual_seed(0))
    h, w = (grid[0] // merge, grid[1] // merge) if merged else grid
    first = next(iter(params))
    kwargs: dict[str, Any] = {"pixel_values" if "pixel_values" in params else first: pixels}
    rows, cols = torch.meshgrid(torch.arange(grid[0]), torch.arange(grid[1]), indexing="ij")
    companions = {
        **{k: torch.tensor([[1, h, w]]) for k in _GRID_THW}, **{k: torch.tensor([[h, w]]) for k in _GRID_HW},
        "pixel_attention_mask": torch.ones(1, n, dtype=torch.bool),
        "pixel_position_ids": torch.stack([cols.flatten(), rows.flatten()], -1)[None],  # (x, y) of each patch
        "padding_positions": torch.zeros(1, n, dtype=torch.bool),
    }
    kwargs.update({k: v for k, v in companions.items() if k in params})
    return kwargs


def pair(value: Any) -> tuple[int, int] | None:
    """``(h, w)`` of a size field: an int (square) or a pair of ints; None for anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value, value
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return value[0], value[1]
    return None


def _config_around(model: nn.Module, path: str) -> Any:
    """The config of the innermost module on ``path`` that holds one (the model's, at least)."""
    parts = path.split(".") if path else []
    for i in range(len(parts), 0, -1):
        config = getattr(model.get_submodule(".".join(parts[:i])), "config", None)
        if config is not None and not isinstance(config, Mapping):
            return config
    return model.config


def run_patches(model: nn.Module, tables: list[str], grid: tuple[int, int],
                where: tuple[str, str] | None = None) -> tuple[torch.Tensor, tuple[str, str]]:
    """Run the outermost module around ``tables`` whose forward takes a patch sequence and its grid
    (Qwen-VL's ``grid_thw``, SigLIP2's ``spatial_shapes`` ...) on one random image of ``grid`` patches, in
    the first of :data:`PATCH_LAYOUTS` it runs on; ``where``: that ``(module, layout)`` only.

    Returns the main output and ``(module, layout)``. Raises ``RuntimeError`` when none runs.
    """
    import torch

    failures = []
    for path in [where[0]] if where else _paths_around(tables):
        module = model.get_submodule(path) if path else model
        for layout in [where[1]] if where else PATCH_LAYOUTS:
            kwargs = patch_inputs(module, _config_around(model, path), grid, layout)
            if kwargs is None:
                break
            try:
                with torch.no_grad(), _quiet():
                    out = module(**kwargs)
            except Exception as exc:  # another layout, or a module that needs more (input_ids): try the next
                failures.append(f"{path or type(model).__name__} ({layout}): {_first_line(exc)}")
                continue
            return main_tensor(out), (path, layout)
    raise RuntimeError("; ".join(failures[-3:]) or "no module around the table takes a patch grid")


def main_tensor(out: Any) -> torch.Tensor:
    """The main tensor of a forward's output: itself, its last hidden state, logits or image embeddings, else
    the first tensor (FLAVA); of a tuple of tensors (MGP-STR's logits, one per head), the first."""
    import torch

    if isinstance(out, torch.Tensor):
        return out
    named = [getattr(out, k, None) for k in ("last_hidden_state", "logits", "image_embeds")]
    values = [v[0] if isinstance(v, (tuple, list)) and v else v
              for v in [*named, *(out.values() if hasattr(out, "values") else out)]]
    return next(v for v in values if isinstance(v, torch.Tensor))


def _paths_around(tables: list[str]) -> list[str]:
    """The modules around ``tables``, outermost first (``""`` is the model)."""
    paths = {""}
    for name in tables:
        parts = name.split(".")[:-1]
        paths.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return sorted(paths, key=lambda p: (p.count(".") + bool(p), p))


def _plain_tokens(config: Mapping[str, Any]) -> list[int]:
    """Token ids every tower's vocabulary holds that are no special token (never the padding id)."""
    sizes = [v for _, sub in sub_configs(config) if isinstance(v := sub.get("vocab_size"), int) and v >= 1]
    special = {i for _, sub in sub_configs(config) for i in _token_ids(sub)}
    return [t for t in range(min(min(sizes, default=100), 1000) - 1, -1, -1) if t not in special] or [0]


def safe_token(config: Mapping[str, Any]) -> int:
    """A token id every tower's vocabulary holds that is no special token (never the padding id)."""
    return _plain_tokens(config)[0]


def random_tokens(config: Mapping[str, Any], length: int, seed: int = 0) -> torch.Tensor:
    """``[1, length]`` random plain token ids (see :func:`safe_token`), the same for a seed."""
    import torch

    plain = torch.tensor(_plain_tokens(config))
    return plain[torch.randint(len(plain), (1, length), generator=torch.Generator().manual_seed(seed))]
