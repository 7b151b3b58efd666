"""The seq2seq objective (posextend/training/objectives/seq2seq.py): gap-sentence generation on encoder-decoders, the LED
recipe's fine-tune after extending, through the API and the CLI."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from typer.testing import CliRunner

import posextend
from posextend.cli import app
from posextend.training.objectives.seq2seq import MAX_SENTENCE, gap_count, gaps, raw_tokens

OLD = 64  # usable positions of the tiny BART


@pytest.fixture(scope="module")
def bart(tmp_path_factory):
    """A tiny BART with the real GPT-2 BPE (BART's own) and BART's special tokens, 64 positions."""
    from tiny import bart

    return bart(tmp_path_factory.mktemp("bart") / "src", OLD)


def test_gaps_mask_whole_sentences_spread_over_the_source():
    ends = {99}  # token 99 is a full stop
    sentence = lambda n, t: [t] * (n - 1) + [99]  # noqa: E731
    row = [tok for i in range(60) for tok in sentence(5 + i % 4, 10 + i % 50)]
    length = 320
    source, target, where = gaps(row, ends, length, 3, torch.Generator().manual_seed(0))
    assert len(source) == length and source.count(3) == len(set(where)) == gap_count(length) == 2
    assert len(target) == len(where) and target.count(99) == 2  # whole sentences, ending with their stop
    masks = [i for i, t in enumerate(source) if t == 3]
    assert sorted(set(where)) == masks and masks[0] < length / 2 <= masks[1]  # one per half
    again = gaps(row, ends, length, 3, torch.Generator().manual_seed(0))
    assert again == (source, target, where)  # a sample's gaps are a function of its generator
    assert raw_tokens(length) == length + 2 * (MAX_SENTENCE - 1)
    _, short, _ = gaps(row, ends, length, 3, torch.Generator().manual_seed(0), target_tokens=8)
    assert 0 < len(short) <= 8  # what the decoder can read


def test_finetune_extends_bart_4x_and_generates_from_a_long_input(bart, corpus, tmp_path):
    report = posextend.finetune(bart, tmp_path / "out", [corpus], length=4 * OLD, steps=3, batch_size=2, seed=0)
    assert (report.objective, report.strategy, report.old_length, report.new_length) == ("seq2seq", "tile", OLD, 4 * OLD)
    assert len(report.losses) == 3 and all(torch.isfinite(torch.tensor(report.losses)))
    for ev in (report.before, report.after):
        assert ev.metric == "masked-sentence perplexity" and ev.tokens > 0 and ev.length == 4 * OLD
        assert sum(b.tokens for b in ev.buckets) == ev.tokens
        assert any(b.tokens for b in ev.buckets if b.start >= OLD)  # sentences masked in the new range are scored
    model = transformers.BartForConditionalGeneration.from_pretrained(tmp_path / "out")
    assert model.config.max_position_embeddings == 4 * OLD
    assert model.model.encoder.embed_positions.weight.shape == (4 * OLD + 2, 16)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    ids = tok(corpus.read_text()[:4000], truncation=True, max_length=4 * OLD, return_tensors="pt").input_ids
    assert ids.shape[1] == 4 * OLD
    out = model.generate(ids, max_new_tokens=4, min_new_tokens=4, num_beams=1, do_sample=False)
    assert out.shape[1] >= 4
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"- Held-out masked-sentence perplexity after: {report.after.perplexity:.3f}" in card
    (note,) = report.notes  # how far the decoder's positions trained, in the report and the card
    longest = int(note.split("positions 0-")[1].split(" ")[0]) + 1
    assert note.startswith("decoder: positions 0-") and f"of {4 * OLD} trained" in note and 2 < longest < 4 * OLD
    assert f"- {note}" in card


def test_cli_runs_seq2seq_with_defaults_and_prints_the_table(bart, corpus, tmp_path):
    r = CliRunner().invoke(app, ["finetune", str(bart), str(tmp_path / "out"), "--data", str(corpus), "--length",
                                 str(2 * OLD), "--steps", "2", "--batch-size", "2"])
    assert r.exit_code == 0, r.output
    assert "masked-sentence" in r.output and "(seq2seq, all, 2 steps" in r.output  # the table, the summary
    assert "decoder: positions 0-" in r.output
    saved = json.loads((tmp_path / "out" / "posextend_eval.json").read_text())
    assert saved["after"]["metric"] == "masked-sentence perplexity" and saved["after"]["objective"] == "seq2seq"


def test_sentence_ends_are_read_off_each_tokens_text(bart):
    from posextend.training.objectives.seq2seq import sentence_ends

    tok = transformers.AutoTokenizer.from_pretrained(bart)
    ends = sentence_ends(tok)
    ids = tok('She smiled. "Really?" he asked! Then', add_special_tokens=False)["input_ids"]
    marked = [tok.decode([i]) for i in ids if i in ends]
    assert marked == [".", '?"', "!"]  # a closing quote after the mark still ends the sentence


def test_the_anchor_keeps_old_length_inputs_near_the_source(bart, corpus, tmp_path):
    """With its anchor on (off by default), the seq2seq fine-tune keeps what the model predicts for inputs
    within the old length closer to the source's than the same run without it (weight 2: at 1, six steps leave the
    two within noise of each other, depending on which sequences the held-out split leaves to train on)."""
    kwargs = dict(length=2 * OLD, steps=6, batch_size=2, lr=3e-3, eval_sequences=2, seed=0)
    anchored = posextend.finetune(bart, tmp_path / "anchored", [corpus], anchor=2, **kwargs)
    plain = posextend.finetune(bart, tmp_path / "plain", [corpus], **kwargs)
    assert (anchored.anchor, plain.anchor) == (2.0, 0.0)
    tok = transformers.AutoTokenizer.from_pretrained(bart)
    text = corpus.read_text()[:3000]
    ids = tok(text, truncation=True, max_length=OLD, return_tensors="pt").input_ids  # within the old length
    labels = tok(text[:200], truncation=True, max_length=OLD // 2, return_tensors="pt").input_ids  # what the decoder reads

    def log_probs(path):
        model = transformers.BartForConditionalGeneration.from_pretrained(path).eval()
        with torch.no_grad():
            return model(input_ids=ids, labels=labels).logits.log_softmax(-1)

    source = log_probs(bart)

    def kl(path):
        return float(torch.nn.functional.kl_div(log_probs(path), source, log_target=True, reduction="batchmean"))

    assert 0 < kl(tmp_path / "anchored") < kl(tmp_path / "plain")


@pytest.mark.parametrize("model_type", ["mbart", "plbart", "mvp", "blenderbot", "blenderbot-small", "bigbird_pegasus"])
def test_every_bart_like_family_finetunes_at_twice_its_length(model_type, corpus, tmp_path):
    """The families of the issue (and BigBird-Pegasus, probed): one step at 2x through the API, and the output
    loads in its own class with both stacks' tables at the new length."""
    from tiny import SEQ2SEQ, bart as build

    src = build(tmp_path / "src", OLD, model_type=model_type)
    report = posextend.finetune(src, tmp_path / "out", [corpus], length=2 * OLD, steps=1, batch_size=2,
                                eval_sequences=2, seed=0)
    assert (report.objective, report.new_length) == ("seq2seq", 2 * OLD) and torch.isfinite(torch.tensor(report.losses)).all()
    model = getattr(transformers, SEQ2SEQ[model_type][1]).from_pretrained(tmp_path / "out")
    assert model.config.max_position_embeddings == 2 * OLD
    rows = {model.get_encoder().embed_positions.weight.shape[0], model.get_decoder().embed_positions.weight.shape[0]}
    assert rows == {2 * OLD + (2 if model_type in ("mbart", "plbart", "mvp") else 0)}


