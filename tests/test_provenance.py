"""Provenance on models saved by other code (a fine-tune saves through save_pretrained): every safetensors
header and the index carry it, so the loader that reads either finds it."""

from __future__ import annotations

import torch
import transformers
from conftest import load_clean
from safetensors import safe_open
from tiny import FAMILIES, build

from posextend.io import SAFE_INDEX, add_metadata, read_header
from posextend.loading import provenance


def test_every_shard_and_the_index_carry_the_metadata(tmp_path):
    src = build(FAMILIES["gpt2"], tmp_path / "src")
    model = transformers.AutoModelForCausalLM.from_pretrained(src)
    out = tmp_path / "sharded"
    model.save_pretrained(out, max_shard_size="400KB")
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) > 1 and (out / SAFE_INDEX).is_file()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    add_metadata(out, {"posextend.source": str(src), "posextend.old_length": "37"})
    assert provenance(out)["posextend.old_length"] == "37"  # read from the index
    for shard in shards:
        assert read_header(shard)[1]["posextend.source"] == str(src) and read_header(shard)[1]["format"] == "pt"
        with safe_open(str(shard), "pt") as f:
            assert all(torch.equal(f.get_tensor(k), before[k]) for k in f.keys())
    assert not list(out.glob("*.posextend-tmp"))
    load_clean(out, transformers.AutoModelForCausalLM)
