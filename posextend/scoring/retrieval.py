"""Long-document retrieval for embedding models, in LongEmbed's style (arXiv 2404.12096).

:func:`make_task` builds ``n`` documents of exactly ``length`` tokens, each with one key sentence
(``passkey``: "Joyce Jenkins's pass key is 48151. Remember it. 48151 is the pass key for Joyce Jenkins.",
asked as "what is the passkey for Joyce Jenkins?", LongEmbed's wording; ``needle``: "The best thing to
do in Lyon is to watch the boats."). Query ``i`` asks for document ``i``'s key; the score is
accuracy@1 over all ``n`` documents of that length. As in LongEmbed, up to 50 keys name 50 people and
50 places, no two sharing a word, so a query names one document's key and no other's. Documents are
token ids, so their length is exact.

Three protocols (``haystack``):

* ``"shared"`` (LongEmbed's): every document of a length is the same haystack with its own key
  in it, so documents differ only in the key and where it sits. The passkey haystack is
  LongEmbed's filler (:data:`PASSKEY_FILLER` repeated); the needle haystack is one span of the
  given corpus. Keys sit at depths spread evenly from the start (0) to the end (1).
* ``"varied"``: every document is its own span of the corpus, the key at a random depth (the
  passkey worded "The pass key for Joyce Jenkins is 48151. …", as this package's first protocol). Harder
  to read across papers (documents also differ in their text), easier for a model that only
  matches topics.
* ``"reworded"``: the varied protocol with keys and queries worded otherwise ("Keep this in mind: the
  secret code of Joyce Jenkins reads 48151 …", asked "Which secret code belongs to Joyce Jenkins?"; needles
  of other activities), kept aside: no default was chosen on it, and a fine-tune's verdict never reads it
  (:data:`VERDICT_HAYSTACKS`), so it shows whether a gain carries to wording nobody tuned on.

A model reads a document as a user's code would: ``full`` (up to its ``max_seq_length``,
truncated past it), or ``chunk`` (the usual workaround: embed each ``max_seq_length`` chunk
and average). :func:`short_input_cosine` compares two models on texts within the old length.

Examples:
    >>> report = evaluate_retrieval("minilm-2k", ["held_out.txt"], lengths=(512, 2048))
    >>> report.scores["passkey"][2048]
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from posextend.errors import DataError, PosExtendError

Mode = Literal["full", "chunk"]
Haystack = Literal["shared", "varied"]
#: The protocols, each with the line that names it in reports (the CLI's table, the benchmark's).
HAYSTACKS = {
    "shared": "shared haystack (LongEmbed's protocol)",  # one haystack per length, keys at evenly spread depths
    "varied": "varied haystack (each document its own span)",  # the key at a random depth
    "reworded": "varied haystack, reworded keys (kept aside)",  # as varied, in a wording no default was chosen on
}
#: The protocols a fine-tune's verdict reads (``reworded`` is kept aside: nothing is chosen on it).
VERDICT_HAYSTACKS = ("shared", "varied")
#: LongEmbed's passkey haystack: this text, repeated to the document's length.
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
_ACTIVITIES = ("watch the boats on the river", "eat warm bread at the market", "climb the old tower at dawn",
               "read in the public garden", "listen to the bells at noon", "walk along the harbour wall",
               "ride the tram to the last stop", "buy figs from the corner stall", "swim in the cold lake",
               "sketch the cathedral doors")
_ACTIVITIES_ASIDE = ("taste the smoked fish by the docks", "hear the choir in the round church",
                     "cross the stone bridge at night", "visit the clockmakers' street", "row across the bay",
                     "see the lanterns in the old square", "try the honey cake at the bakery",
                     "follow the canal to the mill", "watch the glassblowers at work", "climb to the lighthouse")
# 50 keys a length, as in LongEmbed, each a different person or place: no two share a word (:func:`_subject`)
_FIRST = ("Joyce", "Nathan", "Scarlett", "Esmeralda", "Avery", "Malcolm", "Felicity", "Madelyn", "Brittany", "Archer",
          "Bryson", "Stella", "Cohen", "Maverick", "Beatrice", "Desmond", "Harriet", "Ignatius", "Josephine", "Leopold",
          "Marigold", "Octavia", "Percival", "Rosalind", "Sebastian", "Theodora", "Ulysses", "Violet", "Winston",
          "Yolanda", "Zachary", "Agatha", "Bernard", "Cordelia", "Dorian", "Eleanor", "Fitzgerald", "Gwendolyn",
          "Horatio", "Imogen", "Jasper", "Katarina", "Lysander", "Millicent", "Nigel", "Ophelia", "Quentin",
          "Reginald", "Sylvia", "Tobias")
_LAST = ("Jenkins", "Munoz", "Kirk", "Kelly", "Hicks", "Kent", "Stephens", "Garner", "Hart", "Peralta", "Jackson",
         "Coffey", "Figueroa", "Davidson", "Lambert", "Bradshaw", "Garcia", "Whitaker", "Thornton", "Ramsey",
         "Holloway", "Pemberton", "Castillo", "Donovan", "Ellison", "Fairbanks", "Gallagher", "Hawthorne", "Ingram",
         "Jorgensen", "Kowalski", "Lindqvist", "Montgomery", "Nakamura", "Okafor", "Pritchard", "Quintero",
         "Rutherford", "Sandoval", "Takahashi", "Underwood", "Vasquez", "Wainwright", "Xiong", "Yamamoto", "Zimmerman",
         "Abernathy", "Blackwood", "Carmichael", "Delacroix")
_CITIES = ("Lyon", "Porto", "Bergen", "Krakow", "Sevilla", "Gdansk", "Ghent", "Trieste", "Tallinn", "Bologna",
           "Dundee", "Utrecht", "Malmo", "Salzburg", "Lucerne", "Aarhus", "Cork", "Bilbao", "Turku", "Graz", "Lille",
           "Brno", "Split", "Nantes", "Riga", "Basel", "Oslo", "Lisbon", "Vienna", "Prague", "Dublin", "Zagreb",
           "Helsinki", "Warsaw", "Budapest", "Geneva", "Antwerp", "Marseille", "Naples", "Bruges", "Edinburgh",
           "Copenhagen", "Stockholm", "Ljubljana", "Vilnius", "Sofia", "Bucharest", "Athens", "Valencia", "Hamburg")
TASKS = ("passkey", "needle")


def _subject(i: int) -> tuple[str, str]:
    """Key ``i``'s person and place: 50 people and 50 places, no two of them sharing a word (LongEmbed's rule:
    a query names its own key's subject and no other key's); from the 51st key on, a number is added
    ("Lyon 2"), and a query that names "Lyon" names that key too."""
    name = f"{_FIRST[i % len(_FIRST)]} {_LAST[(i + i // len(_LAST)) % len(_LAST)]}"
    place = _CITIES[i % len(_CITIES)] + (f" {i // len(_CITIES) + 1}" if i >= len(_CITIES) else "")
    return name, place


def _key(task: str, i: int, rng: random.Random, haystack: Haystack = "varied") -> tuple[str, str]:
    """(sentence hidden in document ``i``, the query that asks for it) about :func:`_subject` ``i``; ``shared``
    in LongEmbed's passkey wording."""
    name, place = _subject(i)
    if task == "passkey":
        number = rng.randrange(10_000, 100_000)
        if haystack == "shared":
            return f"\n{name}'s pass key is {number}. Remember it. {number} is the pass key for {name}.\n", \
                f"what is the passkey for {name}?"
        if haystack == "reworded":
            return f" Keep this in mind: the secret code of {name} reads {number}. Once more, {name} has the code " \
                f"{number}. ", f"Which secret code belongs to {name}?"
        return f" The pass key for {name} is {number}. Remember it. {number} is the pass key for {name}. ", \
            f"What is the pass key for {name}?"
    if task == "needle":
        if haystack == "reworded":
            activity = _ACTIVITIES_ASIDE[rng.randrange(len(_ACTIVITIES_ASIDE))]
            return f" People say that in {place} you must {activity} before you leave. ", \
                f"Which thing must you do before leaving {place}?"
        activity = _ACTIVITIES[rng.randrange(len(_ACTIVITIES))]
        return f" The best thing to do in {place} is to {activity}. ", f"What is the best thing to do in {place}?"
    raise PosExtendError(f"Unknown retrieval task {task!r}; tasks: {', '.join(TASKS)}.")


