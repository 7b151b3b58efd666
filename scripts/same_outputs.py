"""Digests of everything a fixed-seed fine-tune and evaluation write, on the tests' tiny models, one run per built-in
objective (and a plug-in's way in): the check that a redesign changed no behaviour.

    python scripts/same_outputs.py --write before.json    # on the code before
    python scripts/same_outputs.py --check before.json    # on the code after: lists every difference, exit 1 if any

What is digested: every tensor written (name, dtype, shape, bytes), every JSON file (config, processor, tokenizer,
the report) and the model card with run times and dates removed, and the library's report objects (losses,
evaluations by bucket, verdict readings) with their times removed. Runs on CPU, one thread, in about two minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import io
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
TIMES = re.compile(r"(second|time|per_s|rate|date|dst|path|src|source_dir|load_average)", re.I)
VOLATILE = re.compile(r"\d+(\.\d+)? ?(s|seconds|min|minutes|ms)\b|\d{4}-\d\d-\d\d[T ][\d:.]+|/tmp/\S+|\d[\d,.]* (tokens|items|pairs|images)/s")


def _clean(value: Any) -> Any:
    """A report as data, its times, rates and paths removed (they differ between any two runs)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items() if not TIMES.search(str(k))}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, float):
        return float.hex(value)
    if isinstance(value, (int, str, bool)) or value is None:
        return VOLATILE.sub("<t>", value) if isinstance(value, str) else value
    return repr(type(value).__name__)


def _folder(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    out = {}
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        name, h = str(file.relative_to(path)), hashlib.sha256()
        if file.suffix == ".safetensors":
            with safe_open(str(file), "pt") as f:
                for key in sorted(f.keys()):
                    t = f.get_tensor(key)
                    h.update(f"{key}{t.dtype}{tuple(t.shape)}".encode())
                    h.update(t.contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())
        elif file.suffix == ".json":
            h.update(json.dumps(_clean(json.loads(file.read_text())), sort_keys=True).encode())
        elif file.suffix in (".md", ".txt", ".jsonl", ".model", ".bpe"):
            h.update(VOLATILE.sub("<t>", file.read_text(errors="replace")).encode())
        else:
            continue  # plots: drawn from the numbers digested above
        out[name] = h.hexdigest()[:16]
    return out


def _report(report: Any) -> str:
    data = report.to_dict() if hasattr(report, "to_dict") else report
    return hashlib.sha256(json.dumps(_clean(data), sort_keys=True, default=str).encode()).hexdigest()[:16]


def runs(work: Path) -> dict[str, dict]:
    """Each objective's run on a tiny model: its folder's digests and its report's."""
    import torch

    import posextend
    import tiny
    from conftest import AUSTEN

    torch.set_num_threads(1)
    text = work / "text.txt"
    text.write_text((AUSTEN / "northangerabbey.txt").read_text(encoding="utf-8")[20_000:60_000])
    fams = tiny.FAMILIES
    gpt = tiny.build(dataclasses.replace(fams["gpt2"], overrides={**fams["gpt2"].overrides, "n_positions": 32,
                     "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}, usable=32), work / "gpt")
    bert = tiny.build(dataclasses.replace(fams["bert"], overrides={**fams["bert"].overrides,
                      "max_position_embeddings": 32}, usable=32), work / "bert")
    st = tiny.sentence_transformer(work / "st")
    bart = tiny.bart(work / "bart")
    out: dict[str, dict] = {}

    def finetune(name: str, src: Path, data: list[Path], **options: Any) -> None:
        dst = work / "out" / name
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            # checks every step where not set: a run left to choose skips checks that would take more than a share
            # of its time (timing, not behaviour)
            report = posextend.finetune(src, dst, [str(d) for d in data], seed=0, **{"eval_every": 1, **options})
        out[name] = {"report": _report(report), "files": _folder(dst)}
        print(f"  {name}: {len(out[name]['files'])} files", flush=True)

    finetune("causal", gpt, [text], length=64, steps=3, eval_sequences=4)
    finetune("causal-budget", gpt, [text], length=64, budget="6 steps", eval_sequences=4, eval_every=2)
    finetune("causal-lora", gpt, [text], length=64, steps=3, eval_sequences=4, train="lora")
    finetune("masked", bert, [text], length=64, steps=3, eval_sequences=4)
    finetune("contrastive", st, [text], length=128, steps=2, eval_sequences=4)
    finetune("seq2seq", bart, [text], length=128, steps=2, eval_sequences=4)
    finetune("causal-new-rows", gpt, [text], length=64, steps=3, eval_sequences=4, train="new-rows")
    _images(work, finetune)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        evaluated = posextend.evaluate(work / "out" / "causal", [str(text)], length=64, max_sequences=4)
    out["evaluate"] = {"report": _report(evaluated), "files": {}}
    return out


def _images(work: Path, finetune) -> None:
    """The vision and image-text objectives on the tests' towers, digits and captions."""
    import test_image_text as it
    import test_vision_finetune as vf
    import torch
    import transformers

    digits = vf.digits.__wrapped__(_Factory(work / "digits"))
    tower = work / "vit"
    torch.manual_seed(0)
    cls, kind, overrides, processor = vf.TOWERS["vit"]
    cls(transformers.AutoConfig.for_model(kind, **vf._TOWER, **overrides)).save_pretrained(tower)
    (tower / "preprocessor_config.json").write_text(json.dumps(processor))
    finetune("vision", tower, [digits["labelled"]], image_size=vf.NEW, steps=3, eval_data=[str(digits["aside"])])
    finetune("vision-label-free", tower, [digits["plain"]], image_size=vf.NEW, steps=3, objective="vision")
    clip = it.tiny_clip(work / "clip")
    train, held = it.pairs(work / "pairs" / "train"), it.pairs(work / "pairs" / "held", 24, seed=1)
    finetune("image-text", clip, [train], eval_data=[str(held)], length=it.NEW, steps=2)
    finetune("image-text-size", clip, [train], eval_data=[str(held)], image_size=it.BIGGER, steps=2)


class _Factory:
    """What a session fixture's ``tmp_path_factory`` gives: ``mktemp``."""

    def __init__(self, root: Path):
        self.root = root

    def mktemp(self, name: str) -> Path:
        path = self.root / name
        path.mkdir(parents=True, exist_ok=True)
        return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", type=Path, help="write the digests here")
    group.add_argument("--check", type=Path, help="compare with the digests written here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        found = runs(Path(tmp))
    if args.write:
        args.write.write_text(json.dumps(found, indent=1, sort_keys=True))
        print(f"wrote {args.write}: {len(found)} runs")
        return 0
    before = json.loads(args.check.read_text())
    differ = [f"{run} {part}" for run in sorted(set(before) | set(found))
              for part in sorted(set(before.get(run, {}).get("files", {})) | set(found.get(run, {}).get("files", {})) | {"report"})
              if (before.get(run, {}).get("files", {}) | {"report": before.get(run, {}).get("report")}).get(part)
              != (found.get(run, {}).get("files", {}) | {"report": found.get(run, {}).get("report")}).get(part)]
    print("\n".join(f"differs: {d}" for d in differ) or f"same: {len(found)} runs, every file and report")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
