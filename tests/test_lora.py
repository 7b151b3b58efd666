"""``train="lora"``: LoRA (peft) on the attention projections, with the position table(s) and the norms
trainable (LongLoRA's recipe), merged into a plain checkpoint in the source's layout; the adapter alone on
request. Tiny twins and real text."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers
from conftest import load_clean
from safetensors.torch import load_file
from tiny import FAMILIES, bart, build
from typer.testing import CliRunner

import posextend
import posextend.training.adapters as adapters
import posextend.training.loop as loop_module
from posextend.cli import app
from posextend.errors import TrainingError
from posextend.training.adapters import ALPHA, RANK, add_lora, attention_projections, norm_modules, trainable_share
from posextend.training.loop import finetune

# fp32: the spy (_capture) reads the run's model through its forward, which bf16 autocast (``auto`` on a CPU
# with bf16 instructions) would round, and compares it bit for bit with the written file read back in fp32
QUICK = dict(batch_size=2, eval_sequences=2, seed=0, mixed_precision="no")
IDS = torch.arange(5, 69)[None] * 7 % 900 + 10  # 64 token ids every tiny vocabulary holds


@pytest.fixture(scope="module")
def taught(gpt, corpus, tmp_path_factory) -> Path:
    """The tiny GPT-2 after 40 steps on the corpus at its 32 positions: a source with something to extend
    (LoRA cannot teach a random model its vocabulary: its embeddings and head stay frozen)."""
    out = tmp_path_factory.mktemp("taught") / "src"
    finetune(gpt, out, [corpus], steps=40, train="all", lr=3e-3, schedule="constant", batch_size=4,
             eval_sequences=2, seed=0)
    return out


def _model(family: str):
    fam = FAMILIES[family]
    return fam.headed.from_config(fam.config()).eval()


@pytest.mark.parametrize("family, targets, table", [
    ("gpt2", {"c_attn", "c_proj"}, "transformer.wpe"),  # LongLoRA's q, k, v (one layer here) and o
    ("bert", {"query", "key", "value", "dense"}, "bert.embeddings.position_embeddings"),
])
def test_lora_trains_the_attention_projections_the_table_and_the_norms_under_5_percent(family, targets, table):
    model = _model(family)
    norms = set(norm_modules(model))
    assert norms == {n for n, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)} and norms
    width = model.config.hidden_size
    weights = sum(p.numel() for p in model.parameters())
    add_lora(model, [model.get_submodule(table).weight])
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    lora = {n.partition(".lora_")[0].rpartition(".")[2] for n in trainable if ".lora_" in n}
    saved = {n.partition(".modules_to_save.")[0] for n in trainable if ".modules_to_save." in n}
    assert lora == targets and saved == norms | {table} and all(".lora_" in n or n.partition(".modules_to_save.")[0]
                                                                 in saved for n in trainable)
    # LoRA's A (r x in) and B (out x r) on each projection, the table and the norms, whole
    projections = [m for n, m in model.named_modules() if n.rpartition(".")[2] in targets and hasattr(m, "base_layer")]
    rank = min(RANK, width)  # PiSSA's matrices hold at most the layer's rank: these layers are narrower than RANK
    expected = sum(rank * (m.in_features + m.out_features) for m in projections)
    expected += model.get_submodule(table).modules_to_save["default"].weight.numel() + 2 * width * len(norms)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == expected
    share = trainable_share(model)
    assert share == pytest.approx(expected / weights) and share <= 0.05


@pytest.mark.parametrize("rank", [4, RANK])  # 4: under the tiny models' width, as RANK is under a real model's
def test_lora_starts_from_the_weights_principal_directions_as_the_same_model(rank, monkeypatch):
    """PiSSA: B and A start as each projection's top singular directions (not B at zero), the frozen weight keeps
    the rest, and the adapted model computes what the model did."""
    monkeypatch.setattr(adapters, "RANK", rank)
    torch.manual_seed(0)  # the fast SVD is randomised
    model = _model("gpt2")
    weight = model.transformer.h[0].attn.c_attn.weight.detach().clone()
    with torch.no_grad():
        before = model(IDS[:, :32]).logits
    add_lora(model, [model.transformer.wpe.weight])
    layer = model.transformer.h[0].attn.c_attn
    b, a = layer.lora_B["default"].weight, layer.lora_A["default"].weight
    width = min(RANK, rank, *weight.shape)
    assert a.shape[0] == width and float(b.abs().max()) > 0
    # B A holds the weight's top directions: nearly all the energy of its `width` largest singular values (a fast
    # SVD's 4 iterations on this random weight, whose spectrum is flat, capture 91.8% or more over 30 seeds), and
    # never more (no rank-`width` part of it holds more)
    best = float((torch.linalg.svdvals(weight)[:width] ** 2).sum())
    captured = float(torch.linalg.matrix_norm(layer.scaling["default"] * (b @ a)) ** 2)
    assert 0.85 * best <= captured <= 1.0001 * best, (captured, best)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS[:, :32]).logits, before, atol=1e-5, rtol=1e-5)


def test_the_attention_projections_of_every_family_are_found_by_module_type():
    """q, k, v and o (LongLoRA's) in every tiny family with attention, also those peft's own table has no entry for
    (27 of these 38: DistilBERT, ALBERT, Longformer, mBART …); FNet, which has no attention, is refused."""
    from transformers.pytorch_utils import Conv1D

    outputs = {"c_proj", "dense", "out_lin", "out_proj", "o"}  # the attention's output projection, by family
    for name, fam in FAMILIES.items():
        model = fam.headed.from_config(fam.config())
        if name == "fnet":
            with pytest.raises(TrainingError, match="No attention block"):
                attention_projections(model)
            continue
        names = attention_projections(model)
        assert all(isinstance(model.get_submodule(n), (torch.nn.Linear, Conv1D)) for n in names), name
        assert {n.rpartition(".")[2] for n in names} & outputs and len(names) >= 2, (name, names)
    distil = attention_projections(FAMILIES["distilbert"].headed.from_config(FAMILIES["distilbert"].config()))
    assert {n.rpartition(".")[2] for n in distil} == {"q_lin", "k_lin", "v_lin", "out_lin"}


def test_a_model_without_attention_blocks_is_refused_in_one_line(corpus, tmp_path):
    # FNet mixes its tokens by a Fourier transform: no attention
    fam = dataclasses.replace(FAMILIES["fnet"], tokenizer=FAMILIES["bert"].tokenizer)
    src = build(fam, tmp_path / "src")
    result = CliRunner().invoke(app, ["finetune", str(src), str(tmp_path / "out"), "--data", str(corpus),
                                      "--length", "64", "--train", "lora", "--steps", "1"])
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip() and "it/s]" not in line]  # loading bars aside
    assert len(lines) == 1 and "No attention block of this fnet model" in lines[0]
    assert "train the positions or every parameter" in lines[0] and not (tmp_path / "out").exists()


def test_an_adapter_is_saved_only_by_a_lora_run(gpt, corpus, tmp_path):
    with pytest.raises(posextend.TrainingError, match="Only a LoRA run has an adapter to save"):
        finetune(gpt, tmp_path / "out", [corpus], train="all", save_adapter=True)


def _capture(monkeypatch) -> dict:
    """Spy on the writer's merge: the adapted model's outputs on :data:`IDS` before merging, the merged
    model's after, and the run's frozen reference."""
    seen: dict = {}
    merge, save = adapters.merge, loop_module.save

    def outputs(root):  # in eval mode: the contrastive objective trains with the model's dropout
        model = root[0].auto_model if isinstance(root, torch.nn.Sequential) else root
        mode = model.training
        with torch.no_grad():
            out = model.eval()(input_ids=IDS)[0]
        model.train(mode)
        return out

    def spy_merge(adapter, root, **kwargs):
        seen["adapted"] = outputs(root)
        out = merge(adapter, root, **kwargs)
        seen["merged"] = outputs(root)
        return out

    def spy_save(run, *args):
        seen["reference"] = run.reference
        seen["lr"] = run.config.lr
        group = {id(q): g["initial_lr"] for g in run.trainable.optimizer.param_groups for q in g["params"]}
        seen["lrs"] = {n: group[id(q)] for n, q in run.unwrapped.named_parameters() if q.requires_grad}
        return save(run, *args)

    monkeypatch.setattr(adapters, "merge", spy_merge)
    monkeypatch.setattr(loop_module, "save", spy_save)
    return seen


def _no_adapter(model: torch.nn.Module) -> bool:
    return not any("lora" in n or "modules_to_save" in n for n, _ in model.named_parameters())


def test_the_loss_falls_and_the_merged_output_is_the_trained_model(taught, corpus, tmp_path, monkeypatch):
    """Causal GPT-2, 32 -> 64 positions, the anchor on: the loss falls; the output is a plain GPT-2 whose
    outputs are the merged model's (bit for bit) and the adapted model's (to float error); the tensors
    LoRA left alone keep their bytes; the anchor held to the source, without adapters."""
    seen = _capture(monkeypatch)
    report = finetune(taught, tmp_path / "out", [corpus], length=64, train="lora", steps=30, lr=1e-2, **QUICK)
    first, last = sum(report.losses[:5]) / 5, sum(report.losses[-5:]) / 5
    assert last < first - 0.3, (first, last)
    assert report.after.loss < report.before.loss and report.train == "lora" and report.anchor == 1.0
    tuned = load_clean(tmp_path / "out", transformers.AutoModelForCausalLM)
    with torch.no_grad():
        assert torch.equal(tuned(IDS).logits, seen["merged"])
    torch.testing.assert_close(seen["merged"], seen["adapted"], atol=1e-4, rtol=1e-4)
    before, after = load_file(taught / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    changed = {n for n in before if n in after and (after[n].shape != before[n].shape or not torch.equal(after[n], before[n]))}
    assert {n for n in changed if ".ln_" in n} and "transformer.wpe.weight" in changed
    adapted = {f"transformer.h.{i}.attn.{p}" for i in range(2) for p in ("c_attn", "c_proj")}
    assert {n.rpartition(".")[0] for n in changed} <= adapted | set(norm_modules(tuned)) | {"transformer.wpe"}
    assert set(after) == set(before) and after["transformer.wpe.weight"].shape == (64, 16)
    reference = seen["reference"]
    source = load_clean(taught, transformers.AutoModelForCausalLM)
    assert _no_adapter(reference) and reference.config.n_positions == 32
    with torch.no_grad():
        assert torch.equal(reference(IDS[:, :32]).logits, source(IDS[:, :32]).logits)
    card = (tmp_path / "out" / "README.md").read_text()
    assert "- Trained: `lora`" in card and not (tmp_path / "out" / "adapter").exists()


def test_the_default_lr_and_strategy_of_lora(gpt, corpus, tmp_path, monkeypatch):
    seen = _capture(monkeypatch)
    report = finetune(gpt, tmp_path / "out", [corpus], length=64, train="lora", steps=1, gradient_checkpointing=True,
                      **QUICK)
    assert report.lr == seen["lr"] == 2e-3 and report.strategy == "interpolate" and report.schedule == "cosine"
    whole = {n: lr for n, lr in seen["lrs"].items() if ".modules_to_save." in n}  # the table and norms, whole
    assert any(".wpe." in n for n in whole) and any(".ln_" in n for n in whole)
    assert set(whole.values()) == {adapters.WHOLE_LR * 2e-3} and 0 < adapters.WHOLE_LR < 1
    assert {lr for n, lr in seen["lrs"].items() if n not in whole} == {2e-3}  # LoRA's matrices
    load_clean(tmp_path / "out", transformers.AutoModelForCausalLM)


def test_a_plug_in_objective_from_before_lora_gets_the_base_defaults():
    """An objective whose lr and strategy tables name only the older modes: lora takes the base's lr and tile."""
    from posextend.training.objectives.base import Objective
    from posextend.training.objectives.causal import CausalLM
    from posextend.training.options import FinetuneConfig

    class Older(CausalLM):
        lr = {"new-rows": 3e-3, "positions": 3e-3, "all": 3e-3}
        strategy = {"new-rows": "tile", "positions": "tile", "all": "interpolate"}

    assert Older().default_lr("lora", 768) == Objective.lr["lora"] and Older().default_lr("all", 64) == 3e-3
    assert FinetuneConfig(train="lora").resolved(Older()).with_strategy(Older(), {1}).strategy == "tile"


def test_the_adapter_alone_applies_to_the_source_extended_with_any_strategy(gpt, corpus, tmp_path):
    """``save_adapter``: DST/adapter is peft's own folder; applied to the source extended to the run's length
    (another strategy than the run's: the tables are in the adapter whole) and merged, it is the output."""
    from peft import PeftModel

    finetune(gpt, tmp_path / "out", [corpus], length=64, train="lora", steps=4, lr=1e-2, save_adapter=True, **QUICK)
    folder = tmp_path / "out" / "adapter"
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((folder / "adapter_config.json").read_text())
    # PiSSA's, converted to a LoRA of the source's weights: twice the rank (the tiny model's 16, under RANK), B A - B0 A0
    assert (config["peft_type"], config["r"], config["inference_mode"]) == ("LORA", 2 * min(RANK, 16), True)
    assert config["init_lora_weights"] is True and config["lora_alpha"] / config["r"] == ALPHA / RANK
    posextend.resize_checkpoint(gpt, tmp_path / "base", 64, "tile", seed=0)  # the run used interpolate
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    applied = PeftModel.from_pretrained(base, folder).merge_and_unload().eval()
    tuned = load_clean(tmp_path / "out", transformers.AutoModelForCausalLM)
    with torch.no_grad():
        torch.testing.assert_close(applied(IDS).logits, tuned(IDS).logits, atol=1e-5, rtol=1e-5)


def test_a_bare_file_stays_bare_and_a_masked_lm_merges(gpt, bert, corpus, tmp_path, monkeypatch):
    """A bare GPT-2 file (the base model's names, no head): the output keeps its bare names and loads in the
    causal LM and the base model with nothing missing or unexpected; a headed masked LM merges too."""
    src = tmp_path / "bare"
    transformers.GPT2Model.from_pretrained(gpt).save_pretrained(src)
    transformers.AutoTokenizer.from_pretrained(gpt).save_pretrained(src)
    seen = _capture(monkeypatch)
    finetune(src, tmp_path / "out", [corpus], length=64, train="lora", steps=2, **QUICK)
    names = set(load_file(tmp_path / "out" / "model.safetensors"))
    assert names == set(load_file(src / "model.safetensors")) and "wpe.weight" in names
    load_clean(tmp_path / "out", transformers.GPT2Model)
    tuned = load_clean(tmp_path / "out", transformers.AutoModelForCausalLM)
    with torch.no_grad():
        assert torch.equal(tuned(IDS).logits, seen["merged"])
    report = finetune(bert, tmp_path / "headed", [corpus], length=64, train="lora", steps=2, **QUICK)
    assert report.objective == "masked"
    tuned = load_clean(tmp_path / "headed", transformers.AutoModelForMaskedLM)
    with torch.no_grad():
        assert torch.equal(tuned(IDS).logits, seen["merged"])


@pytest.mark.parametrize("layout", ["root", "subfolder"])
def test_a_sentence_transformer_gets_the_adapter_on_its_transformer(bert, corpus, tmp_path, monkeypatch, layout):
    """The contrastive objective on a sentence-transformers folder, its transformer at the root (as saved today)
    or in ``0_Transformer/`` (older folders): the output keeps the layout and loads clean."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Pooling, Transformer

    src = tmp_path / "src"
    SentenceTransformer(modules=[Transformer(str(bert)), Pooling(16)], device="cpu").save(str(src))
    model_dir = src
    if layout == "subfolder":
        model_dir = src / "0_Transformer"
        model_dir.mkdir()
        for path in [p for p in src.iterdir() if p.is_file() and p.name not in ("modules.json", "README.md",
                                                                                  "config_sentence_transformers.json")]:
            path.rename(model_dir / path.name)
        modules = json.loads((src / "modules.json").read_text())
        modules[0]["path"] = "0_Transformer"
        (src / "modules.json").write_text(json.dumps(modules))
    seen = _capture(monkeypatch)
    report = finetune(src, tmp_path / "out", [corpus], length=64, train="lora", steps=2, anchor=0, save_adapter=True,
                      **QUICK)
    assert report.objective == "contrastive"
    load_clean(tmp_path / "out" / model_dir.relative_to(src), transformers.AutoModel)  # where the source had it
    tuned = SentenceTransformer(str(tmp_path / "out"), device="cpu")
    assert tuned.max_seq_length == 64 and (tmp_path / "out" / "adapter" / "adapter_config.json").is_file()
    with torch.no_grad():
        assert torch.equal(tuned[0].auto_model.eval()(input_ids=IDS)[0], seen["merged"])


def test_a_seq2seq_model_merges_both_stacks(corpus, tmp_path, monkeypatch):
    src = bart(tmp_path / "src", positions=32)
    seen = _capture(monkeypatch)
    report = finetune(src, tmp_path / "out", [corpus], length=64, train="lora", steps=2, **QUICK)
    assert report.objective == "seq2seq"
    tuned = load_clean(tmp_path / "out", transformers.AutoModelForSeq2SeqLM)
    assert tuned.config.max_position_embeddings == 64
    with torch.no_grad():
        assert torch.equal(tuned(input_ids=IDS).logits, seen["merged"])
    before, after = load_file(src / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    for stack in ("encoder", "decoder"):  # both tables and the attention projections of both stacks trained
        assert after[f"model.{stack}.embed_positions.weight"].shape[0] == 66
        assert not torch.equal(after[f"model.{stack}.layers.0.self_attn.q_proj.weight"],
                               before[f"model.{stack}.layers.0.self_attn.q_proj.weight"])


def test_a_lora_run_resumes_to_the_same_result(gpt, corpus, tmp_path):
    kwargs = dict(length=48, steps=6, train="lora", lr=1e-2, **QUICK)
    finetune(gpt, tmp_path / "straight", [corpus], **kwargs)
    import os
    import signal

    def interrupt(step, total, loss, tps):
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(posextend.TrainingError, match="Interrupted after step 3"):
        finetune(gpt, tmp_path / "resumed", [corpus], progress=interrupt, **kwargs)
    finetune(gpt, tmp_path / "resumed", [corpus], resume=True, **kwargs)
    a, b = load_file(tmp_path / "straight" / "model.safetensors"), load_file(tmp_path / "resumed" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
