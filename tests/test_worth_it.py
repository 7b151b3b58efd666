"""A fine-tune that knows when the extension is worth it: the baseline, the held-out split, the budget, the verdict."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
from typer.testing import CliRunner

from posextend.cli import app
from posextend.data.heldout import held_out_note, split_documents
from posextend.data.text import read_documents
from posextend.errors import DataError, TrainingError
from posextend.scoring.by_position import position_losses
from posextend.scoring.text import pack
from posextend.scoring.verdict import Point, Reading, Verdict, beats, far_start, holds, plot_verdict
from posextend.training.budget import PATIENCE, Budget, Judge, Schedule, parse_budget
from posextend.training.loop import finetune
from posextend.training.objectives import get_objective
from posextend.training.options import FinetuneConfig

QUICK = dict(batch_size=2, train="all", eval_sequences=4, buckets=2, seed=0)


def test_budgets_read_as_users_write_them():
    assert parse_budget("15min").seconds == 900
    assert parse_budget("1.5h").seconds == 5400
    assert parse_budget("90s").seconds == 90
    assert parse_budget("20M tokens").tokens == 20_000_000
    assert parse_budget("500k tokens").tokens == 500_000
    assert parse_budget("2000 steps").steps == 2000
    for bad in ("fast", "15", "0min", "1.5 steps", "-3min", "10M steps"):
        with pytest.raises(TrainingError, match="Cannot read the budget"):
            parse_budget(bad)
    judge = Judge(parse_budget("1000 tokens"), early=True, tokens_per_step=64)
    assert judge.steps == 16  # ceil(1000 / 64)


def test_schedule_warms_up_then_decays_to_a_tenth():
    cosine = Schedule(100, "cosine")
    assert cosine(0) == pytest.approx(0.1) and cosine(9) == pytest.approx(1.0)
    assert cosine(55) == pytest.approx(0.55, abs=0.01) and cosine(100) == pytest.approx(0.1)
    assert cosine(500) == pytest.approx(0.1)  # past its steps (a budget that ran longer): stays at the floor
    assert Schedule(100, "constant")(80) == 1.0


def test_beats_and_holds_for_a_perplexity_and_an_accuracy():
    assert beats(98.9, 100, 0.01) and not beats(99.5, 100, 0.01)
    assert holds(101.9, 100, 0.02) and not holds(102.1, 100, 0.02)
    # accuracies: higher is better; the margin is on the error rate
    assert beats(0.61, 0.5, 0.1, higher=True) and not beats(0.5, 0.5, 0.0, higher=True)
    assert holds(0.99, 1.0, 0.02, higher=True) and not holds(0.97, 1.0, 0.02, higher=True)
    assert not beats(float("nan"), 100, 0.01)
    verdict = Verdict(Reading(100.0, 50.0), Reading(95.0, 50.5), "the source through its own 64-token window")
    assert verdict.worth_it and verdict.far_ratio == pytest.approx(0.95) and verdict.original_change == pytest.approx(0.01)
    assert verdict.text.startswith("worth it: far range perplexity 95.0 against 100.0 for the source")
    worse = Verdict(Reading(100.0, 50.0), Reading(95.0, 52.0), "x", budget="1min")
    assert not worse.worth_it and worse.text.startswith("not yet worth it within the budget")
    assert far_start(256, 64) == 128 and far_start(96, 64) == 64


def test_a_reading_without_an_original_range_is_judged_on_its_far_range_and_controls(tmp_path):
    """A vision tower read at its new size alone (the original ranges NaN): worth it when it beats the source and the
    control by the margin, with no original range to keep, said or drawn."""
    nan = float("nan")
    base, read = Reading(0.70, nan, "accuracy", True), Reading(0.80, nan, "accuracy", True)
    verdict = Verdict(base, read, "the source at its own 16x16 px", controls={"the same model at 16x16 px": Reading(
        0.40, 0.40, "accuracy", True)})
    assert verdict.worth_it and not verdict.has_original and verdict.original_holds
    assert verdict.text == ("worth it: far range accuracy 0.800 against 0.700 for the source at its own 16x16 px and "
                            "0.400 for the same model at 16x16 px")
    assert not Verdict(base, Reading(0.70, nan, "accuracy", True), "x").worth_it  # no better: the far range decides
    loses = Verdict(base, read, "x", controls={"the same model at 16x16 px": Reading(0.80, 0.80, "accuracy", True)})
    assert not loses.worth_it and loses.context_loses_to == "the same model at 16x16 px"
    # one side NaN is a reading that failed, not a missing range: it does not hold
    assert not Verdict(Reading(0.70, 0.70, "accuracy", True), read, "x").original_holds
    assert plot_verdict(Verdict(base, read, "x", curve=[Point(0, 0.0, 0.7, nan), Point(5, 1.0, 0.8, nan)]),
                        tmp_path / "v.png").stat().st_size > 5_000


def test_a_far_range_of_several_tasks_is_worth_it_only_when_no_task_is_worse_than_the_baselines(tmp_path):
    """An embedding model's far range is passkey and needle, each protocol: a mean that wins can hide a task that
    loses to chunk-and-average, so that task holds the verdict (and the run's stop) back, and the text names it;
    a task both read equally (at its floor) does not."""
    base = Reading(0.2, 0.5, "accuracy", True, parts={"shared needle": 0.1, "varied needle": 0.3})
    mixed = Reading(0.55, 0.8, "accuracy", True, parts={"shared needle": 0.9, "varied needle": 0.2})
    verdict = Verdict(base, mixed, "chunks", budget="15min")
    assert beats(mixed.far, base.far, verdict.margin, higher=True) and not verdict.far_wins and not verdict.worth_it
    assert verdict.text == ("not yet worth it within the budget: far range accuracy 0.550 against 0.200 for chunks "
                            "(but varied needle 0.200 against 0.300); original range 0.800 against 0.500 (+60.0%)")
    both = Reading(0.6, 0.8, "accuracy", True, parts={"shared needle": 0.9, "varied needle": 0.3})  # even there
    assert Verdict(base, both, "chunks").worth_it and "but" not in Verdict(base, both, "chunks").text
    slightly = Reading(0.6, 0.8, "accuracy", True, parts={"shared needle": 0.9, "varied needle": 0.29})
    assert not Verdict(base, slightly, "chunks").worth_it  # 3.3% worse: past the 2% tolerance
    judge = Judge(parse_budget("100s"), early=True, baseline=base)
    assert not any(judge.record(step, mixed) for step in (1, 2, 3))  # never a win: the run goes on
    assert not judge.record(4, both) and judge.best.step == 4 and judge.wins == 1  # better, and worth it
    assert judge.curve[0].parts == mixed.parts and judge.curve[-1].parts == both.parts  # each task's curve, plotted
    assert plot_verdict(judge.verdict(both), tmp_path / "parts.png").stat().st_size > 10_000
    assert json.loads(json.dumps(Verdict(base, mixed, "x").to_dict()))["reading"]["parts"]["varied needle"] == 0.2


def test_held_out_documents_are_whole_seeded_and_never_trained_on():
    docs = [f"document {i} " * (100 + i) for i in range(40)]
    train, held = split_documents(docs, share=0.05, seed=3)
    assert set(train).isdisjoint(held) and all(d in docs for d in held)  # whole documents
    assert sorted(train + held) == sorted(docs)
    assert 0.05 <= sum(map(len, held)) / sum(map(len, docs)) < 0.1
    assert split_documents(docs, share=0.05, seed=3) == (train, held)
    assert split_documents(docs, share=0.05, seed=4)[1] != held
    # one long document: its tail, cut at a paragraph, is held out
    text = "\n\n".join(f"Paragraph {i}. " + "word " * 50 for i in range(200))
    (rest,), (tail,) = split_documents([text], share=0.05)
    assert rest + tail == text and tail.startswith("Paragraph") and 0.04 < len(tail) / len(text) < 0.07
    # several documents too long for the share: the smallest is held out whole, never its tail (the tail of a
    # document whose names and people the run trains on reads kinder than text the model never saw)
    novels = [text, text[: len(text) // 2], text + text, text[: len(text) // 3]]
    train, held = split_documents(novels, share=0.05)
    assert held == [novels[3]] and sorted(map(len, train)) == sorted(map(len, novels[:3]))
    assert held_out_note(novels, held).startswith("held out: 1 whole document(s) (")
    # two documents of a size: a whole one would be half the data, so the tail of one is held out, and the note says so
    two = [text, text.replace("Paragraph", "Section")]
    train, (tail,) = split_documents(two, share=0.05)
    assert any(d.endswith(tail) and d != tail for d in two) and len(train) == 2
    assert held_out_note(two, [tail]).startswith("held out: the tail of a document the run trains on")
    # records of pairs are held out whole: one record cannot be split
    assert split_documents([("a b", "c")] * 40, share=0.05)[1] == [("a b", "c")] * 2
    with pytest.raises(DataError, match="too little"):
        split_documents([("a document", "its summary")])


def test_the_source_window_reads_each_far_token_with_its_own_length_of_context():
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=1, n_head=2)).eval()
    seqs = torch.randint(50, (3, 64))
    total, count = position_losses(model, seqs, "causal", window=16)
    # by hand: the block of positions 40-47 is read by the window 32-47
    with torch.no_grad():
        logits = model(input_ids=seqs[:, 32:48]).logits
    by_hand = torch.nn.functional.cross_entropy(logits[:, 7:15].transpose(1, 2), seqs[:, 40:48], reduction="sum")
    assert float(total[40:48].sum()) == pytest.approx(float(by_hand), rel=1e-5)
    assert count[1:].tolist() == [3.0] * 63 and count[0] == 0
    whole = position_losses(model, seqs[:, :16], "causal")
    assert torch.allclose(total[:16], whole[0])  # the first window reads the start as the model does



def test_position_losses_are_the_models_own_losses():
    """Summed over positions, the causal losses are transformers' own loss (the mean over shifted tokens); the masked
    ones are the masked tokens' (a 500-token vocabulary, so that a wrong row or label is far off)."""
    torch.manual_seed(0)
    gpt = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=500, n_positions=32, n_embd=32, n_layer=1,
                                                               n_head=2)).eval()
    seqs = torch.randint(500, (3, 32))
    total, count = position_losses(gpt, seqs, "causal")
    with torch.no_grad():
        expected = gpt(input_ids=seqs, labels=seqs).loss
    assert count.tolist() == [0.0] + [3.0] * 31
    assert float(total.sum() / count.sum()) == pytest.approx(float(expected), rel=1e-5)
    from posextend.scoring.by_position import token_losses

    logits, labels = torch.randn(2, 5, 500), torch.randint(500, (2, 5))
    labels[0, 1] = -100
    by_hand = torch.stack([torch.stack([torch.logsumexp(logits[b, t], 0) - logits[b, t, labels[b, t]]
                                        if labels[b, t] >= 0 else torch.tensor(0.0) for t in range(5)]) for b in range(2)])
    assert torch.allclose(token_losses(logits, labels), by_hand, atol=1e-5)