@pytest.mark.parametrize("decoder_length", [None, 2 * OLD])
def test_led_extends_its_encoder_and_its_decoder_only_when_asked(decoder_length, corpus, tmp_path):
    """LED has a length per stack: the run's length sizes the encoder; decoder_length the decoder. With
    new-rows, the old rows of both stay bit-identical and the new ones train."""
    from tiny import bart as build

    src = build(tmp_path / "src", OLD, model_type="led")
    report = posextend.finetune(src, tmp_path / "out", [corpus], length=4 * OLD, decoder_length=decoder_length,
                                train="new-rows", steps=2, batch_size=2, eval_sequences=2, seed=0)
    model = transformers.LEDForConditionalGeneration.from_pretrained(tmp_path / "out")
    before = transformers.LEDForConditionalGeneration.from_pretrained(src)
    decoder = decoder_length or OLD
    assert (model.config.max_encoder_position_embeddings, model.config.max_decoder_position_embeddings) == (4 * OLD, decoder)
    for stack, rows in ((model.led.encoder, 4 * OLD), (model.led.decoder, decoder)):
        table = stack.embed_positions.weight
        old = getattr(before.led, "encoder" if stack is model.led.encoder else "decoder").embed_positions.weight
        assert table.shape[0] == rows and torch.equal(table[:OLD], old)
        assert rows == OLD or not torch.equal(table[OLD : 2 * OLD], old)  # tiled, then trained
    assert "its targets are at most" in report.notes[0] and "only its rows from its old length to" in report.notes[0]


