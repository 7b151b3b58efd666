"""posextend finetune / eval on tiny models and real text (CPU)."""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from safetensors.torch import load_file
from typer.testing import CliRunner

import posextend
from posextend.cli import app
from posextend.scoring.by_position import bucket_edges, score_model
from posextend.training.objectives.base import get_objective
from posextend.training.loop import finetune
from tiny import FAMILIES, build, loss_nan_at, sentence_transformer  # noqa: F401

def _state(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


def test_loss_goes_down_on_real_text(gpt, corpus, tmp_path):
    report = finetune(gpt, tmp_path / "out", [corpus], steps=30, train="all", lr=3e-3, schedule="constant",
                      batch_size=4, seed=0, eval_every=10)
    first, last = sum(report.losses[:5]) / 5, sum(report.losses[-5:]) / 5
    assert last < first - 1.0, (first, last)
    assert report.after.loss < report.before.loss
    # the held-out curve: before, each --eval-every step, after
    assert [step for step, _ in report.eval_losses] == [0, 10, 20, 30]
    assert report.eval_losses[0][1] == report.before.loss and report.eval_losses[-1][1] == report.after.loss
    assert report.eval_losses[1][1] < report.eval_losses[0][1]
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.config.n_positions == 32


def test_new_rows_trains_only_the_new_rows(gpt, corpus, tmp_path):
    report = finetune(gpt, tmp_path / "out", [corpus], length=64, steps=8, train="new-rows", batch_size=2)
    assert (report.old_length, report.new_length) == (32, 64)
    before, after = _state(gpt), _state(tmp_path / "out")
    table = "transformer.wpe.weight"
    assert torch.equal(after[table][:32], before[table][:32])
    assert not torch.equal(after[table][32:], before[table][torch.arange(32, 64) % 32])  # trained
    for name in before.keys() - {table}:
        assert torch.equal(after[name], before[name]), name
    # the old range scores identically before and after (causal: old positions never see new ones)
    old = [b.perplexity for b in report.before.buckets if b.end <= 32]
    new = [b.perplexity for b in report.after.buckets if b.end <= 32]
    assert old == new
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out").model_max_length == 64
    info = posextend.inspect_checkpoint(tmp_path / "out")
    assert info.usable == 64
    # the fine-tuned model's context-use probe, in the report, its JSON, the written evaluation and the model card
    probe = report.context_use
    assert (probe.old_length, probe.length, probe.distance, probe.source) == (32, 64, 48, "held-out text")
    assert report.to_dict()["context_use"]["repeat_window"] == probe.repeat_window > 1
    assert json.loads((tmp_path / "out" / "posextend_eval.json").read_text())["context_use"]["text"] == probe.text
    assert f"- Context: {probe.text}" in (tmp_path / "out" / "README.md").read_text()


def test_masked_lm_positions_mode(bert, corpus, tmp_path):
    report = finetune(bert, tmp_path / "out", [corpus], length=48, steps=4, train="positions", batch_size=2)
    before, after = _state(bert), _state(tmp_path / "out")
    table = "bert.embeddings.position_embeddings.weight"
    assert after[table].shape == (48, 16) and not torch.equal(after[table][:32], before[table])
    for name in before.keys() - {table, "bert.embeddings.position_ids"}:
        if name in after:
            assert torch.equal(after[name], before[name]), name
    assert report.before.objective == "masked" and report.after.tokens > 0
    # the label comes with the report: the CLI's table, the plot and the model card print it as it is
    assert (report.after.metric, report.after.score, report.after.unit) == ("masked-LM perplexity", "perplexity", "tokens")
    assert f"- Held-out masked-LM perplexity after: {report.after.perplexity:.3f}" in (tmp_path / "out" / "README.md").read_text()


def test_resume_gives_the_same_result_as_an_uninterrupted_run(gpt, corpus, tmp_path):
    kwargs = dict(length=48, steps=6, train="positions", batch_size=2, seed=3, schedule="cosine")
    finetune(gpt, tmp_path / "straight", [corpus], **kwargs)

    def interrupt(step, total, loss, tps):
        if step == 4:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: stop after this step, save state

    with pytest.raises(posextend.TrainingError, match="Interrupted after step 4; state saved in"):
        finetune(gpt, tmp_path / "resumed", [corpus], progress=interrupt, **kwargs)
    assert not (tmp_path / "resumed").exists() and (tmp_path / "resumed.state").is_dir()
    finetune(gpt, tmp_path / "resumed", [corpus], resume=True, **kwargs)
    a, b = _state(tmp_path / "straight"), _state(tmp_path / "resumed")
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert not (tmp_path / "resumed.state").exists()


def test_a_resume_where_auto_is_another_precision_is_refused(gpt, corpus, tmp_path, monkeypatch):
    """auto is bf16 on a CPU with bf16 instructions and fp32 on one without: resuming a run there would change
    what its steps compute, so the saved state records the precision auto resolved to."""
    import posextend.training.setup as setup

    kwargs = dict(length=48, steps=3, train="positions", batch_size=2, mixed_precision="auto")
    monkeypatch.setattr(setup, "cpu_has_native_bf16", lambda: True)
    with pytest.raises(posextend.TrainingError, match="The loss became nan at step 2"), loss_nan_at(2):
        finetune(gpt, tmp_path / "out", [corpus], **kwargs)
    monkeypatch.setattr(setup, "cpu_has_native_bf16", lambda: False)
    with pytest.raises(posextend.TrainingError, match=r"Cannot resume: .*precision"):
        finetune(gpt, tmp_path / "out", [corpus], resume=True, **kwargs)
    report = finetune(gpt, tmp_path / "out", [corpus], resume=True, **kwargs | {"mixed_precision": "bf16"})
    assert report.precision == "bf16" and (tmp_path / "out").is_dir()


def test_resume_without_saved_state_is_refused(gpt, corpus, tmp_path):
    with pytest.raises(posextend.TrainingError, match="no saved state"):
        finetune(gpt, tmp_path / "out", [corpus], length=48, steps=2, resume=True)


def test_non_finite_loss_stops_and_keeps_the_last_good_state(gpt, corpus, tmp_path):
    with pytest.raises(posextend.TrainingError, match=r"The loss became nan at step 2; .*last good state \(step 2\)"):
        with loss_nan_at(2):
            finetune(gpt, tmp_path / "out", [corpus], length=48, steps=5, batch_size=2)
    assert not (tmp_path / "out").exists()
    assert (tmp_path / "out.state" / "posextend.json").read_text().startswith('{"step": 2')


def test_eval_buckets_cover_every_position_once(gpt, corpus):
    for length, k, old in [(64, 8, None), (100, 5, 37), (7, 10, None), (128, 4, 32)]:
        edges = bucket_edges(length, k, old_length=old)
        covered = [p for lo, hi in zip(edges[:-1], edges[1:]) for p in range(lo, hi)]
        assert covered == list(range(length))
        if old:
            assert old in edges
    from posextend.data.text import read_documents
    from posextend.scoring.text import pack, split

    tok = transformers.AutoTokenizer.from_pretrained(gpt)
    seqs = split(pack(tok, read_documents([corpus]), 32))[1][:4]
    model = transformers.AutoModelForCausalLM.from_pretrained(gpt)
    report = score_model(model, seqs, "causal", buckets=4)
    assert sum(b.tokens for b in report.buckets) == report.tokens == len(seqs) * 31


def _report(old: int, length: int, losses: list[float]):
    from posextend.scoring.by_position import Bucket, EvalReport

    edges = bucket_edges(length, len(losses), old_length=old)
    buckets = [Bucket(a, b, loss, math.exp(loss), 10 * (b - a)) for a, b, loss in zip(edges, edges[1:], losses)]
    return EvalReport("causal", length, 4, 0.0, 1.0, sum(b.tokens for b in buckets), buckets, old)


def test_far_range_gap_and_the_advice_line(monkeypatch):
    """128 -> 512: the far range is the last half (positions 256-511), weighted by tokens."""
    from posextend import cli
    from posextend.scoring.by_position import far_range_gap
    from posextend.terminal import far_range_advice

    before = _report(128, 512, [3.0, 6.0, 6.0, 6.0, 6.0])
    after = _report(128, 512, [3.1, 3.2, 3.2, 3.3, 3.5])  # buckets 0-127, 128-223, 224-319, 320-415, 416-511
    far, original, start = far_range_gap(before, after)
    assert start == 320 and original == pytest.approx(math.exp(3.0))
    assert far == pytest.approx(math.exp((3.3 * 960 + 3.5 * 960) / 1920))
    assert far_range_gap(before, _report(128, 192, [3.0, 3.0, 3.0])) is None  # extended less than 2x
    with cli.console.capture() as out:
        far_range_advice(cli.console, SimpleNamespace(before=before, after=after, train="new-rows", steps=150, strategy="tile"))
        far_range_advice(cli.console, SimpleNamespace(before=before, after=after, train="all", steps=150, strategy="tile"))
        far_range_advice(cli.console, SimpleNamespace(before=before, after=after, train="all", steps=150, strategy="kps"))
        far_range_advice(cli.console, SimpleNamespace(before=before, after=before, train="all", steps=150, strategy=None))
    lines = out.get().splitlines()
    assert lines[0].startswith("The far range (positions 320–511) is at perplexity 30.0, 49% above the original "
                               "range's 20.1") and lines[0].endswith("train every weight (--train all).")
    assert lines[1].endswith("start from --strategy interpolate.")
    assert lines[2].endswith("train longer (--steps 300).") and len(lines) == 4  # nothing to say when it is close
    assert "(positions 320–511) is at perplexity 403.4" in lines[3]


def test_eval_cli_json_and_plot(gpt, corpus, tmp_path):
    r = CliRunner().invoke(app, ["eval", str(gpt), "--data", str(corpus), "--buckets", "4", "--json",
                                 str(tmp_path / "e.json"), "--plot", str(tmp_path / "e.png")])
    assert r.exit_code == 0, r.output
    import json

    data = json.loads((tmp_path / "e.json").read_text())
    assert [b["start"] for b in data["buckets"]] == [0, 8, 16, 24] and data["objective"] == "causal"
    assert data["context_use"] is None and "Context:" not in r.output  # not extended: no old length to read past
    assert (tmp_path / "e.png").read_bytes()[:4] == b"\x89PNG"


def _no_tokenizer(src, tmp_path):
    import shutil

    out = tmp_path / "notok"
    shutil.copytree(src, out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).unlink()
    return out


@pytest.mark.parametrize(
    "case, args, message",
    [
        ("missing data", lambda g, c, t: [g, "--data", t / "nope.txt"], "does not exist"),
        ("empty corpus", lambda g, c, t: [g, "--data", (t / "e.txt", (t / "e.txt").write_text("  \n"))[0]], "holds no text"),
        ("too short", lambda g, c, t: [g, "--data", (t / "s.txt", (t / "s.txt").write_text("Too short."))[0]], "fewer than one sequence of 32"),
        ("no tokenizer", lambda g, c, t: [_no_tokenizer(g, t), "--data", c], "No usable tokenizer in"),
        ("no new rows", lambda g, c, t: [g, "--data", c, "--train", "new-rows"], "pass --length N above 32, or --old-length N for"),
        ("bad mode", lambda g, c, t: [g, "--data", c, "--train", "some"], "The train mode must be one of"),
        ("bad schedule", lambda g, c, t: [g, "--data", c, "--schedule", "linear"], "The schedule must be constant or cosine"),
    ],
)
def test_finetune_bad_input(gpt, corpus, tmp_path, case, args, message):
    src, *rest = args(gpt, corpus, tmp_path)
    rest = [*rest, "--train", "all"] if "--train" not in rest else rest
    r = CliRunner().invoke(app, ["finetune", str(src), str(tmp_path / "dst"), *map(str, rest), "--steps", "2"])
    assert r.exit_code == 1 and message in r.output, r.output
    assert not (tmp_path / "dst").exists() and not (tmp_path / "dst.state").exists()


def test_model_without_head_needs_init_head(minilm, corpus, tmp_path):
    with pytest.raises(posextend.TrainingError, match="has no masked-LM head .* pass init_head=True"):
        finetune(minilm, tmp_path / "out", [corpus], length=600, steps=1, objective="masked")


def test_contrastive_is_the_default_for_sentence_transformers_and_new_rows_keep_short_inputs(minilm, corpus, tmp_path):
    """The real all-MiniLM-L6-v2, 512 -> 640: passages from anywhere in a window retrieve it."""
    from sentence_transformers import SentenceTransformer

    report = finetune(minilm, tmp_path / "out", [corpus], length=640, steps=3, batch_size=2, train="new-rows",
                      eval_sequences=2, buckets=4, seed=0)
    assert report.objective == "contrastive" and (report.old_length, report.new_length) == (512, 640)
    assert report.after.accuracy is not None and 0 <= report.after.accuracy <= 1
    assert [b.accuracy is not None for b in report.after.buckets] == [True] * len(report.after.buckets)
    assert report.after.buckets[-1].end == 640 and report.tokens == 3 * 2 * 638
    tuned = SentenceTransformer(str(tmp_path / "out"), device="cpu")
    original = SentenceTransformer(str(minilm), device="cpu")
    assert tuned.max_seq_length == 640 and [type(m).__name__ for m in tuned] == [type(m).__name__ for m in original]
    table = tuned[0].auto_model.embeddings.position_embeddings.weight
    assert table.shape == (640, 384)
    assert torch.equal(table[:512], original[0].auto_model.embeddings.position_embeddings.weight)
    short = ["A quiet village by the sea, with a small harbour.", "A short sentence."]
    assert torch.equal(tuned.encode(short, convert_to_tensor=True), original.encode(short, convert_to_tensor=True))
    assert "Held-out retrieval accuracy@1 after" in (tmp_path / "out" / "README.md").read_text()
    # attention dropout is off while training (fused attention kernels), never in the written model
    assert tuned[0].auto_model.config.attention_probs_dropout_prob == 0.1


def test_contrastive_refuses_a_model_that_is_no_sentence_transformer(gpt, corpus, tmp_path):
    with pytest.raises(posextend.TrainingError, match="not a sentence-transformers model"):
        finetune(gpt, tmp_path / "out", [corpus], steps=1, objective="contrastive")


def test_a_family_without_a_written_spec_is_fine_tuned_through_the_probe(corpus, tmp_path):
    """MPNet has no written spec: the fine-tune finds its table (2 reserved rows) on a twin."""
    from tiny import bert_tokenizer

    cfg = transformers.MPNetConfig(vocab_size=30527, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                   intermediate_size=48, max_position_embeddings=34, pad_token_id=1)
    assert "mpnet" not in posextend.SPECS
    src = tmp_path / "mpnet"
    torch.manual_seed(0)
    transformers.MPNetForMaskedLM(cfg).save_pretrained(src)
    bert_tokenizer(32).save_pretrained(src)
    report = finetune(src, tmp_path / "out", [corpus], length=64, strategy="interpolate", steps=4, train="new-rows",
                      batch_size=2, seed=0)
    assert (report.old_length, report.new_length) == (32, 64)
    before, after = _state(src), _state(tmp_path / "out")
    name = "mpnet.embeddings.position_embeddings.weight"
    assert after[name].shape == (66, 16)
    assert torch.equal(after[name][:2], before[name][:2])  # the reserved rows
    model = transformers.MPNetForMaskedLM.from_pretrained(tmp_path / "out")
    assert model.config.max_position_embeddings == 66
    with torch.no_grad():
        assert model(input_ids=torch.full((1, 64), 2000)).logits.shape == (1, 64, 30527)


def test_contrastive_anchor_keeps_short_inputs_near_the_source(corpus, tmp_path):
    """Training every parameter moves short inputs; the anchor term pulls them back towards the source's (a tiny
    sentence-transformers twin, 64 -> 160 positions; the real MiniLM's run is the test above)."""
    from sentence_transformers import SentenceTransformer

    from posextend.training.objectives import base as objectives
    from posextend.training.objectives import register_objective
    from posextend.training.objectives.contrastive import Contrastive

    src = sentence_transformer(tmp_path)
    register_objective("contrastive-no-anchor", description="The contrastive objective without its anchor term.")(
        type("NoAnchor", (Contrastive,), {"anchor": 0.0}))
    try:
        kwargs = dict(length=160, steps=4, batch_size=2, train="all", lr=3e-3, eval_sequences=2, buckets=2, seed=0)
        anchored = finetune(src, tmp_path / "anchored", [corpus], **kwargs)
        free = finetune(src, tmp_path / "free", [corpus], objective="contrastive-no-anchor", **kwargs)
    finally:
        objectives._REGISTRY.items.pop("contrastive-no-anchor")
    assert anchored.steps == free.steps == 4 and anchored.lr == 3e-3
    assert (anchored.anchor, anchored.schedule, free.anchor) == (2.0, "cosine", 0.0)
    texts = [corpus.read_text()[i : i + n] for i, n in ((0, 80), (5000, 160), (20000, 200))]  # within 64 tokens
    source = SentenceTransformer(str(src), device="cpu").encode(texts, convert_to_tensor=True)

    def cosine(path):
        tuned = SentenceTransformer(str(path), device="cpu").encode(texts, convert_to_tensor=True)
        return float(torch.nn.functional.cosine_similarity(tuned, source).mean())

    assert cosine(tmp_path / "free") < cosine(tmp_path / "anchored") < 1.0



def test_causal_anchor_keeps_the_old_range_near_the_source(gpt, corpus, tmp_path):
    """The default causal fine-tune (interpolate, anchor 1) keeps the old range's predictions closer
    to the source's than the same run with the anchor off."""
    kwargs = dict(length=64, steps=6, batch_size=2, train="all", lr=3e-3, eval_sequences=2, seed=0)
    anchored = finetune(gpt, tmp_path / "anchored", [corpus], **kwargs)
    plain = finetune(gpt, tmp_path / "plain", [corpus], anchor=0, **kwargs)
    assert (anchored.objective, anchored.strategy, anchored.anchor) == ("causal", "interpolate", 1.0)
    assert (plain.strategy, plain.anchor) == ("interpolate", 0.0)
    again = finetune(tmp_path / "plain", tmp_path / "again", [corpus], steps=1, train="all")
    assert again.strategy is None  # came extended
    width = transformers.AutoConfig.from_pretrained(gpt).n_embd
    assert (again.lr, again.schedule) == (get_objective("causal").default_lr("all", width), "cosine")
    assert (anchored.lr, anchored.schedule) == (3e-3, "cosine")  # a given lr is kept
    tok = transformers.AutoTokenizer.from_pretrained(gpt)
    ids = tok(corpus.read_text()[:3000], return_tensors="pt")["input_ids"][:, :32]  # within the old length

    def log_probs(path):
        with torch.no_grad():
            return transformers.AutoModelForCausalLM.from_pretrained(path)(ids).logits.log_softmax(-1)

    source = log_probs(gpt)

    def kl(path):
        return float(torch.nn.functional.kl_div(log_probs(path), source, log_target=True, reduction="batchmean"))

    assert 0 < kl(tmp_path / "anchored") < kl(tmp_path / "plain")


def test_anchor_weight_is_checked(gpt, bert, corpus, tmp_path):
    with pytest.raises(posextend.TrainingError, match="must be a finite number >= 0, got -1"):
        finetune(gpt, tmp_path / "a", [corpus], length=64, steps=1, anchor=-1)
    with pytest.raises(posextend.TrainingError, match="The masked objective has no anchor term"):
        finetune(bert, tmp_path / "b", [corpus], length=64, steps=1, anchor=1.0)
    with pytest.raises(posextend.TrainingError, match="The window anchor weight must be a finite number >= 0, got nan"):
        finetune(gpt, tmp_path / "a", [corpus], length=64, steps=1, window_anchor=float("nan"))
    with pytest.raises(posextend.TrainingError, match="The masked objective has no window anchor term to weight"):
        finetune(bert, tmp_path / "b", [corpus], length=64, steps=1, window_anchor=1.0)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_own_window_kl_is_the_kl_from_the_models_own_windowed_reading():
    """``own_window_kl``: the KL, over the tokens past the old length, of the whole reading's predictions from the
    same model's through the sliding window the control reads with (``by_position.windows``), computed here one
    window at a time, with or without ``logits_to_keep``: the mean over every token, or (the default) the sum over
    the tokens the window gives the higher probability over all of them; 0 for a sequence no longer than the old
    length."""
    from posextend.scoring.by_position import windows
    from posextend.training.objectives.causal import keeps_logits, own_window_kl

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=50, n_positions=48, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).eval()
    batch = torch.randint(0, 50, (3, 48))
    with torch.no_grad():
        whole = model(input_ids=batch).logits
    kls = []
    for first, start, end in windows(48, 16):
        if start < 16:
            continue
        with torch.no_grad():
            read = model(input_ids=batch[:, first:end]).logits[:, start - 1 - first:end - 1 - first]
        kls.append(torch.nn.functional.kl_div(whole[:, start - 1:end - 1].log_softmax(-1), read.log_softmax(-1),
                                              log_target=True, reduction="none").sum(-1))
    expected = torch.cat(kls, 1)
    assert expected.shape == (3, 32)  # tokens 16..47, each once
    assert keeps_logits(model)
    for keep in (True, False):
        every = own_window_kl(model, batch, whole, 16, keep_logits=keep, harm_only=False)
        assert float(every) == pytest.approx(float(expected.mean()), rel=1e-5)
    # by default only the tokens the window reads better count (the sum over them, over all 32)
    token = batch[:, 16:, None]
    whole_p = whole[:, 15:47].log_softmax(-1).gather(-1, token)[..., 0]
    window_p = torch.cat([model(input_ids=batch[:, first:end]).logits[:, start - 1 - first:end - 1 - first]
                          for first, start, end in windows(48, 16) if start >= 16], 1).log_softmax(-1).gather(-1, token)[..., 0]
    harmed = (window_p > whole_p).float()
    assert 0 < float(harmed.mean()) < 1
    assert float(own_window_kl(model, batch, whole, 16)) == pytest.approx(float((expected * harmed).sum() / 96), rel=1e-4)
    assert float(expected.mean()) > 1e-3  # the whole reading is not the windowed one here
    assert float(own_window_kl(model, batch[:, :16], whole[:, :16], 16)) == 0.0  # nothing past the old length


