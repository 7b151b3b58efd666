"""The ``contrastive`` objective: embedding models (sentence-transformers folders) learn to read long documents.

A short passage drawn anywhere in a long document must retrieve that document among the batch's
(sentence-transformers' ``MultipleNegativesRankingLoss``); an anchor keeps short inputs where the source
model put them (``EmbedDistillLoss``). Whether the extension is worth it is read on LongEmbed-style passkey
and needle tasks built from the held-out documents: the model reading each document whole against the
source reading it in chunks of its own length, embeddings averaged (what users do without the extension).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from posextend.errors import DataError, TrainingError
from posextend.files.checkpoint import Checkpoint
from posextend.scoring.by_position import Bucket, EvalReport, bucket_edges, evaluating
from posextend.scoring.text import framed
from posextend.scoring.verdict import Reading
from posextend.training.context import RunContext
from posextend.training.loading import Loaded, attention_kwargs, make_loaded
from posextend.training.objectives.base import CheckpointFacts, Objective, register_objective, without_dropout

PASSAGE_TOKENS = 32


def _features(rows, tokenizer, device) -> dict[str, torch.Tensor]:
    """:func:`posextend.scoring.text.framed` on ``device``."""
    return {k: v.to(device) for k, v in framed(rows, tokenizer).items()}


@dataclass
class Losses:
    """The run's sentence-transformers loss modules, made on first use (they hold the trained model), and
    the verdict's retrieval tasks, built once."""

    ranking: Any = None  # MultipleNegativesRankingLoss
    distill: Any = None  # EmbedDistillLoss, for the anchor
    tasks: Any = None  # (tasks at the run's length, the same at the old length): Contrastive._tasks


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

    head = "sentence-transformers"
    metric = "retrieval accuracy@1"
    priority = 40  # a sentence-transformers folder is an embedding model, whatever its transformer's head
    State = Losses
    unused_parameters = True  # the transformer's own pooler, when the checkpoint pools otherwise
    # measured (README): 60 steps of 4 x 2048 tokens (7 minutes on 2 CPU cores), lr 5e-5 decayed (cosine) and
    # anchor 2 kept short inputs at cosine 0.963 and read 1024 tokens as well as 40 constant steps at anchor 1
    # (0.927); 40 steps at anchor 2 lost 1024 (needle 0.14)
    steps = 60
    lr = {"new-rows": 1e-3, "positions": 1e-3, "all": 5e-5, "lora": 5e-4}
    schedule = {"new-rows": "constant", "positions": "constant", "all": "cosine", "lora": "cosine"}
    anchor = 2.0  # weight of the term that keeps short inputs where the source model put them
    passages = 8  # passages drawn from each document per step
    inserted = True  # plus one passage of another window, inserted into the document

    def accepts(self, checkpoint: CheckpointFacts) -> bool:
        """A sentence-transformers folder."""
        return checkpoint.sentence_transformer

    def load_model(self, directory: Path, *, init_head: bool) -> Loaded:
        """The sentence-transformers model (its pooling and normalisation modules included), attention dropout off,
        with PyTorch's fused attention where its transformer has it (:func:`~posextend.training.loading.attention_kwargs`)."""
        checkpoint = Checkpoint.of(directory)
        if not checkpoint.sentence_transformers:
            raise TrainingError(
                f"{directory} is not a sentence-transformers model (no modules.json); the contrastive objective "
                "trains embedding models. Save it with SentenceTransformer.save(), or use the masked objective."
            )
        import transformers
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(str(directory), device="cpu",
                                    model_kwargs=attention_kwargs(transformers.AutoModel, checkpoint.config))
        without_dropout(model[0].auto_model, attention_only=True)
        return make_loaded(model, model[0].auto_model, model.tokenizer, self.name, directory)

    def check(self, result: Loaded, directory: Path) -> None:
        """The anchor compares embeddings of passages: the old length must hold one."""
        old = min(result.usable, result.old_length or result.usable)
        if self.anchor and old < PASSAGE_TOKENS + 2:
            raise TrainingError(
                f"The contrastive anchor compares embeddings of {PASSAGE_TOKENS}-token passages, which {directory}'s "
                f"old length of {old} positions cannot read: set the anchor to 0.")

    def samples(self, tokenizer, documents: Sequence[str], length: int) -> torch.Tensor:
        from posextend.scoring.text import pack

        if length < PASSAGE_TOKENS + 4:
            raise DataError(f"Contrastive training needs documents longer than {PASSAGE_TOKENS + 4} tokens.")
        return pack(tokenizer, documents, length - 2)  # [CLS] and [SEP] are added around each window

    def _loss_fn(self, run: RunContext):
        state: Losses = run.state
        if state.ranking is None:
            from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

            state.ranking = MultipleNegativesRankingLoss(run.unwrapped, gather_across_devices=run.accelerator.num_processes > 1)
        return state.ranking

    def _distill_fn(self, run: RunContext):
        state: Losses = run.state
        if state.distill is None:
            from sentence_transformers.sentence_transformer.losses import EmbedDistillLoss

            state.distill = EmbedDistillLoss(run.unwrapped, distance_metric="cosine")
        return state.distill

    def _queries(self, run: RunContext, batch: torch.Tensor, generators: list[torch.Generator]
                 ) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """The documents (with their inserted passages) and the sets of queries, one query per
        document in each set; every draw comes from the document's own generator."""
        span = batch.shape[1] - PASSAGE_TOKENS
        documents, sets = batch.clone(), []
        if self.inserted:
            pool, inserted = run.train_samples, []
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
        reference = run.reference
        if reference is not None and not run.short_inputs_fixed:
            widest = min(run.sizes.length.old, run.sizes.length.new) - 2
            widths = [round(math.exp(math.log(PASSAGE_TOKENS) + float(torch.rand((), generator=g))
                                     * math.log(widest / PASSAGE_TOKENS))) for g in generators]
            heads = _features([row[:w] for row, w in zip(batch, widths)], run.tokenizer, device)
            reference.to(device)  # where the model trains (nothing moves once there)
            with torch.no_grad():
                targets = [reference(heads)["sentence_embedding"], reference(queries[0])["sentence_embedding"]]
            distance = self._distill_fn(run).compute_loss_from_embeddings(
                [run.model(heads)["sentence_embedding"], embedded[0]], targets)
            loss = loss + self.anchor * distance
        return loss, batch.shape[0]

    @torch.no_grad()
    def evaluate(self, run: RunContext) -> EvalReport:
        """Retrieval of every held-out document by passages taken from each position bucket:
        accuracy@1 and the ranking loss per bucket (``perplexity`` holds exp(loss))."""
        with evaluating(run.model):
            docs = run.eval_samples
            span = docs.shape[1] - PASSAGE_TOKENS
            edges = bucket_edges(docs.shape[1] + 2, run.config.buckets, old_length=run.sizes.length.new_from)
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
        loss = sum(losses) / len(losses)
        return EvalReport("contrastive", docs.shape[1] + 2, len(docs), loss, math.exp(min(loss, 50)),
                          len(docs) * len(buckets), buckets, run.sizes.length.new_from,
                          accuracy=sum(hits) / len(hits), metric=self.metric, noun="documents", unit="passages")

    def baseline(self, run: RunContext, unextended: torch.nn.Module) -> Reading | None:
        """Chunk-and-average: ``unextended`` (the model at its own length) reading each held-out task document in
        chunks of ``run.sizes.length.old`` tokens, their embeddings averaged; the original range, the same tasks at
        the old length, read whole (:meth:`_read`)."""
        return self._read(run, unextended.to(run.accelerator.device), chunk=True)

    def baseline_name(self, run: RunContext) -> str:
        return f"the source reading {run.sizes.length.old}-token chunks, averaged"

    def control_name(self, run: RunContext) -> str:
        return f"the same model reading {run.sizes.length.old}-token chunks, averaged"

    def reading(self, run: RunContext) -> Reading | None:
        """The model being trained reading the same documents whole (:meth:`_read`)."""
        return self._read(run, run.model, chunk=False)

    @torch.no_grad()
    def _read(self, run: RunContext, model: torch.nn.Module, *, chunk: bool) -> Reading | None:
        """Accuracy@1 of passkey and needle retrieval (:mod:`posextend.scoring.retrieval`, both protocols) over
        the tasks of :meth:`_tasks`: ``far`` on documents of the run's length (read in chunks of the old
        length with ``chunk``, else whole), ``original`` on the same tasks at the old length (read whole);
        ``parts``: the far range task by task (``"varied needle"``), none of which may be worse than
        chunk-and-average's for the run to be worth it. None when the run does not extend or the held-out text
        holds no task."""
        from posextend.scoring.retrieval import accuracy

        old, length = run.sizes.length.old, run.sizes.length.new
        if old >= length:
            return None
        far_tasks, original_tasks = self._tasks(run)
        if not far_tasks:
            return None
        read = dict(tokenizer=run.tokenizer, device=run.accelerator.device)
        with evaluating(model):
            named = {f"{t.haystack} {t.name}": t for t in far_tasks}
            parts = {k: accuracy(model, [t], mode="chunk" if chunk else "full",
                                 max_tokens=old if chunk else length, **read) for k, t in named.items()}
            original = accuracy(model, original_tasks, mode="full", max_tokens=old, **read)
        names = "/".join(dict.fromkeys(t.name for t in far_tasks))
        queries = sum(len(t.queries) for t in far_tasks)
        far = sum(parts[k] * len(t.queries) for k, t in named.items()) / queries  # every query's hit, averaged
        return Reading(far=far, original=original, metric=f"{names} accuracy@1", higher=True, parts=parts)

    def _tasks(self, run: RunContext) -> tuple[list, list]:
        """The verdict's passkey and needle tasks (shared and varied haystacks), ``eval_sequences`` documents each,
        at the run's length and at the old one, built once per run (``run.state.tasks``) from the held-out
        documents (or, when the run names none, the held-out samples' tokens), seeded by the run's seed."""
        from posextend.scoring.retrieval import task_pairs, text_tokens

        state: Losses = run.state
        if state.tasks is None:
            n = run.config.eval_sequences
            enough = 4 * n * run.sizes.length.new  # spans for every varied document, and to spare
            ids = (text_tokens(run.tokenizer, run.eval_documents, limit=enough) if run.eval_documents
                   else run.eval_samples.flatten().tolist())
            state.tasks = tuple(task_pairs(run.tokenizer, ids, (run.sizes.length.new, run.sizes.length.old),
                                           n=n, seed=run.config.seed))
        return state.tasks