def test_a_run_measures_the_source_window_on_held_out_text(gpt, corpus, tmp_path):
    held = tmp_path / "held.txt"
    held.write_text(corpus.read_text()[-8000:])
    report = finetune(gpt, tmp_path / "out", [corpus], eval_data=[held], length=64, steps=2, anchor=0, **QUICK)
    verdict = report.verdict
    assert verdict is not None and report.steps == 2 and verdict.budget is None
    # the baseline, recomputed: the source reading the held-out sequences through its 32-token window
    source = transformers.AutoModelForCausalLM.from_pretrained(gpt)
    seqs = pack(transformers.AutoTokenizer.from_pretrained(gpt), read_documents([held]), 64)[:4]
    total, count = position_losses(source, seqs, "causal", window=32)
    assert verdict.baseline.far == pytest.approx(math.exp(float(total[32:].sum() / count[32:].sum())), rel=1e-4)
    assert verdict.baseline.original == pytest.approx(math.exp(float(total[:32].sum() / count[:32].sum())), rel=1e-4)
    assert [p.step for p in verdict.curve][0] == 0 and verdict.curve[-1].step == 2
    saved = json.loads((tmp_path / "out" / "posextend_eval.json").read_text())["verdict"]
    assert saved["baseline"]["far"] == pytest.approx(verdict.baseline.far) and saved["worth_it"] == verdict.worth_it
    assert f"Verdict: {verdict.text}" in (tmp_path / "out" / "README.md").read_text()