def test_window_anchor_holds_the_new_range_to_the_models_own_window(gpt, corpus, tmp_path):
    """The default causal fine-tune weights its window anchor 1 (the report says so; 0 for a run at the old length,
    which adds no term); after the same steps, its new range's predictions are closer to its own reading through the
    old window than the same run's without it."""
    from posextend.training.objectives.causal import own_window_kl

    kwargs = dict(length=128, steps=8, batch_size=2, lr=3e-3, eval_sequences=2, seed=0)
    held = finetune(gpt, tmp_path / "held", [corpus], **kwargs)
    free = finetune(gpt, tmp_path / "free", [corpus], window_anchor=0, **kwargs)
    assert (held.window_anchor, free.window_anchor, held.anchor, free.anchor) == (1.0, 0.0, 1.0, 1.0)
    assert held.to_dict()["window_anchor"] == 1.0 and held.steps == free.steps == 8
    same = finetune(gpt, tmp_path / "same", [corpus], **{**kwargs, "length": 32, "steps": 1})
    assert same.window_anchor == 0.0  # no new positions: no term, and the report does not claim one
    tok = transformers.AutoTokenizer.from_pretrained(gpt)
    ids = tok(corpus.read_text()[-20000:], return_tensors="pt")["input_ids"][:, :128]

    def kl(path):
        model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        with torch.no_grad():
            return float(own_window_kl(model, ids, model(input_ids=ids).logits, 32))

    assert kl(tmp_path / "held") < kl(tmp_path / "free")