@dataclass(frozen=True)
class Task:
    name: str
    length: int
    documents: list[list[int]]  # token ids without special tokens, each exactly length - 2 long
    queries: list[str]
    depths: list[float]  # where each key sits, as a fraction of its document (0: first token, 1: last)
    haystack: str = "varied"  # the protocol: "shared" (LongEmbed's) or "varied"
    keys: list[list[int]] = field(default_factory=list)  # each document's key sentence, token ids


def passkey_haystack(tokenizer, size: int) -> list[int]:
    """The first ``size`` token ids of :data:`PASSKEY_FILLER` repeated (tokenized as one text)."""
    unit = len(tokenizer(PASSKEY_FILLER, add_special_tokens=False)["input_ids"])
    text = " ".join([PASSKEY_FILLER] * (size // max(unit, 1) + 2))
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"][:size]


def even_depths(n: int) -> list[float]:
    """``n`` depths spread evenly over a document, first token to last (one key: the middle)."""
    return [i / (n - 1) for i in range(n)] if n > 1 else [0.5]


def make_task(tokenizer, corpus_ids: Sequence[int], task: str, length: int, *, n: int = 50, seed: int = 0,
              haystack: Haystack = "shared") -> Task:
    """``n`` documents of ``length`` tokens (with [CLS] and [SEP]), one key each.

    Args:
        tokenizer: the model's tokenizer.
        corpus_ids: token ids of held-out text (the needle haystack; with ``haystack="varied"``,
            every task's).
        task: ``"passkey"`` or ``"needle"``.
        length: tokens per document, special tokens included.
        n: documents (and queries).
        seed: makes the keys, the haystack span and the depths reproducible.
        haystack: ``"shared"`` (LongEmbed's protocol: one haystack for every document of this
            length, passkey in :data:`PASSKEY_FILLER`, keys at evenly spread depths) or
            ``"varied"`` (each document its own span of the corpus, the key at a random depth), or ``"reworded"``
            (as varied, keys and queries in the wording kept aside).

    Returns:
        A :class:`Task`; ``depths[i]`` is where document ``i``'s key starts, as a fraction of the
        haystack around it (shared: the evenly spread depth it was placed at, its first token at
        ``round(depth * (length - 2 - len(keys[i])))``).
    """
    if haystack not in HAYSTACKS:
        raise PosExtendError(f"Unknown haystack protocol {haystack!r}; choose one of: {', '.join(HAYSTACKS)}.")
    rng = random.Random(f"{task}-{length}-{seed}")
    content = length - 2
    if content < 16:
        raise DataError(f"A retrieval document needs at least 18 tokens, got a length of {length}.")
    corpus_needed = not (haystack == "shared" and task == "passkey")
    if corpus_needed and len(corpus_ids) < content + 1:
        raise DataError(f"The corpus has {len(corpus_ids)} tokens, fewer than one document of {length}: give more text.")
    if haystack == "shared":
        return _shared_task(tokenizer, corpus_ids, task, length, n, rng)
    documents, queries, depths, keys = [], [], [], []
    for i in range(n):
        sentence, query = _key(task, i, rng, haystack)
        key = tokenizer(sentence, add_special_tokens=False)["input_ids"]
        keys.append(key)
        if len(key) >= content:
            raise DataError(f"A document of {length} tokens cannot hold its {len(key)}-token key sentence.")
        filler_len = content - len(key)
        start = rng.randrange(0, len(corpus_ids) - filler_len)
        filler = list(corpus_ids[start : start + filler_len])
        at = rng.randrange(0, filler_len + 1)
        documents.append(filler[:at] + key + filler[at:])
        queries.append(query)
        depths.append(at / max(filler_len, 1))
    return Task(task, length, documents, queries, depths, haystack, keys)


def _shared_task(tokenizer, corpus_ids: Sequence[int], task: str, length: int, n: int, rng: random.Random) -> Task:
    """LongEmbed's protocol: one haystack per length, each document = the haystack with its key at an even depth."""
    content = length - 2
    keys, queries = [], []
    for i in range(n):
        sentence, query = _key(task, i, rng, "shared")
        keys.append(tokenizer(sentence, add_special_tokens=False)["input_ids"])
        queries.append(query)
        if len(keys[-1]) >= content:
            raise DataError(f"A document of {length} tokens cannot hold its {len(keys[-1])}-token key sentence.")
    if task == "passkey":
        hay = passkey_haystack(tokenizer, content)
    else:
        start = rng.randrange(0, len(corpus_ids) - content + 1)
        hay = list(corpus_ids[start : start + content])
    spread = even_depths(n)
    rng.shuffle(spread)  # which key sits where: not tied to the order of the names
    documents, depths = [], []
    for key, depth in zip(keys, spread):
        filler_len = content - len(key)  # the haystack's first tokens, so every document has exactly `content`
        at = round(depth * filler_len)  # the nearest token to the depth (reported as placed, so quarters are exact)
        documents.append(hay[:at] + key + hay[at:filler_len])
        depths.append(depth)
    return Task(task, length, documents, queries, depths, "shared", keys)


def _embed_ids(model, documents: Sequence[Sequence[int]], max_tokens: int, mode: Mode, batch_size: int = 4, *,
               tokenizer=None, device=None):
    """Unit embeddings of token-id documents read as ``mode`` says, through the model's own modules.
    ``model``: a SentenceTransformer, or what wraps one (a training run's prepared model: then give its
    ``tokenizer`` and ``device``)."""
    import torch

    from posextend.scoring.text import framed

    tokenizer = tokenizer or model.tokenizer
    device = device or model.device
    window = max_tokens - 2  # [CLS] and [SEP]

    def pieces(doc: Sequence[int]) -> list[Sequence[int]]:
        if mode == "full" or len(doc) <= window:
            return [doc[:window]]
        return [doc[i : i + window] for i in range(0, len(doc), window)]

    out = []
    with torch.no_grad():
        for doc in documents:
            chunks = pieces(doc)
            batches = [framed(chunks[b : b + batch_size], tokenizer) for b in range(0, len(chunks), batch_size)]
            vectors = [model({k: v.to(device) for k, v in batch.items()})["sentence_embedding"] for batch in batches]
            mean = torch.cat(vectors).float().mean(0)  # chunk-and-average: the mean of the chunks' embeddings
            out.append(torch.nn.functional.normalize(mean, dim=0))
    return torch.stack(out)


def hits(model, task: Task, *, mode: Mode = "full", max_tokens: int | None = None, tokenizer=None,
         device=None) -> list[bool]:
    """For each query, whether its most similar document (cosine) is its own. ``model``: a
    SentenceTransformer (or what wraps one: then give ``max_tokens``, ``tokenizer`` and ``device``);
    queries and documents go through the same batches (:func:`posextend.scoring.text.framed`)."""
    tokenizer = tokenizer or model.tokenizer
    max_tokens = max_tokens or model.max_seq_length
    docs = _embed_ids(model, task.documents, max_tokens, mode, tokenizer=tokenizer, device=device)
    rows = [tokenizer(q, add_special_tokens=False)["input_ids"][: max_tokens - 2] for q in task.queries]
    queries = _embed_ids(model, rows, max_tokens, "full", tokenizer=tokenizer, device=device)
    best = (queries @ docs.T).argmax(dim=1).cpu()
    return [int(b) == i for i, b in enumerate(best)]


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
    haystack: str = "shared"  # the protocol: "shared" (LongEmbed's: one haystack per length) or "varied"
    scores: dict[str, dict[int, float]] = field(default_factory=dict)  # task -> length -> accuracy@1
    # task -> length -> accuracy@1 of the keys in each quarter of the document's depth (None: no key there)
    depth: dict[str, dict[int, list[float | None]]] = field(default_factory=dict)
    # task -> length -> where each document's key sits (fraction of the document's depth), document order
    key_depths: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    short_input_cosine: float | None = None  # against the reference model, when given

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_embedding_model(path: str | Path):
    """A sentence-transformers model from a local folder (a plain transformers checkpoint gets mean pooling), on
    the GPU when there is one."""
    from sentence_transformers import SentenceTransformer

    from posextend.files.sources import resolve_source
    from posextend.scoring.by_position import reading_device

    return SentenceTransformer(str(resolve_source(path)), device=str(reading_device())).eval()


def corpus_tokens(tokenizer, data: Sequence[str | Path]) -> list[int]:
    """The token ids of the text files (or folders, JSON Lines) ``data``, one after another."""
    from posextend.data.text import read_documents

    return text_tokens(tokenizer, read_documents(data))


def text_tokens(tokenizer, texts: Sequence[str], *, limit: int | None = None) -> list[int]:
    """The token ids of ``texts``, one after another (no special tokens); with ``limit``, about that many
    (the texts are read until it is reached, a long one only in part)."""
    ids: list[int] = []
    for text in texts:
        if limit is not None:
            if len(ids) >= limit:
                break
            text = text[: 8 * (limit - len(ids))]  # English tokens are rarely longer than 8 characters
        ids += tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    return ids


def task_pairs(tokenizer, corpus_ids: Sequence[int], lengths: Sequence[int], *, n: int, seed: int = 0,
               haystacks: Sequence[str] = VERDICT_HAYSTACKS, tasks: Sequence[str] = TASKS) -> list[list[Task]]:
    """Every task of the verdict's protocols (``haystacks`` x ``tasks``), built at each of ``lengths`` (``n`` documents
    each), that ``corpus_ids`` and every length can hold: one list of tasks per length, in the same order.
    A task the corpus is too short for (the needle, every varied task) or whose key does not fit the
    shortest length is left out at every length; the shared passkey needs no corpus."""
    built = []
    for haystack in haystacks:
        for task in tasks:
            try:
                built.append([make_task(tokenizer, corpus_ids, task, length, n=n, seed=seed, haystack=haystack)
                              for length in lengths])
            except DataError:
                continue
    return [list(at_length) for at_length in zip(*built)] if built else [[] for _ in lengths]


def accuracy(model, tasks: Sequence[Task], **reading: Any) -> float:
    """Accuracy@1 over every query of ``tasks`` (:func:`hits`; ``reading``: its keywords)."""
    found = [hit for task in tasks for hit in hits(model, task, **reading)]
    return sum(found) / len(found) if found else float("nan")


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
    haystack: Haystack = "shared",
) -> RetrievalReport:
    """Passkey / needle accuracy@1 per document length (and per quarter of the key's depth); with
    ``reference``, the short-input cosine between ``reference`` (e.g. the original model) and this
    one on texts of 64–512 tokens.

    ``mode="full"`` reads each document up to ``max_tokens`` (default: the model's
    ``max_seq_length``); ``"chunk"`` embeds every ``max_tokens`` chunk and averages (the usual
    workaround for long documents).

    ``haystack="shared"`` follows LongEmbed (every document of a length is one haystack with its
    own key at an evenly spread depth; the passkey haystack is LongEmbed's repeated filler, the
    needle haystack one span of ``data``): the numbers to compare with LongEmbed's.
    ``"varied"`` builds each document from its own span of ``data``, the key at a random depth.

    Args:
        model_path: a sentence-transformers model folder (a plain transformers checkpoint gets mean pooling).
        data: text files or folders of them: the haystacks (and the short inputs for ``reference``).
        tasks: ``"passkey"`` and/or ``"needle"``.
        lengths: document lengths in tokens.
        n: documents (and queries) per task and length.
        mode: ``"full"`` or ``"chunk"`` (above).
        max_tokens: read at most this many tokens at once (default: the model's ``max_seq_length``).
        reference: the original model, for the short-input cosine.
        seed: seeds the keys, names and spans drawn.
        haystack: ``"shared"``, ``"varied"`` or ``"reworded"`` (above).

    Returns:
        Accuracy@1 by task and length (``report.scores[task][length]``), by depth, and the
        short-input cosine when ``reference`` is given.

    Examples:
        >>> report = posextend.evaluate_retrieval("minilm-2k", ["held_out.txt"],
        ...                                       lengths=(512, 2048), n=20)
        >>> report.scores["passkey"][2048]
    """
    if haystack not in HAYSTACKS:
        raise PosExtendError(f"Unknown haystack protocol {haystack!r}; choose one of: {', '.join(HAYSTACKS)}.")
    model = load_embedding_model(model_path)
    if max_tokens is not None:
        model.max_seq_length = max_tokens
    ids = corpus_tokens(model.tokenizer, data)
    report = RetrievalReport(str(model_path), mode, model.max_seq_length, n, haystack=haystack)
    for task in tasks:
        report.scores[task], report.depth[task], report.key_depths[task] = {}, {}, {}
        for length in lengths:
            built = make_task(model.tokenizer, ids, task, length, n=n, seed=seed, haystack=haystack)
            found = hits(model, built, mode=mode)
            report.scores[task][length] = sum(found) / len(found)
            report.depth[task][length] = by_depth(built, found)
            report.key_depths[task][length] = [round(d, 4) for d in built.depths]
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
