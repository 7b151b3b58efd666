"""Every architecture spec × every strategy × {Python API, CLI}, on tiny random models."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors import safe_open
from typer.testing import CliRunner

import posextend
from conftest import load_clean, tree_digest
from posextend.cli import app
from tiny import FAMILIES, POSITIONS, build

NEW = 100  # not a multiple of 37 (nor of 512)
STRATEGIES = ["tile", "interpolate", "random"]


def test_every_spec_has_a_tiny_config_in_the_matrix():
    assert set(posextend.SPECS) == set(FAMILIES), "add a tiny config to tests/tiny.py for every new spec"


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    cache = {}

    def get(model_type):
        if model_type not in cache:
            cache[model_type] = build(FAMILIES[model_type], tmp_path_factory.mktemp(model_type) / "src")
        return cache[model_type]

    return get


def _tables(model: torch.nn.Module, spec) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    return {n: params[n].detach().clone() for n in spec.table_names(frozenset(params))}


def _forward(model, family, length):
    ids = torch.randint(5, 900, (2, length))
    kwargs = {"decoder_input_ids": ids} if family.seq2seq else {}
    with torch.no_grad():
        out = model(input_ids=ids, **kwargs)
    logits = out[0]
    assert logits.shape[:2] == (2, length) and torch.isfinite(logits).all()


def _check_tables(old: dict, new: dict, strategy: str):
    assert old.keys() == new.keys() and old
    for name, before in old.items():
        after = new[name]
        reserved = before.shape[0] - POSITIONS
        assert after.shape == (NEW + reserved, before.shape[1])
        assert torch.equal(after[:reserved], before[:reserved]), f"{name}: reserved rows must be bit-exact"
        usable_old, usable_new = before[reserved:], after[reserved:]
        if strategy == "tile":  # tiles the real rows, never the reserved ones
            assert torch.equal(usable_new, usable_old[torch.arange(NEW) % POSITIONS])
        elif strategy == "random":
            assert torch.equal(usable_new[:POSITIONS], usable_old)
        else:
            assert torch.equal(usable_new[0], usable_old[0]) and torch.equal(usable_new[-1], usable_old[-1])


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_api(checkpoints, tmp_path, model_type, strategy):
    family = FAMILIES[model_type]
    model = load_clean(checkpoints(model_type), family.headed)
    spec = posextend.SPECS[model_type]
    assert model.base_model_prefix == spec.prefix
    old = _tables(model, spec)
    posextend.extend_model(model, NEW, strategy, seed=0)
    _check_tables(old, _tables(model, spec), strategy)
    _forward(model, family, NEW)
    model.save_pretrained(tmp_path)
    reloaded = load_clean(tmp_path, family.headed)
    _forward(reloaded, family, NEW)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_cli(checkpoints, tmp_path, model_type, strategy):
    family = FAMILIES[model_type]
    src = checkpoints(model_type)
    before = tree_digest(src)
    info = json.loads(CliRunner().invoke(app, ["inspect", str(src), "--json"]).output)
    dst = tmp_path / "out"
    r = CliRunner().invoke(app, ["resize-model", str(src), str(dst), "--length", str(NEW), "-s", strategy, "--seed", "0"])
    assert r.exit_code == 0, r.output
    assert tree_digest(src) == before

    def read(path, names):
        with safe_open(path / "model.safetensors", "pt") as f:
            return {n: f.get_tensor(n) for n in names}

    names = [t["name"] for t in info["tables"]]
    _check_tables(read(src, names), read(dst, names), strategy)
    model = load_clean(dst, family.headed)
    _forward(model, family, NEW)

    after = json.loads(CliRunner().invoke(app, ["inspect", str(dst), "--json"]).output)
    reserved = info["tables"][0]["rows"] - POSITIONS
    assert (info["usable"], info["reserved"]) == (POSITIONS, reserved)
    assert (after["usable"], after["reserved"]) == (NEW, reserved)
    if family.tokenizer is not None:
        assert after["tokenizer_max_length"] == NEW
        assert transformers.AutoTokenizer.from_pretrained(dst).model_max_length == NEW
    cfg = json.loads((dst / "config.json").read_text())
    spec = posextend.SPECS[model_type]
    assert cfg[spec.length_keys[0]] == NEW + (reserved if spec.config_counts_reserved else 0)


def test_gpt_neo_local_attention_band_is_extended(checkpoints):
    model = load_clean(checkpoints("gpt_neo"), FAMILIES["gpt_neo"].headed)
    posextend.extend_model(model, NEW)
    n, window = NEW, 5
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
    local = causal ^ torch.tril(causal, -window)
    masks = [layer.attn.attention.bias[0, 0] for layer in model.transformer.h]
    assert torch.equal(masks[0], causal) and torch.equal(masks[1], local)


def test_nystromformer_position_ids_keep_their_offset(checkpoints):
    model = load_clean(checkpoints("nystromformer"), FAMILIES["nystromformer"].headed)
    posextend.extend_model(model, NEW)
    ids = model.nystromformer.embeddings.position_ids
    assert torch.equal(ids, torch.arange(2, NEW + 2).view(1, NEW))
    assert model.nystromformer.embeddings.position_embeddings.weight.shape[0] == NEW + 2


def test_roberta_keeps_padding_idx_and_nonstandard_pad(tmp_path):
    family = FAMILIES["roberta"]
    cfg = family.config()
    cfg.pad_token_id, cfg.max_position_embeddings = 3, POSITIONS + 4  # reserved = pad + 1 = 4
    model = transformers.RobertaModel(cfg)
    posextend.extend_model(model, NEW)
    emb = model.embeddings.position_embeddings
    assert emb.padding_idx == 3 and emb.num_embeddings == NEW + 4
    assert model.config.max_position_embeddings == NEW + 4
    _forward(model, family, NEW)


# ------------------------------------------------------------------ families without a written spec: the probe

def _tapas():
    cfg = transformers.TapasConfig(vocab_size=1000, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                   intermediate_size=48, max_position_embeddings=POSITIONS)
    return transformers.TapasModel(cfg).eval()


def test_probe_in_memory_for_a_type_without_spec():
    model = _tapas()
    assert "tapas" not in posextend.SPECS
    old = model.embeddings.position_embeddings.weight.detach().clone()
    posextend.extend_model(model, NEW, "tile")
    new = model.embeddings.position_embeddings.weight
    assert torch.equal(new, old[torch.arange(NEW) % POSITIONS])
    assert model.config.max_position_embeddings == NEW
    with torch.no_grad():
        out = model(input_ids=torch.randint(5, 900, (1, NEW)))
    assert out.last_hidden_state.shape == (1, NEW, 16)


def test_probe_on_disk_verifies_and_inspect_says_so(tmp_path):
    src = tmp_path / "tapas"
    _tapas().save_pretrained(src)
    info = posextend.inspect_checkpoint(src)
    assert (info.spec, info.covered_by, info.usable) == ("probed", "probed", POSITIONS)
    assert [t.name for t in info.tables] == ["embeddings.position_embeddings.weight"]
    report = posextend.resize_checkpoint(src, tmp_path / "out", NEW)
    assert report.covered_by == "probed" and report.verified
    model = load_clean(tmp_path / "out", transformers.TapasModel)
    with torch.no_grad():
        assert model(input_ids=torch.randint(5, 900, (1, NEW))).last_hidden_state.shape[1] == NEW


def test_probe_resizes_every_table_one_field_drives():
    """LUKE's entity positions index token positions: its second table follows the same length."""
    cfg = transformers.LukeConfig(vocab_size=1000, entity_vocab_size=50, hidden_size=16, entity_emb_size=16,
                                  num_hidden_layers=1, num_attention_heads=2, intermediate_size=48,
                                  max_position_embeddings=POSITIONS)
    model = transformers.LukeModel(cfg)
    old = model.entity_embeddings.position_embeddings.weight.detach().clone()
    posextend.extend_model(model, NEW)
    # RoBERTa-style: word positions start at padding_idx + 1 = 2, and the config counts those rows
    assert model.config.max_position_embeddings == NEW + 2
    entity = model.entity_embeddings.position_embeddings.weight
    assert model.embeddings.position_embeddings.weight.shape[0] == entity.shape[0] == NEW + 2
    assert torch.equal(entity[:POSITIONS], old)
    with torch.no_grad():
        out = model(input_ids=torch.randint(5, 900, (1, NEW)))
    assert out.last_hidden_state.shape == (1, NEW, 16)