def test_the_objectives_hooks_are_called_in_the_order_setup_writes_down(gpt, corpus, tmp_path, monkeypatch):
    """``setup``'s docstring lists the objective's hooks in the order a fine-tune calls them: a causal run that
    extends, anchored, with a baseline and checks, calls each hook first in that order."""
    import re

    from posextend.training import setup as setup_module
    from posextend.training.objectives.base import Objective

    objective = get_objective("causal")
    hooks = [name for name, value in vars(Objective).items() if callable(value) and not name.startswith("_")
             and not isinstance(value, (type, staticmethod, classmethod))]
    called: list[str] = []

    def recording(name, method):
        def hook(*args, **kwargs):
            called.append(name)
            return method(*args, **kwargs)
        return hook

    for name in hooks:
        monkeypatch.setattr(type(objective), name, recording(name, getattr(type(objective), name)))
    finetune(gpt, tmp_path / "out", [corpus], objective="causal", length=48, steps=2, eval_every=1, eval_sequences=2,
             seed=0)
    documented = list(dict.fromkeys(re.findall(r"``(\w+)``", setup_module.setup.__doc__)))
    first = list(dict.fromkeys(called))
    assert {"documents", "load", "size_processor", "samples", "baseline", "loss", "evaluate", "notes"} <= set(first)
    assert [h for h in documented if h in first] == first, (documented, first)


