"""The catalogue: the written specs, the one place that knows where each family keeps its positions.

Both the file path (``resize_checkpoint``) and the in-memory path (``extend_model``)
read these specs (through :mod:`posextend.families.lookup`); nothing else in the package names a model
family with a learned table (:mod:`posextend.families.not_learned` names those without one). Each entry is
an :class:`~posextend.families.specs.ArchitectureSpec`, written with a builder for the shapes many families
share (BERT's embeddings module, RoBERTa's reserved rows, BART's two tables, image-patch grids).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from posextend.families.specs import ArchitectureSpec, BufferRule, GridSpec


def _roberta_reserved(config: Mapping[str, Any]) -> int:
    # RoBERTa's positions start at padding_idx + 1: rows 0..pad_token_id are reserved.
    return int(config.get("pad_token_id", 1)) + 1


_BERT_BUFFERS = (
    BufferRule(r"(^|\.)embeddings\.position_ids$", "arange"),
    BufferRule(r"(^|\.)embeddings\.token_type_ids$", "zeros"),
)
_CAUSAL_MASK = BufferRule(r"(^|\.)attn\.bias$", "toeplitz")


def _bert_like(model_type: str, prefix: str, **kw: Any) -> ArchitectureSpec:
    """BERT's embeddings module: ``embeddings.position_embeddings`` + position/token-type ids."""
    return ArchitectureSpec(model_type, prefix, ("embeddings.position_embeddings.weight",), buffers=_BERT_BUFFERS, **kw)


def _roberta_like(model_type: str, prefix: str) -> ArchitectureSpec:
    """RoBERTa: positions start at ``padding_idx + 1``; the config counts the reserved rows."""
    return _bert_like(model_type, prefix, reserved=_roberta_reserved, config_counts_reserved=True)


def _seq2seq(model_type: str, offset: int) -> ArchitectureSpec:
    """BART-style encoder-decoders: two tables, each ``offset`` rows longer than the config says."""
    return ArchitectureSpec(
        model_type, "model", ("encoder.embed_positions.weight", "decoder.embed_positions.weight"), reserved=offset,
    )


def _vision(model_type: str, prefix: str, table: str, reserved: int, *, grid: GridSpec = GridSpec(),
            group: str = "model", buffers: tuple[BufferRule, ...] = (),
            optional: tuple[str, ...] = ()) -> ArchitectureSpec:
    """An image-patch grid after ``reserved`` prefix tokens, sized by ``grid`` (``image_size / patch_size``)."""
    return ArchitectureSpec(model_type, prefix, (table,), length_keys=(grid.image_key,), reserved=reserved,
                            buffers=buffers, group=group, grid=grid, optional=optional)


def _vision_tower(model_type: str, reserved: int, *, group: str = "model", config: str = "") -> ArchitectureSpec:
    """CLIP-style towers: ``embeddings.position_embedding`` (an ``nn.Embedding``) + ``position_ids``, under
    ``vision_model.`` (in a composite model; a bare tower saves its tensors without it)."""
    inner = "vision_model." if config else ""
    ids = BufferRule(rf"(^|\.){re.escape(inner)}embeddings\.position_ids$", "arange")
    grid = GridSpec(f"{config}image_size", f"{config}patch_size", square=True)
    return _vision(model_type, "" if config else "vision_model", f"{inner}embeddings.position_embedding.weight",
                   reserved, grid=grid, group=group, buffers=(ids,))


# Image-patch grids, one written spec per family (kept apart from the text families' SPECS).
GRID_SPECS: dict[str, ArchitectureSpec] = {
    s.model_type: s
    for s in [
        # image-patch grids: [1, prefix + H*W, D] parameters after class (and distillation) tokens
        _vision("vit", "vit", "embeddings.position_embeddings", 1),
        _vision("vit_msn", "vit", "embeddings.position_embeddings", 1),
        _vision("deit", "deit", "embeddings.position_embeddings", 2),
        # DINOv2 interpolates whenever height != width: square only (registers follow the table, not in it)
        _vision("dinov2", "dinov2", "embeddings.position_embeddings", 1, grid=GridSpec(square=True)),
        # ... and with registers, its run-time interpolation antialiases (plain DINOv2's does not)
        _vision("dinov2_with_registers", "dinov2_with_registers", "embeddings.position_embeddings", 1,
                grid=GridSpec(square=True, antialias=True)),
        # MAE: a fixed 2-D sin-cos table, resampled as MAE's own fine-tuning code and transformers do;
        # the pre-training head's decoder holds a second grid of the same patches
        _vision("vit_mae", "vit", "embeddings.position_embeddings", 1, optional=("decoder.decoder_pos_embed",)),
        # DPT resamples its table to every input (bilinear, from a square grid): square only, bilinear
        _vision("dpt", "dpt", "embeddings.position_embeddings", 1, grid=GridSpec(square=True, strategy="bilinear")),
        _vision_tower("clip_vision_model", 1),
        _vision_tower("siglip_vision_model", 0),
    ]
}

