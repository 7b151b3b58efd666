"""Long-document retrieval for embedding models, in LongEmbed's style (arXiv 2404.12096).

From any text corpus, :func:`make_task` builds ``n`` documents of exactly ``length`` tokens:
spans of the corpus, each with one key sentence inserted at a random depth (``passkey``: "The
pass key for Ada is 48151. Remember it."; ``needle``: "The best thing to do in Lyon is to
watch the boats."). Query ``i`` asks for document ``i``'s key; the score is accuracy@1 over
all ``n`` documents of that length. Documents are token ids, so their length is exact.

A model reads a document as a user's code would: ``full`` (up to its ``max_seq_length``,
truncated past it), or ``chunk`` (the usual workaround: embed each ``max_seq_length`` chunk
and average). :func:`short_input_cosine` compares two models on texts within the old length.

Example::

    >>> report = evaluate_retrieval("minilm-2k", ["held_out.txt"], lengths=(512, 2048))
    >>> report.scores["passkey"][2048]
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from .errors import DataError, PosExtendError

Mode = Literal["full", "chunk"]
_NAMES = ("Ada", "Basil", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kira", "Lars",
          "Mina", "Nils", "Olga", "Pavel", "Quinn", "Rosa", "Stefan", "Tara", "Umar", "Vera", "Wim", "Xenia", "Yusuf",
          "Zora")
_PLACES = ("Lyon", "Porto", "Bergen", "Krakow", "Sevilla", "Gdansk", "Ghent", "Trieste", "Tallinn", "Bologna", "Dundee",
           "Utrecht", "Malmo", "Salzburg", "Lucerne", "Aarhus", "Cork", "Bilbao", "Turku", "Graz", "Lille", "Brno",
           "Split", "Nantes", "Riga", "Basel")
_ACTIVITIES = ("watch the boats on the river", "eat warm bread at the market", "climb the old tower at dawn",
               "read in the public garden", "listen to the bells at noon", "walk along the harbour wall",
               "ride the tram to the last stop", "buy figs from the corner stall", "swim in the cold lake",
               "sketch the cathedral doors")
TASKS = ("passkey", "needle")


def _key(task: str, i: int, rng: random.Random) -> tuple[str, str]:
    """(sentence hidden in document ``i``, the query that asks for it)."""
    name = f"{_NAMES[i % len(_NAMES)]} {_NAMES[(i // len(_NAMES) + 7 * i) % len(_NAMES)]}son"
    if task == "passkey":
        number = rng.randrange(10_000, 100_000)
        return f" The pass key for {name} is {number}. Remember it. {number} is the pass key for {name}. ", \
            f"What is the pass key for {name}?"
    if task == "needle":
        place = f"{_PLACES[i % len(_PLACES)]} {i // len(_PLACES) + 1}" if i >= len(_PLACES) else _PLACES[i]
        activity = _ACTIVITIES[rng.randrange(len(_ACTIVITIES))]
        return f" The best thing to do in {place} is to {activity}. ", f"What is the best thing to do in {place}?"
    raise PosExtendError(f"Unknown retrieval task {task!r}; tasks: {', '.join(TASKS)}.")


@dataclass(frozen=True)
class Task:
    name: str
    length: int
    documents: list[list[int]]  # token ids without special tokens, each exactly length - 2 long
    queries: list[str]
    depths: list[float]  # where each key sits, as a fraction of its document


def make_task(tokenizer, corpus_ids: Sequence[int], task: str, length: int, *, n: int = 50, seed: int = 0) -> Task:
    """``n`` documents of ``length`` tokens (with [CLS] and [SEP]), one key each, from ``corpus_ids``."""
    rng = random.Random(f"{task}-{length}-{seed}")
    content = length - 2
    if content < 16:
        raise DataError(f"A retrieval document needs at least 18 tokens, got a length of {length}.")
    if len(corpus_ids) < content + 1:
        raise DataError(f"The corpus has {len(corpus_ids)} tokens, fewer than one document of {length}: give more text.")
    documents, queries, depths = [], [], []
    for i in range(n):
        sentence, query = _key(task, i, rng)
        key = tokenizer(sentence, add_special_tokens=False)["input_ids"]
        if len(key) >= content:
            raise DataError(f"A document of {length} tokens cannot hold its {len(key)}-token key sentence.")
        filler_len = content - len(key)
        start = rng.randrange(0, len(corpus_ids) - filler_len)
        filler = list(corpus_ids[start : start + filler_len])
        at = rng.randrange(0, filler_len + 1)
        documents.append(filler[:at] + key + filler[at:])
        queries.append(query)
        depths.append(at / max(filler_len, 1))
    return Task(task, length, documents, queries, depths)


def _embed_ids(model, documents: list[list[int]], max_tokens: int, mode: Mode, batch_size: int = 4):
    """Unit embeddings of token-id documents read as ``mode`` says, through the model's own modules."""
    import torch

    tok = model.tokenizer
    cls, sep = tok.cls_token_id, tok.sep_token_id
    if cls is None or sep is None:
        cls, sep = tok.bos_token_id, tok.eos_token_id
    window = max_tokens - 2

    def pieces(doc: list[int]) -> list[list[int]]:
        if mode == "full" or len(doc) <= window:
            return [doc[:window]]
        return [doc[i : i + window] for i in range(0, len(doc), window)]

    out = []
    with torch.no_grad():
        for doc in documents:
            chunks = [[cls, *p, sep] for p in pieces(doc)]
            vectors = []
            for b in range(0, len(chunks), batch_size):
                group = chunks[b : b + batch_size]
                width = max(map(len, group))
                ids = torch.full((len(group), width), tok.pad_token_id or 0, dtype=torch.long)
                mask = torch.zeros_like(ids)
                for r, c in enumerate(group):
                    ids[r, : len(c)] = torch.tensor(c)
                    mask[r, : len(c)] = 1
                vectors.append(model({"input_ids": ids, "attention_mask": mask})["sentence_embedding"])
            mean = torch.cat(vectors).mean(0)  # chunk-and-average: the mean of the chunks' embeddings
            out.append(torch.nn.functional.normalize(mean, dim=0))
    return torch.stack(out)


