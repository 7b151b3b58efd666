"""Positions that are no learned absolute table: the families and config fields that say so, and what
they use instead (rotary embeddings, ALiBi, relative attention, fixed sinusoids)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Model types whose positions are not a learned absolute table, by what they use instead.
_NOT_LEARNED = {
    "rotary embeddings (RoPE)": ("llama", "mistral", "qwen2", "gemma", "gpt_neox", "gptj", "phi", "modernbert",
                                 "roformer"),
    "rotary embeddings or ALiBi": ("falcon",),
    "ALiBi attention biases": ("bloom", "mpt"),
    "relative attention": ("t5", "mt5", "funnel", "xlnet", "transfo-xl"),
    "fixed sinusoidal positions": ("xglm", "m2m_100", "marian", "pegasus", "speech_to_text"),
    "relative position biases inside attention windows": ("swin", "swinv2", "donut-swin"),
}


_RELATIVE_TYPES = {"relative_key": "relative positions", "relative_key_query": "relative positions",
                   "rotary": "rotary embeddings (RoPE)", "alibi": "ALiBi attention biases"}


def positions_kind_problem(config: Mapping[str, Any]) -> str | None:
    """Why this config's positions are not a learned absolute table, or None if they are."""
    model_type = config.get("model_type", "")
    for kind, model_types in _NOT_LEARNED.items():
        if model_type in model_types:
            return kind
    if model_type in ("deberta", "deberta-v2") and not config.get("position_biased_input"):
        return "relative attention (position_biased_input=false: no absolute table)"
    pet = config.get("position_embedding_type", "absolute")
    if pet in _RELATIVE_TYPES:  # other values (DETR-style "sine") describe an image side: observed, not refused
        return f"position_embedding_type={pet!r} ({_RELATIVE_TYPES[pet]})"
    for key in ("sinusoidal_pos_embds", "sinusoidal_embeddings"):  # DistilBERT, XLM/FlauBERT
        if config.get(key):
            return f"fixed sinusoidal positions ({key}=true)"
    # ESM-1b carries rope_theta although its position_embedding_type says absolute: the type decides.
    if pet != "absolute" or "position_embedding_type" not in config:
        if any(k in config for k in ("rope_theta", "rope_scaling", "rope_parameters", "rotary_dim", "rotary_pct")):
            return "rotary embeddings (RoPE)"
    if model_type in ("beit", "data2vec-vision") and not config.get("use_absolute_position_embeddings"):
        return "relative position biases (use_absolute_position_embeddings=false)"
    if config.get("alibi"):
        return "ALiBi attention biases"
    return None
