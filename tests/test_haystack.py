"""Retrieval protocols: LongEmbed's shared haystack (the default) and the varied one (issue #27)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from posextend.cli import app
from posextend.errors import PosExtendError

LONGEMBED_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


@pytest.fixture(scope="module")
def tok(minilm):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(minilm)


@pytest.fixture(scope="module")
def ids(tok, corpus):
    from posextend.scoring.retrieval import corpus_tokens

    return corpus_tokens(tok, [corpus])


@pytest.mark.parametrize("task", ["passkey", "needle"])
def test_shared_documents_differ_only_in_the_key_and_where_it_sits(tok, ids, task):
    from posextend.scoring.retrieval import make_task, passkey_haystack

    n, length = 9, 200
    content = length - 2
    built = make_task(tok, ids, task, length, n=n, seed=3, haystack="shared")
    assert built.haystack == "shared" and len(built.documents) == len(built.queries) == len(built.keys) == n
    assert all(len(d) == content for d in built.documents)
    rests = []
    for doc, key, depth, query in zip(built.documents, built.keys, built.depths, built.queries):
        subject = query.removeprefix("what is the passkey for ").removeprefix("What is the best thing to do in ")
        assert subject.removesuffix("?").lower() in tok.decode(key)  # the key answers its own query
        at = round(depth * (content - len(key)))
        assert doc[at : at + len(key)] == key  # the key sits at the reported depth
        rests.append(doc[:at] + doc[at + len(key) :])
    hay = max(rests, key=len)  # take the keys out: every document is the same haystack, cut to make room
    assert all(rest == hay[: len(rest)] for rest in rests)
    assert len({tuple(d) for d in built.documents}) == n
    if task == "passkey":  # LongEmbed's wording of the key and the query, and its filler, repeated
        name = built.queries[0].removeprefix("what is the passkey for ").removesuffix("?").lower()
        said = tok.decode(built.keys[0])
        assert said.startswith(name) and " pass key is " in said and said.endswith(f"is the pass key for {name}.")
        firsts = [q.removeprefix("what is the passkey for ").split()[0] for q in built.queries]
        assert len(set(firsts)) == n  # different people, as in LongEmbed: no two keys share a name
        assert hay == passkey_haystack(tok, len(hay))
        assert tok.decode(hay).startswith(" ".join([LONGEMBED_FILLER.lower()] * 2))
    else:  # one span of the corpus
        assert any(ids[s : s + len(hay)] == hay for s in range(len(ids) - len(hay) + 1) if ids[s] == hay[0])


def test_passkey_filler_is_longembeds_text_and_needs_no_corpus(tok):
    from posextend.scoring.retrieval import PASSKEY_FILLER, make_task, passkey_haystack

    assert PASSKEY_FILLER == LONGEMBED_FILLER
    hay = passkey_haystack(tok, 120)
    assert len(hay) == 120
    assert tok.decode(hay).startswith(" ".join([LONGEMBED_FILLER.lower()] * 3))
    built = make_task(tok, [], "passkey", 128, n=4, haystack="shared")  # no corpus needed for LongEmbed's passkey
    assert all(len(d) == 126 for d in built.documents)
    with pytest.raises(PosExtendError, match="fewer than one document"):
        make_task(tok, [], "needle", 128, n=4, haystack="shared")
    with pytest.raises(PosExtendError, match="shared, varied"):
        make_task(tok, [], "passkey", 128, n=4, haystack="same")


def test_shared_depths_are_evenly_spread_and_reported(tok, ids):
    from posextend.scoring.retrieval import by_depth, even_depths, make_task

    assert even_depths(5) == [0.0, 0.25, 0.5, 0.75, 1.0] and even_depths(1) == [0.5]
    n, length = 21, 300
    for task in ("passkey", "needle"):
        built = make_task(tok, ids, task, length, n=n, seed=0, haystack="shared")
        spread = sorted(built.depths)
        assert spread == [i / (n - 1) for i in range(n)]  # first token to last, evenly
        for doc, key, depth in zip(built.documents, built.keys, built.depths):  # placed at the nearest token
            at = round(depth * (length - 2 - len(key)))
            assert doc[at : at + len(key)] == key
        assert built.depths != spread  # which key sits where is shuffled, not tied to the names' order
        assert [len(g) for g in _quarters(built.depths)] == [5, 5, 5, 6]  # i / 20: 0–0.2, 0.25–0.45, 0.5–0.7, 0.75–1
        assert by_depth(built, [True] * n) == [1.0] * 4  # every quarter holds keys
    varied = make_task(tok, ids, "needle", length, n=n, seed=0, haystack="varied")
    assert varied.haystack == "varied"
    starts = {tuple(d[:20]) for d in varied.documents}
    assert len(starts) > n // 2  # the old protocol: each document its own span


def _quarters(depths):
    groups = [[], [], [], []]
    for d in depths:
        groups[min(int(d * 4), 3)].append(d)
    return groups


@pytest.mark.parametrize("haystack", ["shared", "varied", "reworded"])
def test_no_query_names_another_documents_key(tok, ids, haystack):
    """As in LongEmbed, 50 keys name 50 people and 50 places, no two sharing a word: each query's subject is
    in its own key and in no other. (The varied protocol once named 26 places, then "Lyon 2": a query for
    Lyon named two keys, and a model that found the place could still pick the other.)"""
    from posextend.scoring.retrieval import make_task

    words = {"reworded": ((" to ", "passkey"), (" leaving ", "needle"))}
    for before, task in words.get(haystack, ((" for ", "passkey"), (" in ", "needle"))):
        built = make_task(tok, ids, task, 200, n=50, seed=0, haystack=haystack)
        subjects = [set(q.rsplit(before, 1)[-1].removesuffix("?").lower().split()) for q in built.queries]
        keys = [set(tok.decode(k).replace(".", " ").replace("'", " ").split()) for k in built.keys]
        assert all(len(s) == (2 if task == "passkey" else 1) for s in subjects)
        for i, subject in enumerate(subjects):
            assert subject <= keys[i]
            assert [j for j, key in enumerate(keys) if j != i and subject & key] == []


def test_the_reworded_protocol_shares_no_wording_and_no_verdict_reads_it(tok, ids):
    """The protocol kept aside: the varied protocol's documents (spans, depths), keys and queries in words no
    default was chosen on; a fine-tune's verdict builds its tasks without it."""
    from posextend.scoring.retrieval import HAYSTACKS, VERDICT_HAYSTACKS, make_task, task_pairs

    for task in ("passkey", "needle"):
        varied = make_task(tok, ids, task, 200, n=20, seed=1, haystack="varied")
        reworded = make_task(tok, ids, task, 200, n=20, seed=1, haystack="reworded")
        assert reworded.haystack == "reworded" and len(reworded.documents) == 20
        assert all(len(d) == 198 for d in reworded.documents)
        assert not set(varied.queries) & set(reworded.queries)
        first, second = ({w for q in t.queries for w in q.lower().split()[:4]} for t in (varied, reworded))
        assert not first & second  # not one of the queries' first four words is shared
        assert not {tok.decode(k) for k in varied.keys} & {tok.decode(k) for k in reworded.keys}
    assert "reworded" in HAYSTACKS and "reworded" not in VERDICT_HAYSTACKS
    built = task_pairs(tok, ids, (200, 100), n=4, seed=0)
    assert {t.haystack for tasks in built for t in tasks} == {"shared", "varied"}