def test_too_small_a_budget_says_not_yet(gpt, corpus, tmp_path):
    report = finetune(gpt, tmp_path / "out", [corpus], length=64, budget="1 steps", lr=1e-7, strategy="random", **QUICK)
    assert report.steps == 1 and report.verdict is not None and not report.verdict.worth_it
    assert report.verdict.text.startswith("not yet worth it within the budget: far range perplexity")


def test_a_model_whose_context_cannot_help_is_never_worth_it(gpt, corpus, tmp_path):
    """A case built to fail: a tiny model trained briefly on prose reads far tokens no better with 64 tokens of
    context than through a 32-token window of itself. Training gains it everything over the untrained source, so a
    verdict against the source alone said worth it; against its control it says the longer context did not help,
    and the run spends its whole budget."""
    report = finetune(gpt, tmp_path / "out", [corpus], length=64, budget="30 steps", lr=3e-3, anchor=0, eval_every=5,
                      **QUICK)
    verdict, name = report.verdict, "the same model through a 32-token window"
    assert verdict.far_wins and verdict.reading.far < 0.7 * verdict.baseline.far  # the training's gain
    assert not verdict.worth_it and verdict.context_loses_to == name and report.steps == 30
    assert verdict.text.startswith("the fine-tune helped, the longer context did not: far range perplexity ")
    assert f"with the whole context against {verdict.controls[name].far:.1f} for {name}" in verdict.text
    assert verdict.advice == "fine-tune at the old length instead, or train longer on documents longer than 32 tokens"
    # the control, recomputed: the written model reading the held-out sequences through its old window
    checks = [p for p in verdict.curve if p.controls]
    assert checks and all(p.far > (1 - verdict.margin) * p.controls[name] for p in checks)  # read at every check won
    saved = json.loads((tmp_path / "out" / "posextend_eval.json").read_text())["verdict"]
    assert saved["controls"][name]["far"] == pytest.approx(verdict.controls[name].far)
    assert saved["context_loses_to"] == name
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"Verdict: {verdict.text}: {verdict.advice}" in card


