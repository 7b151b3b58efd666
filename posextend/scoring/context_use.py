"""Does an extended causal LM use its new positions? Two readings past the old window, whole and through it.

An extension only earns its longer context if the model reads tokens farther back than its old window. Two
probes show whether it does, each read twice: with the whole context, and through a sliding window of the old
length (:func:`~posextend.scoring.by_position.position_losses` with ``window``: what the source model sees):

* **Repeated passage.** A passage of ``P`` tokens (held-out text, else random tokens from the vocabulary), then
  ``G >= old_length`` tokens of what follows it, then the passage again, at the end of the sequence
  (``P = (length - old_length) // 2``). The second copy lies ``P + G`` tokens after the first, and no read
  through the old window sees any of the first copy from it. Its perplexity (but its first token): a model that
  reads its whole context copies the passage and reads it almost for free; through the window it reads it as new.
* **Pass key.** LongEmbed's shared haystack (:data:`~posextend.scoring.retrieval.PASSKEY_FILLER`) with
  "The pass key is 48151. Remember it. 48151 is the pass key." planted at least ``old_length`` tokens before
  the end, which asks "What is the pass key? The pass key is" and gives the key. Accuracy: the keys whose every
  token the model predicts greedily (what greedy decoding would answer), whole and through the old window (the
  last ``old_length`` tokens: the question, without the key); and the perplexity of the key's tokens.

The model **uses its positions past the old length** when the repeated passage reads at most
:data:`USES_RATIO` of its perplexity through the old window with the whole context (:func:`uses_context`, the one
rule). A model that reads past its old window copies the passage and falls far below that (a tenth or less); one
that does not reads it alike both ways (ratio about 1).

Examples:
    >>> probe = context_use(model, tokenizer, old_length=1024, length=2048)
    >>> print(probe.text)
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from typing import Any

import torch

from posextend.errors import DataError

#: The model uses its context when the repeated passage's perplexity with the whole context is at most this
#: fraction of its perplexity through the old window (a copying model: a tenth or less; one that does not: about 1).
USES_RATIO = 0.5
MIN_PASSAGE = 8  # tokens in the repeated passage, at least: the probe needs 2 x this many new positions
KEY_SENTENCE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = " What is the pass key? The pass key is"


@dataclass(frozen=True)
class ContextUse:
    """What :func:`context_use` read. Perplexities (lower is better) and accuracies (fractions of the keys).

    Attributes:
        old_length / length: the old window and the positions read.
        uses: whether the model uses its positions past ``old_length`` (:func:`uses_context`).
        repeat_whole / repeat_window: perplexity of the passage's second copy with the whole context, and through
            a sliding window of ``old_length`` tokens. ``distance``: tokens from the first copy to the second.
            ``passage``: the passage's tokens. ``source``: ``"held-out text"`` or ``"random tokens"``.
        passkey_whole / passkey_window: the fraction of ``keys`` the model reads exactly (greedy), whole and
            through the old window; ``passkey_perplexity_whole`` / ``_window``: the perplexity of the key's tokens.
            ``passkey_distance``: every key sits at least this many tokens before its answer.
    """

    old_length: int
    length: int
    repeat_whole: float
    repeat_window: float
    distance: int
    passage: int
    source: str
    passkey_whole: float
    passkey_window: float
    passkey_perplexity_whole: float
    passkey_perplexity_window: float
    passkey_distance: int
    keys: int

    @property
    def uses(self) -> bool:
        return uses_context(self.repeat_whole, self.repeat_window)

    @property
    def text(self) -> str:
        """One line: whether it uses its context, and the numbers that say so."""
        head = f"uses its positions past {self.old_length}" if self.uses else \
            f"does not use its positions past {self.old_length}"
        whole, window = (round(share * self.keys) for share in (self.passkey_whole, self.passkey_window))
        return (f"{head}: a passage repeated {self.distance} tokens later reads at perplexity {self.repeat_whole:.1f} "
                f"with the whole context against {self.repeat_window:.1f} through a {self.old_length}-token window; "
                f"of {self.keys} pass keys planted {self.passkey_distance}+ tokens back it reads {whole} whole "
                f"against {window} through the window")

    def to_dict(self) -> dict[str, Any]:
        """Its fields, ``uses`` and ``text`` (JSON-ready)."""
        return {**asdict(self), "uses": self.uses, "text": self.text}


def uses_context(whole: float, window: float) -> bool:
    """The rule: the repeated passage reads at most :data:`USES_RATIO` of its perplexity through the old window
    when the model reads its whole context."""
    return whole <= USES_RATIO * window


def repeated_passages(old_length: int, length: int, *, text: torch.Tensor | None = None, tokenizer: Any = None,
                      sequences: int = 4, seed: int = 0) -> tuple[torch.Tensor, int]:
    """``(sequences, passage)``: ``[n, length]`` token ids, each a span of ``length - P`` tokens of ``text`` (rows
    of held-out token ids, the first ``n`` used) or of random tokens of ``tokenizer`` (none of its special
    tokens), then the span's first ``P`` tokens again (``P = passage``)."""
    if length - old_length < 2 * MIN_PASSAGE:
        raise DataError(f"The probe needs at least {2 * MIN_PASSAGE} positions past the old length of {old_length}; "
                        f"the model reads {length}.")
    passage = (length - old_length) // 2
    span = length - passage  # the passage and the gap (>= old_length) after it
    if text is not None:
        if text.shape[1] < span:
            raise DataError(f"The held-out rows hold {text.shape[1]} tokens, fewer than the probe's {span}.")
        spans = text[:sequences, :span].long()
    else:
        special = set(tokenizer.all_special_ids)
        vocab = torch.tensor([i for i in range(len(tokenizer)) if i not in special])
        spans = vocab[torch.randint(0, len(vocab), (sequences, span), generator=torch.Generator().manual_seed(seed))]
    return torch.cat([spans, spans[:, :passage]], 1), passage


