"""The contrastive objective's verdict: the source reading held-out passkey and needle documents in chunks of
its own length, embeddings averaged (its baseline), against the model being trained reading them whole."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
from tiny import FAMILIES, build

import posextend
from posextend.scoring.verdict import Reading
from posextend.training.context import RunContext
from posextend.training.objectives import get_objective
from posextend.training.options import FinetuneConfig
from posextend.training.sizes import Axis, Sizes

OLD, NEW = 64, 160  # a 160-token document is read by the source in chunks of 62, 62 and 34 tokens


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny sentence-transformers model (BERT 2 x 16, mean pooling) at 64 positions, and its copy extended
    to 160 (tile: inputs within 64 tokens give the source's embeddings)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    root = tmp_path_factory.mktemp("st")
    family = FAMILIES["bert"]
    bert = build(dataclasses.replace(family, overrides={**family.overrides, "max_position_embeddings": OLD}, usable=OLD),
                 root / "bert", headed=False)
    SentenceTransformer(modules=[Transformer(str(bert)), Pooling(16)], device="cpu").save(str(root / "src"))
    posextend.resize_checkpoint(root / "src", root / "ext", NEW, "tile")
    return (SentenceTransformer(str(root / "src"), device="cpu").eval(),
            SentenceTransformer(str(root / "ext"), device="cpu").eval())


def _run(model, text: str, *, seed: int = 0, old: int = OLD) -> RunContext:
    return RunContext(accelerator=SimpleNamespace(device=torch.device("cpu")), model=model, unwrapped=model,
                      processor=model.tokenizer, config=FinetuneConfig(seed=seed, eval_sequences=16),
                      train_samples=torch.zeros(1, NEW),
                      eval_samples=torch.zeros(1, NEW), eval_documents=[text], sizes=Sizes(Axis(old, NEW)),
                      state=get_objective("contrastive").State())


class Widths:
    """The width of every batch a model reads (a forward pre-hook on its first module)."""

    def __init__(self, model):
        self.seen: list[tuple[int, int]] = []
        self.handle = model[0].register_forward_pre_hook(lambda _, args: self.seen.append(tuple(args[0]["input_ids"].shape)))

    def __enter__(self):
        return self.seen

    def __exit__(self, *exc):
        self.handle.remove()


def test_baseline_reads_in_chunks_and_the_model_reads_whole(models, corpus):
    """Readings are accuracies in [0, 1] on the same tasks (passkey and needle, shared and varied haystacks,
    eval_sequences documents each): the source, whose table has 64 rows, reads 160-token documents in chunks of 64
    positions; the extended model reads them whole. Both read the tasks at the old length whole, where tile
    gives the extended model the source's embeddings, so the original ranges are equal."""
    source, extended = models
    objective = get_objective("contrastive")
    run = _run(extended, corpus.read_text())
    with Widths(source) as widths:
        baseline = objective.baseline(run, source)
    n = run.config.eval_sequences
    assert isinstance(baseline, Reading) and baseline.higher and baseline.metric == "passkey/needle accuracy@1"
    documents = [w for w in widths if w[1] > 30]  # every query is shorter than 30 tokens, every document longer
    assert max(width for _, width in widths) == OLD  # never beyond the source's table
    assert documents == [(3, OLD)] * 4 * n + [(1, OLD)] * 4 * n  # 3 chunks (one batch) a document; then the old length
    tasks = run.state.tasks
    with Widths(extended) as widths:
        reading = objective.reading(run)
    assert [w for w in widths if w[1] > 30] == [(1, NEW)] * 4 * n + [(1, OLD)] * 4 * n  # each document whole
    assert run.state.tasks is tasks  # built once per run
    for r in (baseline, reading):
        assert 0 <= r.far <= 1 and 0 <= r.original <= 1 and (r.metric, r.higher) == (baseline.metric, True)
        assert (r.far * 4 * n).is_integer()  # hits over 64 queries
    assert reading.original == baseline.original
    for r in (baseline, reading):  # the far range task by task, every query's hit averaged over them
        assert list(r.parts) == ["shared passkey", "shared needle", "varied passkey", "varied needle"]
        assert r.far == pytest.approx(sum(r.parts.values()) / 4) and all((v * n).is_integer() for v in r.parts.values())
    far, original = tasks
    assert [(t.haystack, t.name, t.length, len(t.documents)) for t in far] == [
        (h, name, NEW, n) for h in ("shared", "varied") for name in ("passkey", "needle")]
    assert [(t.haystack, t.name, t.length) for t in original] == [(t.haystack, t.name, OLD) for t in far]
    assert all(len(doc) == NEW - 2 for t in far for doc in t.documents)


def test_the_tasks_are_the_runs_own_the_same_at_every_call(models, corpus):
    """Seeded by the run's seed and built from its held-out documents: a second run with the same seed builds
    the same documents and reads the same numbers; another seed, other documents."""
    source, extended = models
    objective = get_objective("contrastive")
    first, again, other = (_run(extended, corpus.read_text(), seed=s) for s in (0, 0, 1))
    assert objective.reading(first) == objective.reading(again)
    same = [json.dumps([t.documents for t in tasks]) for tasks in first.state.tasks]
    assert same == [json.dumps([t.documents for t in tasks]) for tasks in again.state.tasks]
    objective.reading(other)
    assert [json.dumps([t.documents for t in tasks]) for tasks in other.state.tasks] != same
    extended.train()
    objective.reading(first)
    assert extended.training  # the model trains on after a reading
    extended.eval()


def test_short_held_out_text_keeps_the_passkey_and_no_extension_has_no_verdict(models, corpus):
    """Held-out text shorter than one document: only the shared passkey, which needs none, is read (the metric
    says so); a run that does not extend has no far range, so no reading."""
    source, extended = models
    objective = get_objective("contrastive")
    run = _run(extended, corpus.read_text()[:300])
    baseline = objective.baseline(run, source)
    assert baseline.metric == "passkey accuracy@1"
    assert [(t.haystack, t.name) for t in run.state.tasks[0]] == [("shared", "passkey")]
    assert objective.reading(_run(extended, corpus.read_text(), old=NEW)) is None
    assert objective.baseline(_run(extended, corpus.read_text(), old=NEW), source) is None
    assert objective.baseline_name(run) == "the source reading 64-token chunks, averaged"
