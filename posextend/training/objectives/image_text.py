"""The ``image-text`` objective: dual encoders (CLIP, SigLIP, Chinese-CLIP, AltCLIP, MetaCLIP …) learn to read long
captions, as Long-CLIP (arXiv 2403.15378, its repository's ``train/``) fine-tunes CLIP from 77 to 248 text positions:
a symmetric InfoNCE between the images and their whole captions, plus one between the images' features reduced to the
batch's principal components and the captions' first sentences (what keeps short inputs); label smoothing 0.1, the
the model's own logit scale (at most 100); SigLIP's sigmoid loss for SigLIP. With ``kps`` (the default) text positions 0-19 stay the
source's, frozen. A run extends the text length, the image size, or both.

Worth it (:meth:`ImageText.reading`): R@1 (text→image, image→text) on held-out pairs whose caption is longer than the
old length beats the source reading them cut at its old length or averaging its embeddings of their chunks (the
better: the baseline), and pairs whose caption fits keep the source's R@1. Registered through the
``posextend.objectives`` entry point, as a third-party objective is.
"""

from __future__ import annotations

import contextlib
import copy
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from posextend.errors import DataError, TrainingError
from posextend.scoring.by_position import Bucket, EvalReport, bucket_edges
from posextend.scoring.verdict import Reading
from posextend.tables.strategies import kps_keep
from posextend.training.context import RunContext
from posextend.training.loading import Loaded, load_headed_model, load_processor
from posextend.training.objectives.base import (CheckpointFacts, Objective, draw_mates, register_objective,
                                               without_dropout)

# the dual encoders whose base class gives image and text features (tests/test_image_text.py trains each's tiny twin)
FAMILIES = ("clip", "siglip", "siglip2", "chinese_clip", "altclip", "metaclip_2", "aimv2", "align", "blip", "owlvit",
            "owlv2", "groupvit", "clipseg", "vision-text-dual-encoder")
SIGMOID = ("siglip", "siglip2")
SMOOTHING = 0.1  # Long-CLIP's label smoothing, both terms
PCA_MOST, PCA_SHARE = 32, 4  # Long-CLIP: 32 principal components of each GPU's 128 image features (a quarter)
SENTENCE = re.compile(r"(?<=[.!?])\s+")  # where a caption's sentences part
MODES = ("cut", "chunks")  # how a caption longer than the old length is read without the extension


class Pairs(Sequence):
    """Image-caption pairs as a run trains on them: item ``i`` is the data's item with ``tokens``, its caption's
    token count (specials included, at most the run's length)."""

    def __init__(self, data: Sequence[dict[str, Any]], tokens: list[int]):
        self.data, self.tokens = data, tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index):
        if isinstance(index, slice):
            picked = range(len(self))[index]
            return Pairs(self.data[picked.start:picked.stop:picked.step], self.tokens[index])
        return {**self.data[index], "tokens": self.tokens[index]}


@dataclass
class Held:
    """What a run keeps: the held-out pixels by image size, the rows frozen, how the baseline read (cut, chunks)."""

    pixels: dict[tuple[int, int], dict[str, torch.Tensor]] = field(default_factory=dict)
    started: bool = False  # the frozen rows' hook is on
    frozen: int = 0
    baseline: str | None = None