def test_the_exact_control_is_the_source_fine_tuned_at_its_length_on_the_same_tokens(gpt, corpus, tmp_path):
    """train_control: the source, fine-tuned at its own 32 positions on the run's training text and as many tokens
    (4 steps of 2 x 64 = 8 steps of 2 x 32), read through its window on the run's held-out text: what a user gets
    without extending. It is the same model as a fine-tune of the source without length, with those steps."""
    held = tmp_path / "held.txt"
    held.write_text(corpus.read_text()[-8000:])
    common = dict(eval_data=[held], anchor=0, lr=3e-3, schedule="cosine", **QUICK)
    report = finetune(gpt, tmp_path / "out", [corpus], length=64, steps=4, train_control=True, **common)
    name = "the source fine-tuned at its own length on the same tokens, read the same way"
    assert list(report.verdict.controls) == ["the same model through a 32-token window", name]
    assert report.tokens == 4 * 2 * 64
    plain = finetune(gpt, tmp_path / "plain", [corpus], steps=8, **common)
    assert plain.tokens == report.tokens and plain.new_length == 32
    trained = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain")
    seqs = pack(transformers.AutoTokenizer.from_pretrained(gpt), read_documents([held]), 64)[:4]
    total, count = position_losses(trained, seqs, "causal", window=32)
    far = math.exp(float(total[32:].sum() / count[32:].sum()))
    assert report.verdict.controls[name].far == pytest.approx(far, rel=1e-3)
    assert f"and {report.verdict.controls[name].far:.1f} for {name}" in report.verdict.text
    with pytest.raises(TrainingError, match="its control is the source itself"):
        finetune(gpt, tmp_path / "x", [corpus], length=64, steps=1, train="new-rows", train_control=True)


