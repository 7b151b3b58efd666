"""Config dicts as ``config.json`` holds them: dotted paths, sub-configs, size pairs, and shrinking for tiny twins.

Config paths name nested fields with dots: ``text_config.max_position_embeddings``. :func:`shrink` makes a
config tiny (widths, layers, vocabulary) while keeping every field that decides positions, for the tiny twins
of :mod:`posextend.families.twin`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

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


def token_ids(config: Mapping[str, Any]) -> list[int]:
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
        out["vocab_size"] = max([TINY_VOCAB, *(i + 1 for i in token_ids(out))])
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


def pair(value: Any) -> tuple[int, int] | None:
    """``(h, w)`` of a size field: an int (square) or a pair of ints; None for anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value, value
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return value[0], value[1]
    return None