@register_objective(
    "image-text",
    description="Dual encoders (CLIP, SigLIP …): image-caption pairs, Long-CLIP's long- and short-caption "
                "contrastive loss; judged by R@1 on held-out captions longer than the old length.",
)
class ImageText(Objective):
    """Long-CLIP's fine-tune for any dual encoder posextend resizes (:data:`FAMILIES`). Each sample is a pair and
    :attr:`batch_mates` more drawn from the training pairs by its own generator, so that a micro-batch of 4 samples
    contrasts 32 pairs (in-batch negatives)."""

    model_class = "AutoModel"
    head = "image-text"
    metric = "R@1"
    priority = 35  # above seq2seq, masked and causal: a dual encoder is trained as one
    State = Held
    stream = False
    unused_parameters = True  # a tower's own pooler, a SigLIP head the features skip
    steps = 200
    eval_sequences = 128  # held-out pairs each check reads
    # measured on benchmarks/image_text.py (text 64 wide): lr 2e-4 cosine; wider models get 64 / width of it
    lr = {"new-rows": 1e-3, "positions": 1e-3, "all": 2e-4, "lora": 1e-3}
    lr_width = 64
    schedule = {"new-rows": "constant", "positions": "cosine", "all": "cosine", "lora": "cosine"}
    strategy = {"new-rows": "tile", "positions": "kps", "all": "kps", "lora": "kps"}
    anchor = 0.0  # the short-caption term keeps short inputs (measured: benchmarks/image_text.py); --anchor adds one
    batch_mates = 7
    # the short-caption term's weight: Long-CLIP's first code's (its paper's 1 held far R@1 at 0.40 where the first
    # sentence names a third of the image: docs/reference/benchmarks.md, benchmarks/image_text.py)
    short_weight = 0.1
    patches = 0  # an image's patches (set for the run by size_processor), counted as its tokens

    def accepts(self, checkpoint: CheckpointFacts) -> bool:
        """A dual encoder of :data:`FAMILIES` (not a sentence-transformers folder)."""
        return not checkpoint.sentence_transformer and checkpoint.config.get("model_type") in FAMILIES

    def for_data(self, documents: Sequence[Any]) -> ImageText:
        return copy.copy(self)  # a run's own: size_processor sets its patches

    def documents(self, paths: Sequence[str | Path]) -> Any:
        from posextend.training.images import read_images

        return read_images(paths, need="text")

    def load_model(self, directory: Path, *, init_head: bool) -> Loaded:
        """The checkpoint's base class (``CLIPModel``, ``SiglipModel`` …) and its processor of text and images."""
        from posextend.files.checkpoint import Checkpoint

        kind = Checkpoint.of(directory).config.get("model_type")
        if kind not in FAMILIES:
            raise TrainingError(f"The image-text objective trains dual encoders ({', '.join(FAMILIES)}); {directory} "
                                f"holds a {kind} model: choose another objective.")
        loaded = load_headed_model(directory, self.auto_class(), self.head, self.name, init_head=init_head,
                                   processor=lambda d: load_processor(d, "both"))
        without_dropout(loaded.model)
        return loaded

    def split(self, documents: Any, *, processor: Any, length: int, config: Any) -> tuple[Any, Any]:
        from posextend.training.images import split_images

        return split_images(documents, least=config.eval_sequences, seed=config.seed)

    def size_processor(self, processor: Any, *, length: int, image_size: tuple[int, int] | None) -> None:
        """The tokenizer's ``model_max_length`` is the run's length; the image processor's size, ``image_size``."""
        processor.tokenizer.model_max_length = length
        if image_size is not None:
            processor.image_processor = sized(processor.image_processor, image_size)
            patch = getattr(self, "patch", None) or (16, 16)
            self.patches = (image_size[0] // patch[0]) * (image_size[1] // patch[1])

    def check(self, loaded: Loaded, directory: Path) -> None:
        from posextend.families.configs import pair

        vision = loaded.hf_model.config.to_dict().get("vision_config") or {}
        self.patch = pair(vision.get("patch_size")) or (16, 16)

    def samples(self, processor: Any, documents: Any, length: int) -> Pairs:
        if len(documents) < 2:
            raise DataError(f"Image-text training needs at least 2 image-caption pairs, got {len(documents)}.")
        ids = _cut(processor.tokenizer, _texts(Pairs(documents, [])), length)
        return Pairs(documents, [len(row) for row in ids])

    def count(self, batch: Sequence[dict[str, Any]]) -> tuple[int, int]:
        """``(pairs, tokens)``, batch-mates included; a pair's tokens: its caption's and its image's patches."""
        group = 1 + self.batch_mates
        return group * len(batch), group * sum(item["tokens"] + self.patches for item in batch)

    def loss(self, run: RunContext, positions: range, batch: Sequence[dict[str, Any]]) -> tuple[torch.Tensor, int]:
        """Long-CLIP's two terms on the micro-batch and its batch-mates: the images against the whole captions, and
        the images' features reduced to the batch's principal components against the first sentences."""
        if not run.state.started:
            _start(run)
        items = list(batch) + draw_mates(run, positions, self.batch_mates)[0]
        tokenizer, n = run.processor.tokenizer, len(items)
        pixels = _image_inputs(run.processor.image_processor, [i["image"] for i in items])
        shorts = [first_sentence(i["text"]) for i in items]
        rows = (_cut(tokenizer, [i["text"] for i in items], run.length)
                + _cut(tokenizer, shorts, min(run.length, run.old_length)))
        ids, mask = _padded(tokenizer, rows, run.length if _sigmoid(run.unwrapped) else max(map(len, rows)))
        device = run.accelerator.device
        # one forward through the prepared model (under DDP its reducer sees every output): both captions, the images
        out = run.model(input_ids=ids.to(device), **{k: v.to(device) for k, v in pixels.items()},
                        **_masked(tokenizer, mask.to(device)))
        image, text = F.normalize(out.image_embeds, dim=-1), F.normalize(out.text_embeds, dim=-1)
        reduced = F.normalize(pca(image, max(1, min(PCA_MOST, n // PCA_SHARE))), dim=-1)
        sigmoid = _sigmoid(run.unwrapped)
        loss = (_pair_loss(run.unwrapped, image, text[:n], sigmoid)
                + self.short_weight * _pair_loss(run.unwrapped, reduced, text[n:], sigmoid))
        if self.anchor and run.reference is not None and not run.short_inputs_fixed:
            loss = loss + self.anchor * _anchor(run, rows[n:], text[n:])
        return loss, len(items)

    @torch.no_grad()
    def evaluate(self, run: RunContext) -> EvalReport:
        """Every held-out pair, its caption read whole: R@1 (text→image and image→text, averaged) by caption length,
        the short captions (within the old length) retrieved among themselves and the long ones among theirs."""
        pairs, length, old = run.eval_seqs, run.length, run.old_length
        with _evaluating(run.model):
            image = self._images(run, run.model, run.image_size)
            text = _text_features(run, run.model, _cut(run.processor.tokenizer, _texts(pairs), length), length)
        hits, losses = torch.zeros(len(pairs)), torch.zeros(len(pairs))
        for pool in _pools(pairs, old, length):
            if pool:
                hits[pool], losses[pool] = _retrieval(text[pool], image[pool])
        edges = bucket_edges(length + 1, run.config.buckets, old_length=old + 1 if old < length else None)
        lengths = torch.tensor(pairs.tokens)
        buckets = []
        for lo, hi in zip(edges[:-1], edges[1:]):
            inside = (lengths >= lo) & (lengths < hi)
            n = int(inside.sum())
            if n:
                loss = float(losses[inside].mean())
                buckets.append(Bucket(lo, hi, loss, math.exp(min(loss, 50)), n, accuracy=float(hits[inside].mean())))
        loss = float(losses.mean())
        return EvalReport(self.name, length, len(pairs), loss, math.exp(min(loss, 50)), len(pairs), buckets,
                          old if old < length else None, accuracy=float(hits.mean()), metric=self.metric)

    def baseline(self, run: RunContext, source: torch.nn.Module) -> Reading | None:
        """The source (at its old length and image size) reading the long captions cut at its old length, and
        averaging its embeddings of each caption's chunks, the better of the two; the short captions read whole."""
        reading, mode = self._without_context(run, source.to(run.accelerator.device), run.old_image_size)
        if reading is not None and run.state.baseline is None:
            run.state.baseline = mode
        return reading

    def baseline_name(self, run: RunContext) -> str:
        return (f"the source reading captions cut at {run.old_length} tokens" if run.state.baseline != "chunks" else
                f"the source averaging its embeddings of each caption's {run.old_length}-token chunks")

    def control(self, run: RunContext) -> Reading | None:
        """The trained model read as the source is (captions cut or chunked at the old length, the better)."""
        return self._without_context(run, run.model, run.image_size)[0]

    def control_name(self, run: RunContext) -> str:
        return f"the same model reading captions cut at {run.old_length} tokens or in chunks (the better)"

    def reading(self, run: RunContext) -> Reading | None:
        """The model being trained reading the long captions whole (and the short ones)."""
        return self.read(run, run.model, run.image_size, "whole")

    def notes(self, run: RunContext) -> list[str]:
        short, long = _pools(run.eval_seqs, run.old_length, run.length)
        loss = "sigmoid (SigLIP's)" if _sigmoid(run.unwrapped) else "InfoNCE"
        lines = [f"Long-CLIP's loss: {loss}, whole captions and first sentences against the images' principal "
                 f"components; each sample with {self.batch_mates} batch-mates"]
        if run.state.frozen:
            lines.append(f"Text positions 0-{run.state.frozen - 1} kept frozen (Long-CLIP; kps copied them exactly)")
        if run.old_length < run.length:
            lines.append(f"Held-out pairs: {len(long)} captions longer than {run.old_length} tokens (the far range), "
                         f"{len(short)} within it (the original range" + ("" if short else ": none, so the long "
                                                                            "ones cut at the old length") + ")")
        else:
            lines.append("No verdict: the text length is not extended (an image size alone is read before and after)")
        return lines

    def _images(self, run: RunContext, model: torch.nn.Module, size: tuple[int, int] | None) -> torch.Tensor:
        """The held-out images' normalised features by ``model``, their pixels made once per image size."""
        state: Held = run.state
        key = size or (0, 0)
        if key not in state.pixels:
            processor = sized(run.processor.image_processor, size) if size else run.processor.image_processor
            images = [run.eval_seqs.data[i]["image"] for i in range(len(run.eval_seqs))]
            parts = [_image_inputs(processor, images[i:i + 64]) for i in range(0, len(images), 64)]
            state.pixels[key] = {k: torch.cat([part[k] for part in parts]) for k in parts[0]}
        inner, inputs = _unwrapped(model), state.pixels[key]
        return F.normalize(_sliced(run, lambda **x: _pooled(inner.get_image_features(**x)), inputs), dim=-1)

    def _without_context(self, run: RunContext, model: torch.nn.Module, size: tuple[int, int] | None
                         ) -> tuple[Reading | None, str]:
        """``model`` reading the long captions cut at the old length and in chunks: the better reading, its mode."""
        readings = {mode: self.read(run, model, size, mode) for mode in MODES}
        if readings["cut"] is None:
            return None, "cut"
        mode = max(MODES, key=lambda m: (readings[m].far, m == "cut"))
        return readings[mode], mode

    @torch.no_grad()
    def read(self, run: RunContext, model: torch.nn.Module, size: tuple[int, int] | None, mode: str) -> Reading | None:
        """R@1 of ``model`` (images at ``size``): ``far`` on the long pairs, their captions read by ``mode``
        (``whole``, ``cut`` at the old length, ``chunks`` of it averaged); ``original`` on the short pairs (or, with
        none, the long captions cut); ``parts``: the far range's text→image and image→text. None when the run
        does not extend the text, or no held-out caption is longer than the old length."""
        pairs, old, length = run.eval_seqs, run.old_length, run.length
        short, long = _pools(pairs, old, length)
        if old >= length or not long:
            return None
        with _evaluating(model):
            image, texts, tokenizer = self._images(run, model, size), _texts(pairs), run.processor.tokenizer
            rows, owner = (_chunks(tokenizer, [texts[i] for i in long], old) if mode == "chunks" else
                           (_cut(tokenizer, [texts[i] for i in long], length if mode == "whole" else old), None))
            text = _text_features(run, model, rows, length if mode == "whole" else old, owner=owner)
            t2i, i2t = _directions(text, image[long])
            pool = short or long  # with no short caption, the long ones cut at the old length
            cut = _cut(tokenizer, [texts[i] for i in pool], old)
            original = _retrieval(_text_features(run, model, cut, old), image[pool])[0].mean()
        far = float((t2i.mean() + i2t.mean()) / 2)
        return Reading(far=far, original=float(original), metric="R@1", higher=True,
                       parts={"text→image": float(t2i.mean()), "image→text": float(i2t.mean())})


@contextlib.contextmanager
def _evaluating(model: torch.nn.Module) -> Iterator[None]:
    """``model`` in eval mode meanwhile (ALIGN's batch norms), then as it was."""
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


def _start(run: RunContext) -> None:
    """Once per run: the text table's rows ``kps`` kept exact (its ``keep``: Long-CLIP's 0-19 of CLIP's 77) frozen
    by a gradient hook. The logit scale stays the model's (Long-CLIP's reset to 100 is CLIP's own value; the
    benchmark's CLIP, at 25, lost 0.17 of far R@1 at 300 steps with it: benchmarks/image_text.py)."""
    state: Held = run.state
    state.started = True
    model = run.unwrapped
    given = (run.config.params or {}).get("keep")  # kps's, else its default
    kept = run.config.strategy == "kps" and not run.short_inputs_fixed
    keep = (kps_keep(run.old_length) if given is None else given) if kept else 0
    if keep and run.spec is not None:
        # by name without peft's wrappers (LoRA's base_model.model. and modules_to_save.default.)
        plain = {n.removeprefix("base_model.model.").replace(".modules_to_save.default.", "."): p
                 for n, p in model.named_parameters() if p.requires_grad}
        for name in run.spec.table_names(frozenset(plain)):
            if name in plain and plain[name].dim() == 2:
                plain[name].register_hook(lambda g, k=keep: torch.cat([torch.zeros_like(g[:k]), g[k:]]))
                state.frozen = keep


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model whose ``get_text_features`` and ``get_image_features`` a forward calls (DDP's or peft's inside)."""
    inner = getattr(model, "module", model)
    base = getattr(inner, "base_model", None)
    return getattr(base, "model", inner) if base is not None and base is not inner else inner


def _sigmoid(model: torch.nn.Module) -> bool:  # a SigLIP: the sigmoid loss, its text padded to its length
    return getattr(getattr(_unwrapped(model), "config", None), "model_type", None) in SIGMOID


def first_sentence(caption: str) -> str:
    """Long-CLIP's short caption: the caption's first sentence."""
    return SENTENCE.split(caption.strip(), maxsplit=1)[0]


def pca(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` (rows of features) reduced to its ``k`` principal components and mapped back (Long-CLIP's ``PCA``). The
    components are found without gradient (an SVD's backward divides by gaps between singular values, which a small
    batch's features close: inf, then NaN weights); the gradient reaches the features through the projection."""
    mean = x.mean(0, keepdim=True)
    centred = (x - mean).float()
    with torch.no_grad():
        components = torch.linalg.svd(centred.double(), full_matrices=False)[2][:k].T.to(centred.dtype)
    return (centred @ components @ components.T + mean).to(x.dtype)


def _pair_loss(model: torch.nn.Module, image: torch.Tensor, text: torch.Tensor, sigmoid: bool) -> torch.Tensor:
    """Symmetric InfoNCE (label smoothing 0.1, scale clamped at 100) or, for SigLIP, its sigmoid loss."""
    inner = _unwrapped(model)
    if sigmoid:
        logits = text @ image.T * inner.logit_scale.exp() + inner.logit_bias
        signs = 2 * torch.eye(len(text), device=text.device) - 1
        return -F.logsigmoid(signs * logits).sum() / len(text)
    scale = (1 / inner.temperature if hasattr(inner, "temperature") else inner.logit_scale.exp()).clamp(max=100)
    logits = scale * image @ text.T
    target = torch.arange(len(text), device=text.device)
    return (F.cross_entropy(logits, target, label_smoothing=SMOOTHING)
            + F.cross_entropy(logits.T, target, label_smoothing=SMOOTHING)) / 2


def _anchor(run: RunContext, rows: list[list[int]], features: torch.Tensor) -> torch.Tensor:
    """The cosine distance between ``features`` (the model's, of the short captions ``rows``) and the frozen
    source's features of them, at its own length."""
    with torch.no_grad():
        target = _text_features(run, run.reference.to(run.accelerator.device), rows, min(run.old_length, run.length))
    return (1 - (features * target).sum(-1)).mean()


def _pooled(out: Any) -> torch.Tensor:
    """Features from ``get_*_features``: a tensor, or (transformers 5) an output's ``pooler_output``."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def _texts(pairs: Pairs) -> list[str]:  # the captions alone (ImageData's column: no image decoded)
    return list(pairs.data.dataset["text"]) if hasattr(pairs.data, "dataset") else [d["text"] for d in pairs.data]


def _pools(pairs: Pairs, old: int, length: int) -> tuple[list[int], list[int]]:
    """The held-out pairs whose caption fits the old length, and those longer (all in one pool when not extended)."""
    if old >= length:
        return list(range(len(pairs))), []
    return [i for i, n in enumerate(pairs.tokens) if n <= old], [i for i, n in enumerate(pairs.tokens) if n > old]


def _cut(tokenizer: Any, texts: list[str], length: int) -> list[list[int]]:
    """Each caption's token ids (its special tokens included), cut at ``length``."""
    return tokenizer(texts, truncation=True, max_length=length)["input_ids"]


def _chunks(tokenizer: Any, texts: list[str], length: int) -> tuple[list[list[int]], list[int]]:
    """Each caption in chunks of whole sentences of at most ``length`` tokens (a longer sentence cut in windows),
    each framed by the tokenizer's special tokens; and the caption each chunk belongs to."""
    full, bare = tokenizer("a")["input_ids"], tokenizer("a", add_special_tokens=False)["input_ids"]
    at = next(i for i in range(len(full)) if full[i:i + len(bare)] == bare)
    head, tail = full[:at], full[at + len(bare):]
    room = max(1, length - len(head) - len(tail))
    rows, owner = [], []
    for k, text in enumerate(texts):
        current: list[int] = []
        for sentence in SENTENCE.split(text.strip()):
            ids = tokenizer((" " if current else "") + sentence, add_special_tokens=False)["input_ids"]
            if current and len(current) + len(ids) > room:
                rows.append(current)
                current = []
            current += ids
            while len(current) > room:
                rows.append(current[:room])
                current = current[room:]
        rows += [current] if current else []
        owner += [k] * (len(rows) - len(owner))
    return [head + row + tail for row in rows], owner


def _padded(tokenizer: Any, rows: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows padded (with the tokenizer's pad id) to ``width``, and their attention mask."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = torch.as_tensor(row[:width]), 1
    return ids, mask


def _masked(tokenizer: Any, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The attention mask as a keyword, where the tokenizer makes one (SigLIP's reads its padding unmasked)."""
    return {"attention_mask": mask} if "attention_mask" in getattr(tokenizer, "model_input_names", ()) else {}


def _text_features(run: RunContext, model: torch.nn.Module, rows: list[list[int]], length: int,
                   owner: list[int] | None = None) -> torch.Tensor:
    """Normalised text features of token rows (padded as the family reads them: SigLIP to ``length``); with
    ``owner``, the mean of each caption's chunks, normalised (chunk-and-average)."""
    tokenizer, inner = run.processor.tokenizer, _unwrapped(model)
    ids, mask = _padded(tokenizer, rows, length if _sigmoid(model) else max(len(r) for r in rows))

    def features(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return _pooled(inner.get_text_features(input_ids=x, **_masked(tokenizer, m)))

    text = F.normalize(_sliced(run, features, {"x": ids, "m": mask}), dim=-1)
    if owner is None:
        return text
    index = torch.as_tensor(owner, device=text.device)
    summed = torch.zeros(int(index.max()) + 1, text.shape[1], device=text.device).index_add_(0, index, text.float())
    return F.normalize(summed, dim=-1)


def _image_inputs(image_processor: Any, images: list[Any]) -> dict[str, torch.Tensor]:
    """What the image processor makes of ``images`` for the model (pixels; SigLIP2's masks and patch grids too)."""
    return {k: v for k, v in image_processor(images, return_tensors="pt").items() if isinstance(v, torch.Tensor)}


def _sliced(run: RunContext, fn: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """``fn(**inputs)`` on the run's device, in slices of 64 rows (all at once when training: one graph)."""
    device, n = run.accelerator.device, len(next(iter(inputs.values())))
    step = n if torch.is_grad_enabled() else 64
    return torch.cat([fn(**{k: v[i:i + step].to(device) for k, v in inputs.items()}) for i in range(0, n, step)])


def _directions(text: torch.Tensor, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each pair's R@1 text→image and image→text; a tie at the top shares the hit (ties of identical inputs)."""
    sim = (text.float() @ image.float().T).cpu()
    top = [s >= s.max(1, keepdim=True).values for s in (sim, sim.T)]
    return tuple(t.diagonal().float() / t.sum(1) for t in top)


def _retrieval(text: torch.Tensor, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each pair's R@1 (text→image and image→text averaged) and its InfoNCE loss at scale 100, in this pool."""
    t2i, i2t = _directions(text, image)
    logits = 100 * (text.float() @ image.float().T).cpu()
    target = torch.arange(len(text))
    loss = (F.cross_entropy(logits, target, reduction="none") + F.cross_entropy(logits.T, target, reduction="none")) / 2
    return (t2i + i2t) / 2, loss


def image_pixels(image_processor: Any) -> tuple[int, int] | None:
    """The (height, width) of the images ``image_processor`` makes: its crop, else its size (a shortest edge: square)."""
    data = image_processor.to_dict()
    size = data.get("crop_size") if data.get("do_center_crop") and data.get("crop_size") else data.get("size")
    size = {"height": size, "width": size} if isinstance(size, int) else size or {}
    side = size.get("shortest_edge")
    return (int(size["height"]), int(size["width"])) if size.get("height") and size.get("width") else \
        (int(side), int(side)) if side else None


def sized(image_processor: Any, size: tuple[int, int]) -> Any:
    """A copy of ``image_processor`` making images of ``size`` (height, width), its settings changed as ``resize-model``
    writes them (:func:`posextend.resize.writer.processor_config`)."""
    from posextend.resize.writer import processor_config

    current = image_pixels(image_processor)
    if current is None or tuple(current) == tuple(size):
        return image_processor
    data = image_processor.to_dict()
    changed = processor_config({k: data[k] for k in ("size", "crop_size") if data.get(k)}, current, tuple(size))
    return type(image_processor).from_dict({**data, **changed})