def hits(model, task: Task, *, mode: Mode = "full", max_tokens: int | None = None) -> list[bool]:
    """For each query, whether its most similar document (cosine) is its own."""
    import torch

    max_tokens = max_tokens or model.max_seq_length
    docs = _embed_ids(model, task.documents, max_tokens, mode)
    queries = torch.nn.functional.normalize(model.encode(task.queries, convert_to_tensor=True), dim=1)
    best = (queries @ docs.T).argmax(dim=1)
    return (best == torch.arange(len(task.queries))).tolist()


def by_depth(task: Task, found: Sequence[bool], parts: int = 4) -> list[float | None]:
    """Accuracy of the queries whose key sits in each ``1 / parts`` of the document's depth (None: no key there)."""
    groups: list[list[bool]] = [[] for _ in range(parts)]
    for depth, hit in zip(task.depths, found):
        groups[min(int(depth * parts), parts - 1)].append(hit)
    return [sum(g) / len(g) if g else None for g in groups]


def short_input_cosine(model_a, model_b, texts: Sequence[str]) -> float:
    """Mean cosine between two models' embeddings of the same texts (each within both models' length)."""

    a = model_a.encode(list(texts), convert_to_tensor=True, normalize_embeddings=True)
    b = model_b.encode(list(texts), convert_to_tensor=True, normalize_embeddings=True)
    return float((a * b).sum(1).mean())


@dataclass
class RetrievalReport:
    model: str
    mode: str
    max_seq_length: int
    documents: int
    scores: dict[str, dict[int, float]] = field(default_factory=dict)  # task -> length -> accuracy@1
    # task -> length -> accuracy@1 of the keys in each quarter of the document's depth (None: no key there)
    depth: dict[str, dict[int, list[float | None]]] = field(default_factory=dict)
    short_input_cosine: float | None = None  # against the reference model, when given

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_embedding_model(path: str | Path):
    """A sentence-transformers model from a local folder (a plain transformers checkpoint gets mean pooling)."""
    from sentence_transformers import SentenceTransformer

    from .checkpoint import resolve_source

    return SentenceTransformer(str(resolve_source(path)), device="cpu")


def corpus_tokens(tokenizer, data: Sequence[str | Path]) -> list[int]:
    from .data import read_documents

    ids: list[int] = []
    for doc in read_documents(data):
        ids += tokenizer(doc, add_special_tokens=False, verbose=False)["input_ids"]
    return ids


def evaluate_retrieval(
    model_path: str | Path,
    data: Sequence[str | Path],
    *,
    tasks: Sequence[str] = TASKS,
    lengths: Sequence[int] = (256, 512, 1024, 2048),
    n: int = 50,
    mode: Mode = "full",
    max_tokens: int | None = None,
    reference: str | Path | None = None,
    seed: int = 0,
) -> RetrievalReport:
    """Passkey / needle accuracy@1 per document length (and per quarter of the key's depth); with
    ``reference``, the short-input cosine between ``reference`` (e.g. the original model) and this
    one on texts of 64–512 tokens.

    ``mode="full"`` reads each document up to ``max_tokens`` (default: the model's
    ``max_seq_length``); ``"chunk"`` embeds every ``max_tokens`` chunk and averages (the usual
    workaround for long documents).
    """
    model = load_embedding_model(model_path)
    if max_tokens is not None:
        model.max_seq_length = max_tokens
    ids = corpus_tokens(model.tokenizer, data)
    report = RetrievalReport(str(model_path), mode, model.max_seq_length, n)
    for task in tasks:
        report.scores[task], report.depth[task] = {}, {}
        for length in lengths:
            built = make_task(model.tokenizer, ids, task, length, n=n, seed=seed)
            found = hits(model, built, mode=mode)
            report.scores[task][length] = sum(found) / len(found)
            report.depth[task][length] = by_depth(built, found)
    if reference is not None:
        other = load_embedding_model(reference)
        rng = random.Random(seed)
        limit = min(other.max_seq_length, model.max_seq_length, 512) - 2
        texts = []
        for size in (64, 128, 256, limit):
            for _ in range(8):
                start = rng.randrange(0, max(1, len(ids) - size))
                texts.append(model.tokenizer.decode(ids[start : start + min(size, limit) - 16]))
        report.short_input_cosine = short_input_cosine(other, model, texts)
    return report