# Grids a family resamples to every image's own size on each forward: nothing on disk to resize.
_NAFLEX = ("SigLIP2 (NaFlex) resamples its position grid to each image's patch grid on every forward; "
           "raise the image processor's max_num_patches for larger images instead")
RUN_TIME_GRIDS = {
    "siglip2": _NAFLEX,
    "siglip2_vision_model": _NAFLEX,
    "yolos": "YOLOS resamples its position grids (keeping its detection-token rows) to each image's size on "
             "every forward; feed larger images (the image processor's size) instead",
}

# Image towers of composite models, a length group beside the text tables the probe observes.
VISION_TOWERS: dict[str, ArchitectureSpec] = {
    s.model_type: s
    for s in [
        _vision_tower("clip", 1, group="vision", config="vision_config."),
        _vision_tower("siglip", 0, group="vision", config="vision_config."),
    ]
}

SPECS: dict[str, ArchitectureSpec] = {
    s.model_type: s
    for s in [
        ArchitectureSpec(
            "gpt2",
            prefix="transformer",
            tables=("wpe.weight",),
            length_keys=("n_positions", "n_ctx"),
            # Older checkpoints store the causal mask; match it exactly, never attn.c_attn.bias.
            buffers=(BufferRule(r"(^|\.)(attn|crossattention)\.bias$", "toeplitz"),),
            # A constant (-1e4) older checkpoints stored; 4.x ignored it, 5.x reports it unexpected.
            dropped=(r"(^|\.)(attn|crossattention)\.masked_bias$",),
        ),
        ArchitectureSpec(
            "gpt_neo", "transformer", ("wpe.weight",),
            # causal mask, banded for local-attention layers: both depend only on i - j
            buffers=(BufferRule(r"(^|\.)attn\.attention\.bias$", "toeplitz"),),
            dropped=(r"(^|\.)attn\.attention\.masked_bias$",),
        ),
        ArchitectureSpec(
            "gpt_bigcode", "transformer", ("wpe.weight",), length_keys=("n_positions",),
            buffers=(BufferRule(r"^(transformer\.)?bias$", "toeplitz"),),
        ),
        ArchitectureSpec(
            "openai-gpt", "transformer", ("positions_embed.weight",), length_keys=("n_positions",),
            buffers=(BufferRule(r"^(transformer\.)?position_ids$", "arange"), _CAUSAL_MASK),
        ),
        _bert_like("bert", "bert"),
        _bert_like("big_bird", "bert"),
        _bert_like("megatron-bert", "bert"),
        _bert_like("ernie", "ernie"),
        _bert_like("electra", "electra"),
        _bert_like("albert", "albert"),
        _bert_like("convbert", "convbert"),
        _bert_like("mobilebert", "mobilebert"),
        _bert_like("rembert", "rembert"),
        _bert_like("splinter", "splinter"),
        _bert_like("fnet", "fnet"),
        _bert_like("layoutlm", "layoutlm"),
        _bert_like("distilbert", "distilbert"),
        # positions start at 2: two unused rows, the config counts usable positions only
        _bert_like("nystromformer", "nystromformer", reserved=2),
        _bert_like("yoso", "yoso", reserved=2),
        _bert_like("mra", "mra", reserved=2),
        _roberta_like("roberta", "roberta"),
        _roberta_like("xlm-roberta", "roberta"),
        _roberta_like("camembert", "roberta"),
        _roberta_like("roberta-prelayernorm", "roberta_prelayernorm"),
        _roberta_like("data2vec-text", "data2vec_text"),
        _roberta_like("longformer", "longformer"),
        _roberta_like("markuplm", "markuplm"),
        ArchitectureSpec(
            "xlm", "transformer", ("position_embeddings.weight",),
            buffers=(BufferRule(r"^(transformer\.)?position_ids$", "arange"),),
        ),
        ArchitectureSpec(
            "flaubert", "transformer", ("position_embeddings.weight",),
            buffers=(BufferRule(r"^(transformer\.)?position_ids$", "arange"),),
        ),
        ArchitectureSpec("opt", "model", ("decoder.embed_positions.weight",), reserved=2),
        ArchitectureSpec("biogpt", "biogpt", ("embed_positions.weight",), reserved=2),
        _bert_like("bert-generation", "bert"),
        _seq2seq("bart", 2),
        _seq2seq("mbart", 2),
        _seq2seq("plbart", 2),
        _seq2seq("mvp", 2),
        _seq2seq("blenderbot", 0),
        _seq2seq("blenderbot-small", 0),
    ]
}
