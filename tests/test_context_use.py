"""The context-use probe: a passage repeated and a pass key planted past the old window, read whole and through it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import transformers
from typer.testing import CliRunner

from posextend.cli import app
from posextend.errors import DataError
from posextend.scoring.by_position import position_losses
from posextend.scoring.context_use import USES_RATIO, context_use, passkey_sequences, repeated_passages
from tiny import FAMILIES, gpt2_tokenizer

OLD, LENGTH = 32, 64


class Copier(torch.nn.Module):
    """A causal LM that reads its whole context perfectly: it predicts the token that followed the longest earlier
    match of the text so far (an induction head, by hand), and is uniform where nothing matches."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.unused = vocab, torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        logits = torch.zeros(*input_ids.shape, self.vocab)
        for b, row in enumerate(input_ids.tolist()):
            run = [0] * len(row)  # run[j]: tokens that match, ending at j and at the current position
            for t, token in enumerate(row):
                run = [1 + (run[j - 1] if j else 0) if row[j] == token else 0 for j in range(t)] + [0] * (len(row) - t)
                matched, best = max(((run[j], j) for j in range(t)), default=(0, 0))  # the longest, then the latest
                if matched:
                    logits[b, t, row[best + 1]] = 30.0
        return SimpleNamespace(logits=logits)


@pytest.fixture(scope="module")
def model_64():
    """A tiny random GPT-2 that reads LENGTH positions (built in memory), and the real GPT-2 tokenizer."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(**{**FAMILIES["gpt2"].overrides, "n_positions": LENGTH})
    return transformers.GPT2LMHeadModel(config).eval(), gpt2_tokenizer(LENGTH)


def test_the_second_copy_lies_past_the_old_window_and_the_window_never_sees_the_first(model_64):
    model, tok = model_64
    seqs, passage = repeated_passages(OLD, LENGTH, tokenizer=tok, sequences=3)
    assert seqs.shape == (3, LENGTH) and passage == (LENGTH - OLD) // 2 == 16
    assert torch.equal(seqs[:, :passage], seqs[:, -passage:])  # both copies fit, the second at the end
    assert LENGTH - passage - OLD >= passage  # the gap between them is at least a window: distance 48 > 32
    assert not set(seqs.flatten().tolist()) & set(tok.all_special_ids)
    # the first copy replaced: the window reads the second copy exactly as before; the whole context does not
    other = seqs.clone()
    other[:, :passage] = (other[:, :passage] + 1) % len(tok)
    second = slice(LENGTH - passage, LENGTH)
    for window, same in ((OLD, True), (None, False)):
        a, b = (position_losses(model, s, "causal", window=window)[0][second] for s in (seqs, other))
        assert torch.equal(a, b) is same
    with pytest.raises(DataError, match="at least 16 positions past the old length of 32"):
        repeated_passages(OLD, OLD + 15, tokenizer=tok)


def test_pass_keys_sit_past_the_old_window_and_end_the_sequence(model_64):
    _, tok = model_64
    seqs, answers, distances, numbers = passkey_sequences(tok, OLD, LENGTH, keys=4)
    assert seqs.shape == (4, LENGTH) and len(set(numbers)) == 4 and min(distances) >= OLD
    for row, answer, number in zip(seqs, answers, numbers):
        assert tok.decode(row[-answer:]).strip() == str(number)
        assert f"The pass key is {number}. Remember it." in tok.decode(row)
        assert str(number) not in tok.decode(row[-OLD:-answer])  # the old window holds the question, not the key
        assert tok.decode(row[-OLD:-answer]).endswith("What is the pass key? The pass key is")


def test_a_model_that_copies_uses_its_context_and_a_random_one_does_not(model_64):
    model, tok = model_64
    copier = context_use(Copier(len(tok)), tok, old_length=OLD, length=LENGTH, keys=4)
    assert copier.uses and copier.repeat_whole < 1.01 and copier.repeat_window > 1000  # uniform over 50k tokens
    assert copier.passkey_whole == 1.0 and copier.passkey_window == 0.0 and copier.distance == 48
    assert copier.text.startswith("uses its positions past 32: a passage repeated 48 tokens later reads at "
                                  "perplexity 1.0 with the whole context against ")
    assert copier.text.endswith("of 4 pass keys planted 32+ tokens back it reads 4 whole against 0 through the window")
    random = context_use(model, tok, old_length=OLD, length=LENGTH, keys=4)
    assert not random.uses and 0.8 < random.repeat_whole / random.repeat_window < 1.25 and USES_RATIO < 0.8
    assert random.text.startswith("does not use its positions past 32") and random.source == "random tokens"
    assert json.loads(json.dumps(random.to_dict()))["uses"] is False


def test_eval_of_an_extended_lm_prints_and_writes_it(gpt, corpus, tmp_path):
    import posextend

    posextend.resize_checkpoint(gpt, tmp_path / "tiled", LENGTH, "tile", seed=0)  # old length 32 on record
    r = CliRunner().invoke(app, ["eval", str(tmp_path / "tiled"), "--data", str(corpus), "--max-sequences", "4",
                                 "--json", str(tmp_path / "e.json")])
    assert r.exit_code == 0, r.output
    line = next(x for x in r.output.splitlines() if x.startswith("Context: "))
    data = json.loads((tmp_path / "e.json").read_text())["context_use"]
    assert line == f"Context: {data['text']}" and "use its positions past 32: a passage repeated 48 tokens" in line
    assert (data["distance"], data["passage"], data["keys"], data["source"]) == (48, 16, 8, "held-out text")
    assert data["repeat_whole"] > 1 and data["repeat_window"] > 1 and data["passkey_distance"] >= OLD