def test_an_extended_lm_takes_as_many_tokens_per_step_as_four_sequences_of_its_old_length(gpt, corpus, tmp_path):
    """No batch given: at 4x one sequence a step (4 x 32 tokens), at 2x two, at its own length the objective's 4; with
    the window anchor off (a source that copies within its window) 4; a batch given is kept. The exact control trains at the old length as a user would there (4 x 32): as many tokens
    in as many steps, the same model as a plain fine-tune of the source with those steps."""
    causal, masked = get_objective("causal"), get_objective("masked")
    assert [causal.batch_size_for(32, new) for new in (32, 64, 128, 256, 48)] == [4, 2, 1, 1, 3]
    assert masked.batch_size_for(32, 128) == 4 and causal.with_window_anchor(0).batch_size_for(32, 128) == 4
    assert FinetuneConfig(batch_size=8).with_batch_size(causal, 32, 128).batch_size == 8
    held = tmp_path / "held.txt"
    held.write_text(corpus.read_text()[-8000:])
    common = dict(eval_data=[held], anchor=0, lr=3e-3, schedule="cosine", train="all", eval_sequences=4, buckets=2)
    report = finetune(gpt, tmp_path / "out", [corpus], length=128, steps=3, train_control=True, **common)
    assert (report.batch_size, report.tokens) == (1, 3 * 1 * 128)
    off = finetune(gpt, tmp_path / "off", [corpus], length=128, steps=1, window_anchor=0, **common)
    assert (off.batch_size, off.tokens) == (4, 4 * 128)
    plain = finetune(gpt, tmp_path / "plain", [corpus], steps=3, **common)
    assert (plain.batch_size, plain.tokens, plain.new_length) == (4, report.tokens, 32)
    trained = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain")
    seqs = pack(transformers.AutoTokenizer.from_pretrained(gpt), read_documents([held]), 128)[:4]
    total, count = position_losses(trained, seqs, "causal", window=32)
    start = far_start(128, 32)
    far = math.exp(float(total[start:].sum() / count[start:].sum()))
    name = "the source fine-tuned at its own length on the same tokens, read the same way"
    assert report.verdict.controls[name].far == pytest.approx(far, rel=1e-3)


def test_the_control_is_read_once_the_baseline_is_beaten_and_must_be_beaten_too(tmp_path):
    """The stop rule: worth it at two checks in a row against the baseline and the model's own control; the
    control costs a reading, so a check reads it only when the baseline is beaten."""
    name = "the same model through a 64-token window"
    judge = Judge(parse_budget("100 steps"), early=True, baseline=Reading(100.0, 50.0), margin=0.03, control_name=name,
                  baseline_name="the source model",
                  old_length=64)
    reads = []

    def control(far):
        return lambda: reads.append(far) or Reading(far, 50.0)

    assert not judge.record(1, Reading(99.0, 50.0), control(90.0)) and reads == []  # the baseline still wins
    assert not judge.record(2, Reading(95.0, 50.0), control(95.5)) and reads == [95.5]  # the control holds it back
    assert not judge.record(3, Reading(95.0, 50.0), control(95.5)) and judge.wins == 0
    verdict = judge.verdict(Reading(95.0, 50.0))
    assert not verdict.worth_it and verdict.far_wins and verdict.context_loses_to == name
    assert verdict.text == ("the fine-tune helped, the longer context did not: far range perplexity 95.0 with the whole "
                            "context against 95.5 for the same model through a 64-token window (100.0 for the source "
                            "model); original range 50.0 against 50.0 (+0.0%)")
    assert not judge.record(4, Reading(90.0, 50.0), control(95.0)) and not judge.record(5, Reading(90.0, 50.0), control(95.0))
    assert judge.wins == 2 and judge.best.step == 4  # worth it twice, and the run goes on while it improves
    assert [p.controls for p in judge.curve] == [{}, {name: 95.5}, {name: 95.5}, {name: 95.0}, {name: 95.0}]
    verdict = judge.verdict(Reading(90.0, 50.0))
    assert verdict.worth_it and verdict.advice is None
    assert verdict.text == ("worth it: far range perplexity 90.0 against 100.0 for the source model and 95.0 for the same "
                            "model through a 64-token window; original range 50.0 against 50.0 (+0.0%)")
    assert plot_verdict(verdict, tmp_path / "controls.png").stat().st_size > 10_000
    # an accuracy: the control's parts hold the verdict back as the baseline's do
    base = Reading(0.2, 0.5, "accuracy", True, parts={"needle": 0.1, "passkey": 0.3})
    chunks = Reading(0.5, 0.5, "accuracy", True, parts={"needle": 0.2, "passkey": 0.8})
    whole = Reading(0.6, 0.8, "accuracy", True, parts={"needle": 0.5, "passkey": 0.7})
    assert not Verdict(base, whole, "chunks", controls={"own chunks": chunks}).worth_it  # passkey 0.7 against 0.8
    assert Verdict(base, whole, "chunks").worth_it