def passkey_sequences(tokenizer: Any, old_length: int, length: int, *, keys: int = 8,
                      seed: int = 0) -> tuple[torch.Tensor, list[int], list[int], list[int]]:
    """``(sequences, answers, distances, numbers)``: ``[keys, length]`` token ids, each the haystack with key
    sentence ``i`` planted (spread evenly over the part no old window that holds the question sees), then the
    question, then the key: its last ``answers[i]`` tokens. ``distances[i]``: tokens from the key sentence's end
    to the answer (at least ``old_length``); ``numbers``: the keys."""
    from posextend.scoring.retrieval import passkey_haystack

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    rng = random.Random(f"context-use-{seed}")
    numbers = [rng.randrange(10_000, 100_000) for _ in range(keys)]
    hay, question = passkey_haystack(tokenizer, length), ids(QUESTION)
    rows, answers, distances = [], [], []
    for i, number in enumerate(numbers):
        sentence, key = ids(KEY_SENTENCE.format(key=number)), ids(f" {number}")
        last = length - old_length - len(key) - len(sentence)  # the sentence ends a window before the answer
        if last < 0 or len(question) + len(key) >= old_length:
            raise DataError(f"A pass key needs {len(sentence) + len(key)} positions past the old length of "
                            f"{old_length} and an old window longer than its question; the model reads {length}.")
        at = round(last * i / max(keys - 1, 1))
        filler = length - len(sentence) - len(question) - len(key)
        rows.append(hay[:at] + sentence + hay[at:filler] + question + key)
        answers.append(len(key))
        distances.append(length - len(key) - at - len(sentence))
    return torch.tensor(rows), answers, distances, numbers


def repeat_reading(model: torch.nn.Module, repeats: torch.Tensor, passage: int, old_length: int, *,
                   batch_size: int = 4, device: torch.device | str | None = None) -> tuple[float, float]:
    """``(whole, windowed)``: the perplexity of the second copy of each repeated passage of ``repeats`` (but its
    first token; :func:`repeated_passages`, ``passage`` tokens long) read with the whole context and through a
    sliding window of ``old_length`` tokens: the half of the probe its rule reads (:func:`uses_context`)."""
    from posextend.scoring.by_position import evaluating, position_losses

    device = device or next(model.parameters()).device
    second = slice(repeats.shape[1] - passage + 1, repeats.shape[1])  # the second copy but its first token

    def repeat(window: int | None) -> float:
        total, count = position_losses(model, repeats, "causal", batch_size=batch_size, device=device, window=window)
        return math.exp(min(float(total[second].sum() / count[second].sum()), 50))

    with evaluating(model):
        return repeat(None), repeat(old_length)


