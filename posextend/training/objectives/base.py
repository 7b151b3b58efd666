"""Fine-tune objectives, a plug-in registry like the strategies'.

An objective knows how to load the model it trains, cut documents into training samples,
compute one micro-batch's loss and evaluate by position. The loop (accumulation, resume, NaN,
Ctrl-C, progress, distribution) and the save (the checkpoint writer of ``resize-model``, into
the source's files and layout) are shared (:mod:`posextend.training.loop`); the loop hands
each objective a :class:`~posextend.training.context.RunContext`, its one view of the run. Every random
choice of a sample comes from ``run.generator(p)`` for its global number ``p``, so a run is the
same whatever the number of processes.

Built-ins: ``causal`` (next-token LM), ``masked`` (BERT masking), ``contrastive``
(embedding models: a short passage drawn from a long document must retrieve that document
among the batch's, sentence-transformers' ``MultipleNegativesRankingLoss``).

Example::

    @register_objective("my-objective")
    class Mine(Objective):
        description = "..."
        def load(self, directory, *, init_head): ...
        def loss(self, run, positions, batch): ...
        def evaluate(self, run): ...
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from posextend.training.context import RunContext
from posextend.scoring.text import framed
from posextend.errors import DataError, TrainingError
from posextend.scoring.by_position import Bucket, EvalReport, bucket_edges, evaluate_model
from posextend.training.loading import Loaded, config_head, is_sentence_transformer, load_language_model, loaded
from posextend.registry import Registry

ENTRY_POINT_GROUP = "posextend.objectives"


class Objective:
    """Base class of an objective. ``samples`` and ``save`` have defaults; the rest is per objective."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    unused_parameters: ClassVar[bool] = False  # some trainable parameters get no gradient from the loss
    steps: ClassVar[int] = 200  # default number of optimizer steps
    # by train mode: the default lr, schedule, and strategy when the fine-tune extends (README, quality grid)
    lr: ClassVar[dict[str, float]] = {"new-rows": 3e-3, "positions": 1e-3, "all": 1e-4}
    lr_width: ClassVar[int | None] = None  # the table width ``lr["all"]`` was measured at (None: any width)
    schedule: ClassVar[dict[str, str]] = {"new-rows": "constant", "positions": "constant", "all": "constant"}
    strategy: ClassVar[dict[str, str]] = {"new-rows": "tile", "positions": "tile", "all": "tile"}
    anchor: ClassVar[float | None] = None  # weight of a term keeping the source's outputs (None: no such term)

    def load(self, directory: Path, *, init_head: bool) -> Loaded:
        raise NotImplementedError

    def copy_reference(self, loaded: Loaded) -> torch.nn.Module:
        """The anchor's reference (``extras["source"]``) when it is the checkpoint being trained: a frozen
        copy of its model as loaded, before its table is extended. ``load`` makes it when ``anchor`` is set."""
        return frozen_copy(loaded.model)

    def read_reference(self, directory: Path, *, init_head: bool) -> torch.nn.Module:
        """The anchor's reference read from ``directory`` instead (the original model the checkpoint was
        extended from), frozen: this objective's model there, at its own length."""
        import copy

        plain = copy.copy(self)
        plain.anchor = 0.0  # no frozen copy of the reference itself
        return plain.load(directory, init_head=init_head).model.eval().requires_grad_(False)

    def default_lr(self, train: str, width: int) -> float:
        """The lr for train mode ``train`` on a model ``width`` wide: ``lr[train]``; for ``all``, on
        models wider than ``lr_width``, scaled by ``lr_width / width`` (Adam's rule for hidden
        weights, as in muP; GPT-3's pretraining lrs fall about as 1/width too). Tables (the other
        modes) keep their lr at any width."""
        lr = self.lr[train]
        if train == "all" and self.lr_width and width > self.lr_width:
            lr *= self.lr_width / width
        return lr

    def with_anchor(self, weight: float) -> Objective:
        """This objective with its anchor term weighted ``weight`` (0: off, and no frozen source copy)."""
        import copy

        if self.anchor is None:
            raise TrainingError(f"The {self.name} objective has no anchor term to weight; leave the anchor unset.")
        if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight >= 0):
            raise TrainingError(f"The anchor weight must be a finite number >= 0, got {weight!r}.")
        changed = copy.copy(self)
        changed.anchor = float(weight)
        return changed

    def documents(self, paths: Sequence[str | Path]) -> Sequence[Any]:
        """What :meth:`samples` cuts, read from the data files: their texts (:func:`posextend.scoring.text.read_documents`)."""
        from posextend.scoring.text import read_documents

        return read_documents(paths)

    def samples(self, tokenizer, documents: Sequence[str], length: int) -> torch.Tensor:
        """``[n, length]`` token windows: documents joined with EOS/SEP and packed."""
        from posextend.scoring.text import pack

        return pack(tokenizer, documents, length)

    def loss(self, run: RunContext, positions: range, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The micro-batch's mean loss on this process and the number of items it averages."""
        raise NotImplementedError

    def evaluate(self, run: RunContext) -> EvalReport:
        raise NotImplementedError

    def notes(self, run: RunContext) -> list[str]:
        """Lines about the run that the fine-tune's report, the CLI and the model card carry (none by default)."""
        return []


_REGISTRY: Registry[Objective] = Registry("objective", "objectives", ENTRY_POINT_GROUP, TrainingError)


def register_objective(name: str, *, description: str | None = None) -> Callable[[type[Objective]], type[Objective]]:
    """Class decorator registering an :class:`Objective` under ``name``; refuses invalid or duplicate names."""
    _REGISTRY.check_name(name)

    def decorator(cls: type[Objective]) -> type[Objective]:
        if not (isinstance(cls, type) and issubclass(cls, Objective)):
            raise TrainingError(f"Objective {name!r} must be a subclass of posextend.training.objectives.base.Objective.")
        _REGISTRY.check_name(name)
        cls.name = name
        cls.description = description or cls.description or (cls.__doc__ or "").strip().split("\n")[0]
        _REGISTRY.add(name, cls())
        return cls

    return decorator


def available_objectives() -> dict[str, Objective]:
    """All registered objectives (built-ins and plug-ins), by name."""
    return _REGISTRY.available()


def get_objective(name: str) -> Objective:
    """The registered objective ``name``; raises :class:`TrainingError` listing the valid ones."""
    return _REGISTRY.get(name)


def _features(rows, tokenizer, device) -> dict[str, torch.Tensor]:
    """:func:`posextend.scoring.text.framed` on ``device``."""
    return {k: v.to(device) for k, v in framed(rows, tokenizer).items()}


def default_objective(directory: Path) -> str:
    """``contrastive`` for a sentence-transformers folder; else the objective named like the family's head
    (``causal``, ``masked``, ``seq2seq``)."""
    if is_sentence_transformer(directory):
        return "contrastive"
    head = config_head(directory)
    if head not in ("causal", "masked", "seq2seq"):
        raise TrainingError(
            "This family has no causal, masked or sequence-to-sequence language-model head; fine-tuning it is not "
            "supported yet. Resize it and train it with your own trainer."
        )
    return head


def without_dropout(model: torch.nn.Module, *, attention_only: bool = False) -> int:
    """Zero ``model``'s dropout for this run (its config, and so the written model, keeps its values).

    Language models train without dropout, as if in eval mode (what every earlier posextend run
    did), but in training mode, so that gradient checkpointing applies. ``attention_only``: zero
    only attention-probability dropout (the contrastive objective keeps the rest), because with it
    PyTorch's fused attention falls back to its math kernel: on 2 CPU cores MiniLM at 2048 tokens
    took 38 s per forward pass of 4 documents instead of 3.4 s. Returns how many were zeroed.
    """
    zeroed = 0
    for module in model.modules():
        if attention_only and "attention" not in type(module).__name__.lower():
            continue
        for name, value in list(vars(module).items()) + list(module.named_children()):
            if "dropout" not in name.lower() and not isinstance(value, torch.nn.Dropout):
                continue
            if isinstance(value, torch.nn.Dropout) and value.p:
                value.p = 0.0
                zeroed += 1
            elif isinstance(value, float) and value and not attention_only:  # functional dropout (OPT, BART)
                setattr(module, name, 0.0)
                zeroed += 1
    return zeroed


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` in eval mode that never trains: the source an anchor term compares with."""
    import copy

    return copy.deepcopy(model).eval().requires_grad_(False)


# ------------------------------------------------------------------------------ language models


class _LanguageModel(Objective):
    head: ClassVar[str]  # "causal" or "masked": the head loaded and how held-out text is scored

    def load(self, directory: Path, *, init_head: bool) -> Loaded:
        model = load_language_model(directory, self.head, init_head=init_head)
        without_dropout(model.model)
        return model

    def evaluate(self, run: RunContext) -> EvalReport:
        return evaluate_model(run.model, run.eval_seqs, self.head, tokenizer=run.tokenizer, buckets=run.config.buckets,
                              old_length=run.old_length if run.old_length < run.length else None,
                              batch_size=run.config.batch_size, seed=run.config.seed)


@register_objective("causal", description="Next-token prediction (GPT-style models).")
class CausalLM(_LanguageModel):
    """Next-token loss on every position, plus ``anchor`` × the KL divergence from the frozen
    source model's predictions on the old range (the first ``old_length`` positions, which the
    source reads exactly as it was trained to), so that training the new range keeps the old one."""

    head = "causal"
    # training every weight: far range / in-range 0.93-1.06 across the quality grid from interpolate (tile is
    # far worse); new-rows keeps tile, whose old rows are the source's (interpolate moves them: +23-57%)
    strategy = {"new-rows": "tile", "positions": "tile", "all": "interpolate"}
    # all: 1e-3 with a cosine decay beat 1e-4..5e-4 constant and 3e-4, 5e-4, 2e-3 cosine at 4x (README);
    # measured on models 128-192 wide, so wider ones get 192/width of it (GPT-2 small: 2.5e-4)
    lr = {"new-rows": 3e-3, "positions": 1e-3, "all": 1e-3}
    lr_width = 192
    schedule = {"new-rows": "constant", "positions": "constant", "all": "cosine"}
    anchor = 1.0  # the original range at 4x, lr 1e-3 cosine: up to +6.8% without, +3.9% at 0.3, +2.3% at 1 (README)

    def load(self, directory: Path, *, init_head: bool) -> Loaded:
        result = super().load(directory, init_head=init_head)
        if self.anchor:  # the source model, frozen, before its table is extended
            result.extras["source"] = self.copy_reference(result)
        return result

    def loss(self, run: RunContext, positions: range, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        batch = batch.to(run.accelerator.device)
        out = run.model(input_ids=batch, labels=batch)
        loss, old = out.loss, run.old_length
        if "source" in run.cache and not run.short_inputs_fixed and old < run.length:
            loss = loss + self.anchor * self.source_kl(run, batch[:, :old], out.logits[:, :old])
        return loss, batch.shape[0] * (batch.shape[1] - 1)

    @staticmethod
    def source_kl(run: RunContext, inputs: torch.Tensor, logits: torch.Tensor,
                  keep: torch.Tensor | None = None) -> torch.Tensor:
        """Mean KL divergence of ``logits`` (the model's, for the last ``logits.shape[1]`` tokens of
        ``inputs``) from the frozen source's next-token predictions reading ``inputs`` (at the
        source's own positions), over the positions ``keep`` marks (all)."""
        source = run.cache["source"].to(run.accelerator.device)  # where the model trains (nothing moves once there)
        with torch.no_grad():
            target = source(input_ids=inputs).logits[:, -logits.shape[1]:].float().log_softmax(-1)
        kl = torch.nn.functional.kl_div(logits.float().log_softmax(-1), target, log_target=True, reduction="none").sum(-1)
        return kl.mean() if keep is None else (kl * keep).sum() / keep.sum()


@register_objective("masked", description="BERT masking: 15% of tokens (80% [MASK], 10% random, 10% kept).")
class MaskedLM(_LanguageModel):
    head = "masked"

    def loss(self, run: RunContext, positions: range, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        from posextend.scoring.text import mask_tokens

        pairs = [mask_tokens(row[None], run.tokenizer, run.generator(p)) for row, p in zip(batch, positions)]
        inputs, labels = torch.cat([a for a, _ in pairs]), torch.cat([b for _, b in pairs])
        device = run.accelerator.device
        return run.model(input_ids=inputs.to(device), labels=labels.to(device)).loss, int((labels != -100).sum())


# ------------------------------------------------------------------------------ embedding models

PASSAGE_TOKENS = 32


@register_objective(
    "contrastive",
    description="Embedding models: a passage drawn anywhere in a long document retrieves it (in-batch negatives).",
)
class Contrastive(Objective):
    """Self-supervised from raw text: sample ``p`` is a window of ``length`` tokens (the document).
    Its queries are ``passages`` passages of :data:`PASSAGE_TOKENS` tokens starting at uniformly
    drawn positions (so every position is trained), plus, with ``inserted``, a passage of another
    window written into the document at a random depth: a sentence that stands out from its
    surroundings, which the document's embedding must keep. Each set of queries is scored against
    the batch's documents with sentence-transformers' ``MultipleNegativesRankingLoss`` (the other
    documents of the global batch are negatives), so one costly pass over the long documents
    serves every query. An ``anchor`` keeps short inputs near the frozen source model's
    embeddings (``EmbedDistillLoss``); pooling and normalisation are the checkpoint's own modules."""

    unused_parameters = True  # the transformer's own pooler, when the checkpoint pools otherwise
    # measured (README): 60 steps of 4 x 2048 tokens (7 minutes on 2 CPU cores), lr 5e-5 decayed (cosine) and
    # anchor 2 kept short inputs at cosine 0.963 and read 1024 tokens as well as 40 constant steps at anchor 1
    # (0.927); 40 steps at anchor 2 lost 1024 (needle 0.14)
    steps = 60
    lr = {"new-rows": 1e-3, "positions": 1e-3, "all": 5e-5}
    schedule = {"new-rows": "constant", "positions": "constant", "all": "cosine"}
    anchor = 2.0  # weight of the term that keeps short inputs where the source model put them
    passages: ClassVar[int] = 8  # passages drawn from each document per step
    inserted: ClassVar[bool] = True  # plus one passage of another window, inserted into the document

    def load(self, directory: Path, *, init_head: bool) -> Loaded:
        from sentence_transformers import SentenceTransformer

        if not is_sentence_transformer(directory):
            raise TrainingError(
                f"{directory} is not a sentence-transformers model (no modules.json); the contrastive objective "
                "trains embedding models. Save it with SentenceTransformer.save(), or use the masked objective."
            )
        model = SentenceTransformer(str(directory), device="cpu")
        without_dropout(model[0].auto_model, attention_only=True)
        result = loaded(model, model[0].auto_model, model.tokenizer, self.name, directory)
        old = min(result.usable, result.old_length or result.usable)
        if self.anchor and old < PASSAGE_TOKENS + 2:
            raise TrainingError(
                f"The contrastive anchor compares embeddings of {PASSAGE_TOKENS}-token passages, which {directory}'s "
                f"old length of {old} positions cannot read: set the anchor to 0.")
        if self.anchor:  # the source model, frozen, before its table is extended
            result.extras["source"] = self.copy_reference(result)
        return result

    def samples(self, tokenizer, documents: Sequence[str], length: int) -> torch.Tensor:
        from posextend.scoring.text import pack

        if length < PASSAGE_TOKENS + 4:
            raise DataError(f"Contrastive training needs documents longer than {PASSAGE_TOKENS + 4} tokens.")
        return pack(tokenizer, documents, length - 2)  # [CLS] and [SEP] are added around each window

    def _loss_fn(self, run: RunContext):
        if "mnrl" not in run.cache:
            from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

            run.cache["mnrl"] = MultipleNegativesRankingLoss(run.unwrapped,
                                                             gather_across_devices=run.accelerator.num_processes > 1)
        return run.cache["mnrl"]

    def _queries(self, run: RunContext, batch: torch.Tensor, generators: list[torch.Generator]
                 ) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """The documents (with their inserted passages) and the sets of queries, one query per
        document in each set; every draw comes from the document's own generator."""
        span = batch.shape[1] - PASSAGE_TOKENS
        documents, sets = batch.clone(), []
        if self.inserted:
            pool, inserted = run.train_seqs, []
            for document, g in zip(documents, generators):
                other = pool[int(torch.randint(len(pool), (1,), generator=g))]
                start = int(torch.randint(other.shape[0] - PASSAGE_TOKENS + 1, (1,), generator=g))
                at = int(torch.randint(span + 1, (1,), generator=g))
                document[at : at + PASSAGE_TOKENS] = other[start : start + PASSAGE_TOKENS]
                inserted.append(other[start : start + PASSAGE_TOKENS])
            sets.append(inserted)
        for _ in range(self.passages):
            starts = [int(torch.randint(span + 1, (1,), generator=g)) for g in generators]
            sets.append([document[s : s + PASSAGE_TOKENS] for document, s in zip(documents, starts)])
        return documents, sets

    def loss(self, run: RunContext, positions: range, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The ranking loss of each set of queries against the documents (averaged over the sets),
        plus ``anchor`` × the cosine distance between the model's and the source model's embeddings
        of short inputs: the first set's queries, and each document's head, cut at a width drawn
        log-uniformly between a passage and the old length."""
        generators = [run.generator(p) for p in positions]
        device = run.accelerator.device
        documents, sets = self._queries(run, batch, generators)
        d = run.model(_features(list(documents), run.tokenizer, device))["sentence_embedding"]
        queries = [_features(rows, run.tokenizer, device) for rows in sets]
        embedded = [run.model(q)["sentence_embedding"] for q in queries]
        loss = sum(self._loss_fn(run).compute_loss_from_embeddings([q, d], None) for q in embedded) / len(embedded)
        source = run.cache.get("source")
        if source is not None and not run.short_inputs_fixed:
            widest = min(run.old_length, run.length) - 2
            widths = [round(math.exp(math.log(PASSAGE_TOKENS) + float(torch.rand((), generator=g))
                                     * math.log(widest / PASSAGE_TOKENS))) for g in generators]
            heads = _features([row[:w] for row, w in zip(batch, widths)], run.tokenizer, device)
            source.to(device)  # where the model trains (nothing moves once there)
            with torch.no_grad():
                targets = [source(heads)["sentence_embedding"], source(queries[0])["sentence_embedding"]]
            distance = self._distill_fn(run).compute_loss_from_embeddings(
                [run.model(heads)["sentence_embedding"], embedded[0]], targets)
            loss = loss + self.anchor * distance
        return loss, batch.shape[0]

    def _distill_fn(self, run: RunContext):
        if "distill" not in run.cache:
            from sentence_transformers.sentence_transformer.losses import EmbedDistillLoss

            run.cache["distill"] = EmbedDistillLoss(run.unwrapped, distance_metric="cosine")
        return run.cache["distill"]

    @torch.no_grad()
    def evaluate(self, run: RunContext) -> EvalReport:
        """Retrieval of every held-out document by passages taken from each position bucket:
        accuracy@1 and the ranking loss per bucket (``perplexity`` holds exp(loss))."""
        was_training = run.model.training
        run.model.eval()
        docs = run.eval_seqs
        span = docs.shape[1] - PASSAGE_TOKENS
        edges = bucket_edges(docs.shape[1] + 2, run.config.buckets,
                             old_length=run.old_length if run.old_length < run.length else None)
        device = run.accelerator.device
        d = torch.cat([run.model(_features(list(docs[i : i + run.config.batch_size]), run.tokenizer, device))
                       ["sentence_embedding"] for i in range(0, len(docs), run.config.batch_size)])
        d = torch.nn.functional.normalize(d, dim=1)
        buckets, losses, hits = [], [], []
        for lo, hi in zip(edges[:-1], edges[1:]):
            start = min(max(0, (lo + hi) // 2 - 1 - PASSAGE_TOKENS // 2), span)  # a passage centred in the bucket
            q = run.model(_features([row[start : start + PASSAGE_TOKENS] for row in docs], run.tokenizer,
                                         device))["sentence_embedding"]
            scores = 20.0 * torch.nn.functional.normalize(q, dim=1) @ d.T  # MNRL's scale
            target = torch.arange(len(docs), device=scores.device)
            loss = float(torch.nn.functional.cross_entropy(scores, target))
            hit = float((scores.argmax(1) == target).float().mean())
            buckets.append(Bucket(lo, hi, loss, math.exp(min(loss, 50)), len(docs), accuracy=hit))
            losses.append(loss)
            hits.append(hit)
        run.model.train(was_training)
        loss = sum(losses) / len(losses)
        return EvalReport("contrastive", docs.shape[1] + 2, len(docs), loss, math.exp(min(loss, 50)),
                          len(docs) * len(buckets), buckets, run.old_length if run.old_length < run.length else None,
                          accuracy=sum(hits) / len(hits), metric="retrieval accuracy@1")