def test_the_cli_and_eval_give_the_verdict(gpt, corpus, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["finetune", str(gpt), str(out), "--data", str(corpus), "--length", "64",
                                      "--budget", "2 steps", "--batch-size", "2", "--plot", str(tmp_path / "run.png")])
    assert result.exit_code == 0, result.output
    line = next(x for x in result.output.splitlines() if "worth it" in x)
    assert "far range perplexity" in line and "for the source through its own 32-token window" in line
    assert (tmp_path / "run.png").stat().st_size > 10_000
    result = CliRunner().invoke(app, ["eval", str(out), "--data", str(corpus)])
    assert result.exit_code == 0, result.output
    assert "the source through its own 32-token window" in result.output  # read from the provenance's original


def test_masked_and_seq2seq_name_their_baselines(bert, corpus, tmp_path):
    from tiny import bart

    report = finetune(bert, tmp_path / "bert", [corpus], length=64, steps=1, **QUICK)
    assert report.verdict.baseline_name == "the source through its own 32-token window"
    assert report.verdict.baseline.metric == report.after.metric and report.verdict.baseline.far > 1
    source = bart(tmp_path / "bart", positions=64)
    report = finetune(source, tmp_path / "bart-out", [corpus], length=128, steps=1, **QUICK)
    baseline = report.verdict.baseline
    assert report.verdict.baseline_name == "the source reading the text in its own 64-token windows"
    assert baseline.far == baseline.original > 1 and baseline.metric == "masked-sentence perplexity"


def test_eval_of_a_resized_checkpoint_gives_the_verdict_of_the_resize_alone(gpt, corpus, tmp_path):
    import posextend

    posextend.resize_checkpoint(gpt, tmp_path / "tiled", 64, "tile", seed=0)
    report = posextend.evaluate(tmp_path / "tiled", [corpus], max_sequences=4)
    assert report.verdict is not None and report.verdict.budget is None
    # tile keeps the old rows: the original range reads as the source reads it, to float precision
    assert report.verdict.reading.original == pytest.approx(report.verdict.baseline.original, rel=1e-4)
    assert json.loads(json.dumps(report.to_dict()))["verdict"]["baseline"]["far"] == report.verdict.baseline.far


def test_checks_keep_to_their_share_of_the_run():
    import time

    judge = Judge(Budget("40 steps", steps=40), early=False, baseline=Reading(100.0, 50.0))
    assert [s for s in range(1, 41) if judge.check_due(s, 40)] == list(range(2, 41, 2))  # CHECKS over the steps
    judge.check(0, lambda: time.sleep(0.05) or Reading(120.0, 50.0))  # a reading as slow as the run so far
    assert judge.checking >= 0.05 and judge.curve[-1].far == 120.0
    assert not judge.check_due(2, 40)
    judge.start -= 10 * judge.checking  # ten times its time trained since: the next check is due
    assert judge.check_due(2, 40)