class _Induction(torch.nn.Module):
    """A causal LM that copies: after a token it saw before, it predicts what followed its last earlier occurrence
    (an induction head written out), else a uniform guess; with ``copies=False`` always the uniform guess."""

    def __init__(self, vocab: int, copies: bool = True):
        super().__init__()
        self.vocab, self.copies, self.unused = vocab, copies, torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, **kwargs):
        logits = torch.zeros(*input_ids.shape, self.vocab)
        for b, row in enumerate(input_ids.tolist()):
            last: dict[int, int] = {}
            for t, token in enumerate(row):
                if self.copies and token in last and last[token] + 1 < len(row):
                    logits[b, t, row[last[token] + 1]] = 20.0
                last[token] = t
        return transformers.modeling_outputs.CausalLMOutput(logits=logits)


def test_the_window_anchor_is_off_for_a_source_that_copies_within_its_window(gpt):
    """``CausalLM.window_anchor_for``: a source that copies a passage repeated within its window (the probe read
    within it) may learn to copy past it, so the window anchor is off, and the line says why; one that reads no
    context keeps the objective's weight; an old length too short for the probe keeps it too, with nothing said."""
    tok = transformers.AutoTokenizer.from_pretrained(gpt)
    held_out = torch.randint(0, len(tok), (4, 256))
    causal = get_objective("causal")
    weight, note = causal.window_anchor_for(_Induction(len(tok)), tok, held_out, 128)
    assert weight == 0.0 and note.startswith("window anchor off: the source uses its context within its window (")
    weight, note = causal.window_anchor_for(_Induction(len(tok), copies=False), tok, held_out, 128)
    assert weight == 1.0 and note.startswith("window anchor 1: the source does not use its context within its window")
    assert causal.window_anchor_for(_Induction(len(tok)), tok, held_out, 16) == (1.0, "")
