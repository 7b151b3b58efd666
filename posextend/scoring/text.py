"""Training and evaluation text as token ids: documents (read by :mod:`posextend.data.text`) tokenised and packed
into sequences of exactly the new length, an encoder's framed batches, the held-out tail of packed sequences, and
BERT's masking.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from posextend.errors import DataError


def pack(tokenizer, documents: Sequence[str], length: int) -> torch.Tensor:
    """Tokenise, join documents with the EOS (or SEP) token, cut into ``[n, length]`` sequences.

    Every sequence is exactly ``length`` tokens long, so every step sees every position;
    the tail shorter than ``length`` is dropped.
    """
    sep = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    ids: list[int] = []
    for doc in documents:
        ids += tokenizer(doc, add_special_tokens=False, verbose=False)["input_ids"]
        if sep is not None:
            ids.append(sep)
    n = len(ids) // length
    if n == 0:
        raise DataError(
            f"The data has {len(ids)} tokens, fewer than one sequence of {length}: give more text or a shorter length=N."
        )
    return torch.tensor(ids[: n * length], dtype=torch.long).view(n, length)


def framed(rows: Sequence[Sequence[int] | torch.Tensor], tokenizer) -> dict[str, torch.Tensor]:
    """An encoder's batch of ``rows`` (token ids without special tokens): ``[CLS] row [SEP]`` each (BOS and
    EOS for a tokenizer without CLS/SEP), padded to the longest, with the attention mask."""
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    if cls is None or sep is None:
        cls, sep = tokenizer.bos_token_id, tokenizer.eos_token_id
    width = max(len(r) for r in rows) + 2
    ids = torch.full((len(rows), width), tokenizer.pad_token_id or 0, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row) + 2] = torch.cat([torch.tensor([cls]), torch.as_tensor(row, dtype=torch.long), torch.tensor([sep])])
        mask[i, : len(row) + 2] = 1
    return {"input_ids": ids, "attention_mask": mask}


def split(sequences: torch.Tensor, eval_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and held-out parts (the held-out part comes from the end of the corpus)."""
    if len(sequences) < 2:
        raise DataError(
            f"The data packs into {len(sequences)} sequence(s) of {sequences.shape[1]} tokens; at least 2 are needed "
            "(one to train on, one held out): give more text or a shorter length=N."
        )
    n_eval = max(1, int(round(len(sequences) * eval_fraction)))
    n_eval = min(n_eval, len(sequences) - 1)
    return sequences[:-n_eval], sequences[-n_eval:]


def mask_tokens(
    input_ids: torch.Tensor, tokenizer, generator: torch.Generator, probability: float = 0.15
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking: 15% of tokens chosen; of those 80% ``[MASK]``, 10% random, 10% kept.

    Returns ``(inputs, labels)`` with labels -100 where nothing is predicted. Special
    tokens are never chosen. Deterministic given ``generator``.
    """
    if tokenizer.mask_token_id is None:
        raise DataError("The tokenizer has no mask token, which masked-LM training needs.")
    labels = input_ids.clone()
    special = torch.zeros_like(input_ids, dtype=torch.bool)
    for token_id in tokenizer.all_special_ids:
        special |= input_ids == token_id
    chosen = (torch.rand(input_ids.shape, generator=generator) < probability) & ~special
    labels[~chosen] = -100
    inputs = input_ids.clone()
    roll = torch.rand(input_ids.shape, generator=generator)
    inputs[chosen & (roll < 0.8)] = tokenizer.mask_token_id
    random_tokens = torch.randint(len(tokenizer), input_ids.shape, generator=generator)
    swap = chosen & (roll >= 0.8) & (roll < 0.9)
    inputs[swap] = random_tokens[swap]
    return inputs, labels