def test_a_time_budget_plans_its_steps_from_the_first_ones_and_checks_by_the_clock():
    import time

    judge = Judge(parse_budget("100s"), early=True, baseline=Reading(100.0, 50.0))
    judge.start = time.perf_counter() - 10  # 10 s spent: 90 left, a tenth of them kept for the checks
    assert judge.planned(5, 5.0) in (85, 86)  # 5 + 0.9 x 90 s at 1 s a step
    assert not judge.spent(86) and judge.steps is None
    judge.record(0, Reading(101.0, 50.0))
    assert not judge.check_due(1, 86)  # the next check comes 100 s / CHECKS = 5 s later
    judge._last_check -= 5
    assert judge.check_due(1, 86)
    judge.checking = 0.11 * judge.elapsed()  # the checks took over a tenth of the run: the next one waits
    assert not judge.check_due(1, 86)
    judge.checking = 0.0
    judge.start -= 90
    assert judge.spent(1)
    # the run stops once PATIENCE checks in a row read no better than its best, whether worth it or not; a better
    # reading (0.5% or more, with the original range held) starts the count again
    readings = [(98.0, 50.5), (97.0, 53.0), (97.9, 50.0), (96.0, 50.0), (96.0, 50.0), (95.9, 50.0), (97.0, 50.0)]
    assert not any(judge.record(step, Reading(*far_original)) for step, far_original in enumerate(readings, 1))
    assert judge.best.step == 4 and judge.since_best == 3  # step 2's original range broke; 95.9 is no 0.5% better
    assert not judge.record(8, Reading(96.5, 50.0)) and judge.record(9, Reading(96.5, 50.0))
    assert judge.best_reading() == Reading(96.0, 50.0) and PATIENCE == 5
    # the reading before training is never the best: a run writes a trained model, and a table worth it untrained
    # trains too
    judge = Judge(parse_budget("100s"), early=True, baseline=Reading(100.0, 50.0))
    assert not judge.record(0, Reading(90.0, 50.0)) and judge.best is None
    assert not any(judge.record(step, Reading(91.0, 50.0)) for step in range(1, 6)) and judge.best.step == 1
    assert judge.record(6, Reading(91.0, 50.0)) and [p.step for p in judge.curve] == list(range(7))
    # the budget is the whole run's: it is spent once what is left would not hold the last reading and the evaluation
    # after (each about as long as a check has been)
    judge = Judge(parse_budget("100s"), early=True, baseline=Reading(100.0, 50.0))
    judge.start = time.perf_counter() - 90
    judge.record(0, Reading(101.0, 50.0))
    judge.checking = 4.0
    assert judge.ending() == 8.0 and not judge.spent(1) and judge.planned(1, 1.0) < 1 + 0.9 * 2 + 1
    judge.checking = 6.0
    assert judge.spent(1)
    # a run that trains its whole budget (label-free vision) keeps its best check but never stops early
    judge = Judge(parse_budget("100s"), early=False, baseline=Reading(100.0, 50.0))
    assert not any(judge.record(step, Reading(91.0, 50.0)) for step in range(1, 12)) and judge.best.step == 1


def test_later_passes_cut_the_stream_at_another_offset():
    """The first pass over the data reads the packed rows as they are; each later one cuts the same stream of
    tokens at a seeded offset, so no text sits at the same positions pass after pass. The rows of a global
    batch are the same however many processes share it."""
    from posextend.training.batches import batch_indices, batch_rows, epoch_offset

    n, length, batch = 5, 8, 2
    seqs = torch.arange(n * length).view(n, length)  # token i of the stream is i
    first = [batch_rows(k, batch, seqs, 3) for k in range(3)]  # samples 0-5: one pass and a sample of the next
    assert all(torch.equal(first[k], seqs[batch_indices(k, batch, n, 3)]) for k in range(2))
    offset = epoch_offset(length, 3, 1)
    assert 0 < offset < length and epoch_offset(length, 3, 0) == 0
    later = torch.cat([batch_rows(k, batch, seqs, 3) for k in range(2, 5)])[1:]  # samples 5-9: the second pass
    assert sorted(int(row[0]) for row in later) == [i * length + offset for i in range(n)]
    assert all(torch.equal(row, (row[0] + torch.arange(length)) % (n * length)) for row in later)  # contiguous, wrapping
    two = torch.cat([batch_rows(k, 1, seqs, 3, processes=2, process=r) for k in range(5) for r in range(2)])
    assert torch.equal(two, torch.cat([batch_rows(k, batch, seqs, 3) for k in range(5)]))
    assert torch.equal(batch_rows(7, batch, seqs, 3, stream=False), seqs[batch_indices(7, batch, n, 3)])