def test_decoder_length_is_refused_where_both_stacks_share_one_length(bart, corpus, tmp_path):
    r = CliRunner().invoke(app, ["finetune", str(bart), str(tmp_path / "out"), "--data", str(corpus), "--length",
                                 str(2 * OLD), "--decoder-length", str(2 * OLD), "--steps", "1"])
    assert r.exit_code == 1 and "no decoder with a length of its own" in r.output and "--length N sizes" in r.output
    assert not (tmp_path / "out").exists()


@pytest.fixture()
def pairs(corpus, tmp_path):
    """Lead-sentence summaries: each paragraph of the corpus and its first sentence, as JSON Lines."""
    import re

    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", corpus.read_text()) if len(p) > 300]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"source": p, "target": re.split(r"(?<=[.!?])\s", p)[0][:300]}) + "\n"
                            for p in paragraphs[:40]))
    return path


def test_supervised_pairs_train_and_are_scored_by_source_length(bart, pairs, tmp_path):
    r = CliRunner().invoke(app, ["finetune", str(bart), str(tmp_path / "out"), "--data", str(pairs), "--length",
                                 str(2 * OLD), "--steps", "2", "--batch-size", "2"])
    assert r.exit_code == 0, r.output
    saved = json.loads((tmp_path / "out" / "posextend_eval.json").read_text())
    after = saved["after"]
    assert after["metric"] == "target perplexity by source length" and after["tokens"] > 0
    lengths = [min(len(transformers.AutoTokenizer.from_pretrained(bart)(json.loads(line)["source"])["input_ids"]), 2 * OLD)
               for line in pairs.read_text().splitlines()]
    scored = [b for b in after["buckets"] if b["tokens"]]
    assert all(any(b["start"] <= n - 1 < b["end"] for n in lengths) for b in scored)  # binned where sources end
    model = transformers.BartForConditionalGeneration.from_pretrained(tmp_path / "out")
    assert model.config.max_position_embeddings == 2 * OLD


def test_pairs_and_plain_text_are_not_mixed(bart, pairs, corpus, tmp_path):
    r = CliRunner().invoke(app, ["finetune", str(bart), str(tmp_path / "out"), "--data", str(pairs), "--data",
                                 str(corpus), "--steps", "1"])
    assert r.exit_code == 1 and "holds source/target pairs but" in r.output
    broken = tmp_path / "broken.jsonl"
    broken.write_text(pairs.read_text().splitlines()[0] + "\n" + json.dumps({"source": "only a source"}) + "\n")
    with pytest.raises(posextend.DataError, match="broken.jsonl:2 .*'source' and 'target'"):
        posextend.finetune(bart, tmp_path / "out", [broken], steps=1)


def test_with_new_rows_only_the_note_says_which_decoder_rows_trained(bart, corpus, tmp_path):
    """BART's decoder shares the run's length: with new rows only, its rows below the old length stay, so the
    note names the new rows its targets reached (none when they are all shorter than the old length)."""
    report = posextend.finetune(bart, tmp_path / "out", [corpus], length=2 * OLD, train="new-rows", steps=1,
                                batch_size=2, eval_sequences=2, seed=0)
    (note,) = report.notes
    longest = int(note.split("at most ")[1].split(" ")[0])
    reached = "none of its new rows" if longest <= OLD else f"only rows {OLD}-{longest - 1} of its new rows"
    assert note.startswith("decoder: its targets are at most") and f"{reached} ({OLD}-{2 * OLD - 1}) trained" in note


