"""The objective registry: its contract, plug-ins, and the default choice."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import posextend
from posextend.training.objectives import (
    Objective, available_objectives, default_objective, get_objective, register_objective,
)
from posextend.training.objectives.causal import CausalLM
from posextend.training.loop import finetune


def test_every_objective_implements_the_contract():
    objectives = available_objectives()
    assert {"causal", "masked", "contrastive"} <= set(objectives)
    for name, objective in objectives.items():
        assert objective.name == name and len(objective.description) > 20 and objective.metric
        for method in ("loss", "evaluate"):
            assert getattr(type(objective), method) is not getattr(Objective, method), f"{name} lacks {method}"
        # it loads through the base class's load: it names the class that loads its head, or loads its own way
        assert objective.model_class or type(objective).load_model is not Objective.load_model, name
        assert dataclasses.is_dataclass(objective.State), name


def test_registration_refuses_duplicates_and_non_objectives():
    with pytest.raises(posextend.TrainingError, match="already registered"):
        register_objective("causal")(CausalLM)
    with pytest.raises(posextend.TrainingError, match="subclass of posextend.training.objectives.base.Objective"):
        register_objective("not-an-objective")(dict)
    with pytest.raises(posextend.TrainingError, match="Unknown objective 'nope'. Valid objectives: causal, contrastive"):
        get_objective("nope")


def test_default_lr_and_schedule_by_train_mode_and_width():
    causal, masked = get_objective("causal"), get_objective("masked")
    # every weight trains: the grid's 1e-3 up to 192 wide, then 192 / width of it (GPT-2 small, XL)
    assert causal.default_lr("all", 64) == causal.default_lr("all", 192) == 1e-3
    assert causal.default_lr("all", 768) == pytest.approx(2.5e-4)
    assert causal.default_lr("all", 1600) == pytest.approx(1.2e-4)
    # a table's lr does not depend on the width; objectives without a measured width keep theirs
    assert causal.default_lr("new-rows", 1600) == 3e-3 and causal.default_lr("positions", 1600) == 1e-3
    assert masked.default_lr("all", 1024) == masked.lr["all"]
    assert causal.schedule == {"new-rows": "constant", "positions": "constant", "all": "cosine", "lora": "cosine"}
    assert set(masked.schedule.values()) == {"constant"}
    assert get_objective("contrastive").schedule["all"] == "cosine"


def test_default_objective_follows_the_checkpoint(tiny, minilm, tmp_path):
    import transformers

    assert default_objective(tiny["gpt2"]) == "causal"
    assert default_objective(tiny["bert"]) == "masked"
    assert default_objective(tiny["bart"]) == default_objective(tiny["blenderbot"]) == "seq2seq"
    assert default_objective(minilm) == "contrastive"  # a sentence-transformers folder
    vit = transformers.ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                 image_size=32, patch_size=8)
    transformers.ViTModel(vit).save_pretrained(tmp_path / "vit")
    assert default_objective(tmp_path / "vit") == "vision"  # a vision tower (the vision objective's entry point)


def test_a_plugin_objective_trains_through_the_shared_loop(gpt, corpus, tmp_path):
    """A third-party objective: causal LM on every other token only (its own loss), same loop and writer."""
    seen = []

    @register_objective("causal-even-tokens", description="Next-token loss on even positions only (a test plug-in).")
    class EvenTokens(CausalLM):
        def loss(self, run, positions, batch):
            seen.append(list(positions))
            labels = batch.clone()
            labels[:, 1::2] = -100
            out = run.model(input_ids=batch, labels=labels)
            return out.loss, int((labels[:, 1:] != -100).sum())

    try:
        report = finetune(gpt, tmp_path / "out", [corpus], steps=3, batch_size=2, objective="causal-even-tokens",
                          lr=3e-3, seed=0)
    finally:
        from posextend.training.objectives import base as objectives

        objectives._REGISTRY.items.pop("causal-even-tokens")
    assert report.objective == "causal-even-tokens" and len(report.losses) == 3
    assert seen == [[0, 1], [2, 3], [4, 5]]  # the samples' global numbers, in order
    assert torch.isfinite(torch.tensor(report.losses)).all()
    assert (tmp_path / "out" / "model.safetensors").is_file()


def _contains(row: torch.Tensor, part: torch.Tensor) -> bool:
    return any(torch.equal(row[i : i + len(part)], part) for i in range(len(row) - len(part) + 1))


def test_contrastive_queries_are_passages_of_the_documents_and_one_inserted_passage():
    from types import SimpleNamespace

    from posextend.training.context import sample_generator
    from posextend.training.objectives.contrastive import PASSAGE_TOKENS, Contrastive

    pool = torch.arange(50 * 200).reshape(50, 200)  # every token distinct: a passage is found where it came from
    batch = pool[:3] + 100_000
    run = SimpleNamespace(train_samples=pool)
    objective = get_objective("contrastive")
    assert isinstance(objective, Contrastive) and objective.inserted and objective.passages == 8
    documents, sets = objective._queries(run, batch, [sample_generator(0, p) for p in range(3)])
    assert len(sets) == 1 + objective.passages and all(len(s) == 3 for s in sets)
    for i, (document, original, inserted) in enumerate(zip(documents, batch, sets[0])):
        changed = (document != original).nonzero().flatten()
        assert len(changed) == PASSAGE_TOKENS and changed[-1] - changed[0] == PASSAGE_TOKENS - 1  # one window
        assert torch.equal(document[changed], inserted) and any(_contains(row, inserted) for row in pool)
        assert all(len(q[i]) == PASSAGE_TOKENS and _contains(document, q[i]) for q in sets[1:])
    again, sets_again = objective._queries(run, batch, [sample_generator(0, p) for p in range(3)])
    assert torch.equal(again, documents) and all(torch.equal(a, b) for x, y in zip(sets, sets_again) for a, b in zip(x, y))