def test_varied_is_the_old_protocol_unchanged(tok, ids):
    from posextend.scoring.retrieval import make_task

    a = make_task(tok, ids, "passkey", 200, n=5, seed=2, haystack="varied")
    b = make_task(tok, ids, "passkey", 200, n=5, seed=2, haystack="varied")
    assert a.documents == b.documents and a.haystack == "varied"
    assert all(tok.decode(d).count("the grass is green") == 0 for d in a.documents)  # corpus text, not the filler
    shared = make_task(tok, ids, "passkey", 200, n=5, seed=2)
    assert shared.haystack == "shared"  # the default is LongEmbed's protocol


def test_haystack_through_the_cli_and_the_json(minilm, corpus, tmp_path):
    out = {}
    for protocol in (None, "varied", "shared"):
        args = ["eval", str(minilm), "--data", str(corpus), "--task", "passkey,needle", "--lengths", "64,200",
                "--documents", "4", "--json", str(tmp_path / f"{protocol}.json")]
        if protocol:
            args += ["--haystack", protocol]
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 0, r.output
        out[protocol] = (r.output, json.loads((tmp_path / f"{protocol}.json").read_text()))
    assert "shared haystack (LongEmbed's protocol)" in out[None][0] and "keys spread evenly" in out[None][0]
    assert "varied haystack" in out["varied"][0] and "keys at random depths" in out["varied"][0]
    assert out[None][1]["haystack"] == out["shared"][1]["haystack"] == "shared"
    assert out["varied"][1]["haystack"] == "varied"
    assert out[None][1]["scores"] == out["shared"][1]["scores"]  # the default is the shared protocol
    depths = out[None][1]["key_depths"]
    assert sorted(depths["passkey"]["200"]) == pytest.approx([0, 1 / 3, 2 / 3, 1], abs=0.01)
    assert set(depths) == {"passkey", "needle"} and all(len(v) == 4 for t in depths.values() for v in t.values())
    r = CliRunner().invoke(app, ["eval", str(minilm), "--data", str(corpus), "--task", "passkey", "--haystack", "same"])
    assert r.exit_code != 0 and "--haystack must be shared or varied" in r.output


def test_framed_is_the_one_encoder_batch_of_training_and_retrieval():
    """[CLS] row [SEP] (BOS/EOS for a tokenizer without CLS/SEP), padded with the pad id, masked."""
    from types import SimpleNamespace

    import torch

    from posextend.scoring.text import framed

    bert = SimpleNamespace(cls_token_id=101, sep_token_id=102, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    out = framed([[5, 6, 7], torch.tensor([8])], bert)
    assert out["input_ids"].tolist() == [[101, 5, 6, 7, 102], [101, 8, 102, 0, 0]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    no_cls = SimpleNamespace(cls_token_id=None, sep_token_id=None, bos_token_id=0, eos_token_id=2, pad_token_id=1)
    assert framed([[5], [6, 7]], no_cls)["input_ids"].tolist() == [[0, 5, 2, 1], [0, 6, 7, 2]]