@torch.no_grad()
def _answers(model: torch.nn.Module, sequences: torch.Tensor, answers: list[int], window: int | None,
             device: Any, batch_size: int) -> tuple[float, float]:
    """``(accuracy, perplexity)`` of each row's last ``answers[i]`` tokens, read from its last ``window`` tokens
    (None: all): a key is read when the model predicts each of its tokens greedily."""
    from posextend.scoring.by_position import token_losses

    reads = sequences[:, -window:] if window else sequences
    hits, losses, tail = [], [], max(answers) + 1  # the logits kept: those that predict the longest answer
    for first in range(0, len(reads), batch_size):
        logits = model(input_ids=reads[first:first + batch_size].to(device)).logits[:, -tail:].float().cpu()
        for row, answer in zip(range(first, first + len(logits)), answers[first:first + batch_size]):
            predicted, target = logits[row - first, tail - answer - 1:tail - 1], reads[row, -answer:]
            hits.append(bool((predicted.argmax(-1) == target).all()))
            losses += token_losses(predicted[None], target[None])[0].tolist()
    return sum(hits) / len(hits), math.exp(min(sum(losses) / len(losses), 50))


def context_use(model: torch.nn.Module, tokenizer: Any, *, old_length: int, length: int,
                text: torch.Tensor | None = None, sequences: int = 4, keys: int = 8, seed: int = 0, batch_size: int = 4,
                device: torch.device | str | None = None) -> ContextUse:
    """Whether a causal LM uses its positions past ``old_length``: a passage repeated and pass keys planted past
    the old window, each read with the whole context and through a sliding window of ``old_length`` tokens.

    Args:
        model: a causal LM that reads ``length`` positions (its outputs have ``.logits``).
        tokenizer: its tokenizer (the pass keys' text, and the random tokens without ``text``).
        old_length: the window before the extension.
        length: the positions read: at least 2 x :data:`MIN_PASSAGE` more than ``old_length``, and room for a
            pass key's sentence past it.
        text: held-out token ids, ``[n, >= length]`` (a fine-tune's held-out windows): the passages are their first
            ``sequences`` rows. None: random tokens from the vocabulary (``seed``).
        sequences: repeated passages read.
        keys: pass keys read (spread evenly over the part of the haystack the old window does not see).
        seed: draws the keys, and the random tokens without ``text``.
        batch_size: sequences per forward pass.
        device: where to read (default: where the model is).

    Returns:
        A :class:`ContextUse`; ``.uses`` applies the one rule (:func:`uses_context`) and ``.text`` says it in a line.

    Raises:
        DataError: ``length`` leaves too little room past ``old_length`` for the probe.

    Examples:
        >>> probe = posextend.context_use(model, tokenizer, old_length=1024, length=2048)
        >>> probe.uses, probe.repeat_whole, probe.repeat_window
    """
    from posextend.scoring.by_position import evaluating

    device = device or next(model.parameters()).device
    text = text if text is not None and len(text) else None
    keyed, answers, distances, _ = passkey_sequences(tokenizer, old_length, length, keys=keys, seed=seed)
    repeats, passage = repeated_passages(old_length, length, text=text, tokenizer=tokenizer, sequences=sequences,
                                         seed=seed)
    whole, windowed = repeat_reading(model, repeats, passage, old_length, batch_size=batch_size, device=device)
    with evaluating(model):
        key_whole = _answers(model, keyed, answers, None, device, batch_size)
        key_window = _answers(model, keyed, answers, old_length, device, batch_size)
    return ContextUse(
        old_length=old_length, length=length, repeat_whole=whole, repeat_window=windowed, distance=length - passage,
        passage=passage, source="random tokens" if text is None else "held-out text", passkey_whole=key_whole[0],
        passkey_window=key_window[0], passkey_perplexity_whole=key_whole[1], passkey_perplexity_window=key_window[1],
        passkey_distance=min(distances), keys=keys,
    )