def test_a_budgeted_run_writes_its_best_check_and_says_which(gpt, corpus, tmp_path, monkeypatch):
    """The held-out readings are scripted (best at step 4 of 8): the run trains its budget (PATIENCE checks without
    a better one have not passed), writes the weights step 4 had, evaluates those, and says so."""
    from posextend.training.best import BestWeights
    from posextend.training.objectives import get_objective

    far = iter([120.0, 100.0, 90.0, 95.0, 97.0, 99.0])  # steps 0, 2, 4, 6 and the last step's reading
    monkeypatch.setattr(type(get_objective("causal")), "reading", lambda self, run: Reading(next(far), 50.0))
    taken = {}
    keep = BestWeights.take
    monkeypatch.setattr(BestWeights, "take", lambda self, step: taken.update(
        {step: {n: p.detach().clone() for n, p in self.model.named_parameters()}}) or keep(self, step))
    report = finetune(gpt, tmp_path / "out", [corpus], length=64, budget="8 steps", eval_every=2, lr=3e-3, **QUICK)
    assert report.steps == 8 and report.written_step == 4 and sorted(taken) == [2, 4]
    assert report.written == "the best check's, step 4 of 8" and report.verdict.reading.far == 90.0
    written = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for name, value in written.named_parameters():
        assert torch.equal(value, taken[4][name]), name
    assert not torch.equal(taken[2]["transformer.wpe.weight"], taken[4]["transformer.wpe.weight"])
    assert "written: the best check's, step 4 of 8 weights" in (tmp_path / "out" / "README.md").read_text()
    assert json.loads(json.dumps(report.to_dict()))["written_step"] == 4
    assert report.held_out.startswith("held out: the tail of a document the run trains on")  # one document: its tail
    assert f"- Judged on: {report.held_out}" in (tmp_path / "out" / "README.md").read_text()


def test_a_source_that_reads_the_held_out_data_from_memory_is_named():
    """Training improved the far range, but the source reads it far better than any check: the held-out data may be
    what the source was trained on (a ViT fine-tuned at a new size on its own pretraining digits): the advice says
    so and asks for data it never saw, not a larger budget."""
    curve = [Point(0, 0.0, 0.4, math.nan), Point(10, 1.0, 0.9, math.nan), Point(20, 2.0, 0.938, math.nan)]
    base, read = Reading(0.98, math.nan, "accuracy", True), Reading(0.938, math.nan, "accuracy", True)
    verdict = Verdict(base, read, "the source at its own 10x10 px", budget="15min", curve=curve)
    assert verdict.source_memorised and not verdict.worth_it
    assert verdict.advice.startswith("the source reads this held-out data far better than any check of the run did "
                                     "(0.980 against 0.938 at best)")
    assert verdict.to_dict()["source_memorised"]
    near = Verdict(Reading(0.95, math.nan, "accuracy", True), read, "x", budget="15min", curve=curve)
    assert not near.source_memorised and near.advice is None  # within reach: a budget may still do it
    untrained = Verdict(base, read, "x", budget="15min", curve=[Point(0, 0.0, 0.95, math.nan), curve[1]])
    assert not untrained.source_memorised  # training did not improve it: no sign of memory
    # an image size is named as what it is, not as a longer context
    image = Verdict(Reading(0.3, math.nan, "accuracy", True), Reading(0.6, math.nan, "accuracy", True), "the source",
                    controls={"the same model at 16x16 px": Reading(0.62, math.nan, "accuracy", True)},
                    extension="the larger image", whole="at the new size")
    assert image.text == ("the fine-tune helped, the larger image did not: far range accuracy 0.600 at the new size "
                          "against 0.620 for the same model at 16x16 px (0.300 for the source)")
    assert image.advice == "fine-tune at the old size instead, or train longer: the larger image has not paid yet"



def test_best_weights_too_large_for_memory_go_to_disk_and_a_full_disk_is_one_line(tmp_path, monkeypatch):
    import errno

    from posextend.errors import PosExtendError
    from posextend.training import best

    model = torch.nn.Linear(3, 2)
    monkeypatch.setattr(best, "_free_memory", lambda: 0)  # no memory to spare: the copy goes to the state folder
    kept = best.BestWeights(model, tmp_path / "state")
    kept.take(4)
    taken = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    kept.restore()
    assert (tmp_path / "state" / "best.pt").is_file() and torch.equal(model.weight, taken) and kept.step == 4

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "state" / "best.pt"))

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(PosExtendError):
        kept.take(6)
