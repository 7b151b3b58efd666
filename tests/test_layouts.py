"""Every checkpoint layout (single, sharded, .bin, sharded .bin) and dtype round-trips exactly."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from safetensors import safe_open

import posextend
from conftest import load_clean, tree_digest
from tiny import FAMILIES

NEW = 90
TABLE = "transformer.wpe.weight"


def _as_bin(path, shards: int) -> None:
    """Rewrite a safetensors checkpoint as legacy pytorch_model.bin (optionally sharded)."""
    from safetensors.torch import load_file

    state = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    if shards == 1:
        torch.save(state, path / "pytorch_model.bin")
        return
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        part = {n: state[n] for n in names[i::shards]}
        fname = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        torch.save(part, path / fname)
        weight_map.update({n: fname for n in part})
    (path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture(scope="module", params=[torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def dtype(request):
    return request.param


def _make(tmp_path, layout, dtype):
    src = tmp_path / "src"
    fam = FAMILIES["gpt2"]
    torch.manual_seed(0)
    model = fam.headed.from_config(fam.config()).to(dtype)
    if layout == "sharded":
        model.save_pretrained(src, max_shard_size="20KB")
    else:
        model.save_pretrained(src)
    if layout.startswith("bin"):
        _as_bin(src, 1 if layout == "bin" else 3)
    return src


def _read_all(path):
    out = {}
    files = sorted(path.glob("*.safetensors"))
    for f in files:
        with safe_open(f, "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def _read_source(path):
    if list(path.glob("*.safetensors")):
        return _read_all(path)
    out = {}
    for f in sorted(path.glob("*.bin")):
        out.update(torch.load(f, weights_only=True))
    return out


@pytest.mark.parametrize("layout", ["single", "sharded", "bin", "bin-sharded"])
def test_layout_round_trip(tmp_path, layout, dtype):
    src = _make(tmp_path, layout, dtype)
    before = tree_digest(src)
    dst = tmp_path / "dst"
    report = posextend.resize_checkpoint(src, dst, NEW, "interpolate", seed=0)
    assert tree_digest(src) == before
    old, new = _read_source(src), _read_all(dst)
    assert set(new) == set(old)
    assert torch.equal(new[TABLE], posextend.resize_table(old[TABLE], NEW, "interpolate"))
    assert new[TABLE].dtype == dtype
    for name in set(old) - {TABLE}:
        assert new[name].dtype == old[name].dtype and torch.equal(new[name], old[name]), name
    if layout in ("sharded", "bin-sharded"):
        index = json.loads((dst / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(old)
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in new.values())
        assert index["metadata"]["posextend.new_length"] == str(NEW)
        assert len(report.files_rewritten) + len(report.files_copied) == len(set(index["weight_map"].values()))
    if layout.startswith("bin"):
        assert not list(dst.glob("*.bin")) and report.files_rewritten
    model = load_clean(dst, transformers.GPT2LMHeadModel)
    assert model.dtype == dtype and model.transformer.wpe.weight.shape == (NEW, 16)


def test_sharded_untouched_shards_are_copied_or_linked_not_rewritten(tmp_path):
    src = _make(tmp_path, "sharded", torch.float32)
    shards = sorted(src.glob("model-*.safetensors"))
    assert len(shards) >= 3
    for link in (False, True):
        dst = tmp_path / f"dst-{link}"
        report = posextend.resize_checkpoint(src, dst, NEW, link=link)
        with_table = [s.name for s in shards if TABLE in safe_open(s, "pt").keys()]
        assert report.files_rewritten == with_table
        assert sorted(report.files_copied) == sorted(s.name for s in shards if s.name not in with_table)
        for name in report.files_copied:
            assert (dst / name).read_bytes() == (src / name).read_bytes()
            same_inode = os.stat(dst / name).st_ino == os.stat(src / name).st_ino
            assert same_inode == link
        load_clean(dst, transformers.GPT2LMHeadModel)


def test_interrupted_mid_stream_leaves_no_dst_and_no_temp(tmp_path):
    src = _make(tmp_path, "sharded", torch.float32)
    dst = tmp_path / "dst"

    def interrupt(done, total):
        if done > total // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        posextend.resize_checkpoint(src, dst, NEW, progress=interrupt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    # and the next run succeeds
    posextend.resize_checkpoint(src, dst, NEW)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]


def test_failed_shard_copy_leaves_no_dst_and_no_temp(tmp_path, monkeypatch):
    """Whole-shard copies run in threads beside the rewrite: a failure there still cleans up."""
    import posextend.resize.writer as writer

    src = _make(tmp_path, "sharded", torch.float32)
    real_copy = writer.copy_file
    calls = []

    def failing_copy(source, target, **kwargs):
        calls.append(source.name)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real_copy(source, target, **kwargs)

    monkeypatch.setattr(writer, "copy_file", failing_copy)
    with pytest.raises(posextend.DestinationError, match="no space left"):
        posextend.resize_checkpoint(src, tmp_path / "dst", NEW)
    assert len(calls) >= 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_overwrite_failure_keeps_the_old_dst(tmp_path):
    src = _make(tmp_path, "single", torch.float32)
    dst = tmp_path / "dst"
    posextend.resize_checkpoint(src, dst, 50)
    before = tree_digest(dst)
    with pytest.raises(KeyboardInterrupt):
        posextend.resize_checkpoint(src, dst, NEW, overwrite=True, progress=lambda d, t: (_ for _ in ()).throw(KeyboardInterrupt))
    assert tree_digest(dst) == before


def test_truncated_shard_is_reported(tmp_path):
    src = _make(tmp_path, "sharded", torch.float32)
    shard = sorted(src.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(posextend.CorruptCheckpointError, match="truncated or damaged"):
        posextend.resize_checkpoint(src, tmp_path / "dst", NEW)
    assert not (tmp_path / "dst").exists()