def test_probe_refuses_a_config_that_disagrees_with_the_weights():
    model = _tapas()
    model.config.max_position_embeddings = 999
    with pytest.raises(posextend.CorruptCheckpointError, match="the config and the weights disagree"):
        posextend.extend_model(model, NEW)
    assert model.embeddings.position_embeddings.weight.shape[0] == POSITIONS  # untouched


def test_written_specs_agree_with_what_the_probe_observes():
    """Every written spec states what a twin of the family shows (tables, reserved rows, length field)."""
    from posextend.families.probe import observe

    for model_type, family in FAMILIES.items():
        spec = posextend.SPECS[model_type]
        cfg = family.config()
        headed = type(family.headed.from_config(cfg))  # the concrete class behind the Auto class
        config = {**cfg.to_dict(), "model_type": model_type, "architectures": [headed.__name__]}
        observed = {s.length_keys[0]: s for s in observe(config)}
        assert spec.length_keys[0] in observed, f"{model_type}: the probe finds no table for {spec.length_keys[0]}"
        seen = observed[spec.length_keys[0]]
        prefix = f"{spec.prefix}." if spec.prefix else ""
        names = {t.removeprefix(prefix) for t in seen.tables}
        assert names == set(spec.tables), f"{model_type}: spec {spec.tables}, observed {seen.tables}"
        assert seen.reserved_rows(config) == spec.reserved_rows(config), model_type
        assert seen.usable_from_config(config) == spec.usable_from_config(config), model_type