def test_a_bert_to_bert_encoder_decoder_extends_its_encoder(corpus, tmp_path):
    """transformers' EncoderDecoderModel (BERT to BERT): a length per stack, as LED's; the encoder's table grows
    with the run's length, the decoder keeps its own, and the output loads in its class."""
    from tiny import bert_tokenizer

    tok = bert_tokenizer(OLD)
    stack = dict(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                 max_position_embeddings=OLD)
    config = transformers.EncoderDecoderConfig.from_encoder_decoder_configs(
        transformers.BertConfig(**stack), transformers.BertConfig(**stack, is_decoder=True, add_cross_attention=True))
    config.decoder_start_token_id, config.pad_token_id = tok.cls_token_id, tok.pad_token_id
    torch.manual_seed(0)
    transformers.EncoderDecoderModel(config).save_pretrained(tmp_path / "src")
    tok.save_pretrained(tmp_path / "src")
    report = posextend.finetune(tmp_path / "src", tmp_path / "out", [corpus], length=2 * OLD, steps=1, batch_size=2,
                                eval_sequences=2, seed=0)
    assert report.objective == "seq2seq" and torch.isfinite(torch.tensor(report.losses)).all()
    model = transformers.EncoderDecoderModel.from_pretrained(tmp_path / "out")
    assert model.encoder.embeddings.position_embeddings.weight.shape[0] == 2 * OLD
    assert model.decoder.bert.embeddings.position_embeddings.weight.shape[0] == OLD
    assert (model.config.encoder.max_position_embeddings, model.config.decoder.max_position_embeddings) == (2 * OLD, OLD)


def test_own_window_kl_reads_each_masked_sentence_in_its_old_length_window(bart, corpus):
    """``seq2seq.own_window_kl``: each masked sentence of a source four times the old length is read again by the model
    from the window of the old length its mask falls in (that window's text in the framing tokens, its target the
    sentences masked there, in order): computed here window by window, with no padding, the mean KL over every
    target token is the function's; by default only the tokens the window reads better count."""
    from types import SimpleNamespace

    from posextend.training.objectives import get_objective
    from posextend.training.objectives.seq2seq import Gaps, framing, own_window_kl

    tok = transformers.AutoTokenizer.from_pretrained(bart)
    model = transformers.BartForConditionalGeneration.from_pretrained(bart).eval()
    posextend.extend_model(model, 4 * OLD, "tile")
    objective = get_objective("seq2seq")
    rows = objective.samples(tok, [corpus.read_text()[:60000]], 4 * OLD)[:4]
    run = SimpleNamespace(tokenizer=tok, state=Gaps(), model=model, unwrapped=model,
                          sizes=SimpleNamespace(length=SimpleNamespace(old=OLD, new=4 * OLD), decoder=None),
                          accelerator=SimpleNamespace(device=torch.device("cpu")))
    inputs, wheres = objective.batch(run, rows, [torch.Generator().manual_seed(i) for i in range(4)])
    with torch.no_grad():
        logits = model(**inputs).logits
    before, after = framing(tok)
    inner = OLD - len(before) - len(after)
    kls, harmed = [], []
    for r, where in enumerate(wheres):
        labels = inputs["labels"][r]
        for c in range(4 * OLD // inner + 1):
            tokens = [t for t, pos in enumerate(where) if pos >= 0 and labels[t] != -100
                      and (pos - len(before)) // inner == c]
            if not tokens:
                continue
            text = inputs["input_ids"][r, len(before) + c * inner: len(before) + (c + 1) * inner].tolist()
            target = torch.tensor([before + [int(labels[t]) for t in tokens] + after])
            with torch.no_grad():
                read = model(input_ids=torch.tensor([before + text + after]), labels=target).logits[0]
            teacher = read[len(before):len(before) + len(tokens)].log_softmax(-1)
            student = logits[r, tokens].log_softmax(-1)
            kls.append(torch.nn.functional.kl_div(student, teacher, log_target=True, reduction="none").sum(-1))
            truth = labels[tokens][:, None]
            harmed.append((teacher.gather(-1, truth) > student.gather(-1, truth))[:, 0].float())
    kl, harm = torch.cat(kls), torch.cat(harmed)
    assert len({(pos - len(before)) // inner for where in wheres for pos in where if pos >= 0}) >= 2  # two windows
    assert float(own_window_kl(run, inputs, wheres, logits, harm_only=False)) == pytest.approx(float(kl.mean()),
                                                                                              rel=1e-4)
    assert float(own_window_kl(run, inputs, wheres, logits)) == pytest.approx(float((kl * harm).sum() / len(kl)),
                                                                               rel=1e-4)
    assert 0 < float(harm.mean()) < 1
