"""The LED recipe on a small BART: extend 4x, fine-tune with the seq2seq objective's defaults, score by position.

A small BART (byte-level BPE of 4k trained on the training text, BART's special tokens) is pretrained here
with gap-sentence generation (``posextend finetune --objective seq2seq`` at its own length), then extended
``--factor`` times with ``tile`` (LED's copies) and ``interpolate``, each scored untrained and after the
default fine-tune (``posextend.finetune(src, dst, data, length=...)``: lr 1e-4 cosine within the defaults'
15-minute budget, no anchor, no window anchor; ``tile`` also with the anchor at 1). The
score is the masked-sentence perplexity of held-out text (one novel, ``--heldout``), by where each masked
sentence sat in the source: near (the original range) and far (the last ``1 / factor`` of the new length),
against the source reading the same text in windows of its own length, and against the same fine-tuned model
reading it in windows of the old length (``self``: issue 60's target is far / self <= 1.00).

    python benchmarks/seq2seq.py --data ../shared/data/austen [--quick] [--json docs/seq2seq.json]
    python benchmarks/seq2seq.py --data ../shared/data/austen --recipes tile:lr=3e-4 tile:steps=600   # other options
    python benchmarks/seq2seq.py --data ../shared/data/austen --recipes tile tile:window_anchor=1     # the window anchor
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import time
from pathlib import Path

import torch
import transformers

import posextend

SETTINGS = {
    "quick": dict(length=64, layers=1, width=64, vocab=1024, pretrain_steps=150, pretrain_lr=3e-3, steps=20,
                  eval_sequences=8, train_chars=400_000),
    "full": dict(length=256, layers=2, width=128, vocab=4096, pretrain_steps=600, pretrain_lr=2e-3, steps=None,
                 eval_sequences=24, train_chars=None),
}


def build_reference(work: Path, train_files: list[Path], s: dict, seed: int) -> tuple[Path, dict]:
    """Tokenizer, a BART initialised at random, then pretrained with gap-sentence generation at its length;
    reused from ``work`` while the settings, the training files and the seed are the same."""
    from tokenizers import ByteLevelBPETokenizer
    from tokenizers.processors import TemplateProcessing

    key = {"settings": s, "train": [p.name for p in train_files], "seed": seed}
    init, ref = work / "init", work / "reference"
    if (ref / "reference.json").is_file():
        info = json.loads((ref / "reference.json").read_text())
        if info.pop("key") == key:
            return ref, {**info, "reused": True}
    for old in work.iterdir() if work.is_dir() else []:
        shutil.rmtree(old) if old.is_dir() else old.unlink()

    texts = [p.read_text(encoding="utf-8") for p in train_files]
    if s["train_chars"]:
        texts = [t[: s["train_chars"] // len(texts)] for t in texts]
    data = work / "train"
    data.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(texts):
        (data / f"train{i}.txt").write_text(text, encoding="utf-8")
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=s["vocab"], special_tokens=specials)
    bpe._tokenizer.post_processor = TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", pad_token="<pad>",
                                               eos_token="</s>", unk_token="<unk>", mask_token="<mask>",
                                               model_max_length=s["length"])
    config = transformers.BartConfig(
        vocab_size=len(tok), d_model=s["width"], encoder_layers=s["layers"], decoder_layers=s["layers"],
        encoder_attention_heads=max(1, s["width"] // 32), decoder_attention_heads=max(1, s["width"] // 32),
        encoder_ffn_dim=4 * s["width"], decoder_ffn_dim=4 * s["width"], max_position_embeddings=s["length"],
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, decoder_start_token_id=tok.eos_token_id,
        forced_eos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    transformers.BartForConditionalGeneration(config).save_pretrained(init)
    tok.save_pretrained(init)
    print(f"pretraining the reference BART ({s['layers']}+{s['layers']} layers x {s['width']}, vocab {len(tok)}, "
          f"{s['length']} positions, {s['pretrain_steps']} steps)...", flush=True)
    t0 = time.perf_counter()
    report = posextend.finetune(
        init, ref, sorted(data.glob("*.txt")), objective="seq2seq", steps=s["pretrain_steps"], train="all",
        lr=s["pretrain_lr"], schedule="cosine", batch_size=8, seed=seed, overwrite=True, eval_sequences=32,
        progress=lambda step, total, loss, tps: step % max(1, total // 5) == 0
        and print(f"  step {step}/{total}: loss {loss:.3f} ({tps:,.0f} tok/s)", flush=True))
    info = {"seconds": time.perf_counter() - t0, "held_out_perplexity": report.after.perplexity,
            "first_loss": report.losses[0], "last_loss": report.losses[-1], "vocab": len(tok)}
    (ref / "reference.json").write_text(json.dumps({**info, "key": key}))
    return ref, {**info, "reused": False}


RECIPES = ["tile", "tile:anchor=1", "interpolate"]


def recipe(text: str) -> tuple[str, dict]:
    """``"tile:anchor=1,lr=1e-3"`` -> ``("tile", {"anchor": 1, "lr": 0.001})``: each value an int, else a float, else text."""
    strategy, _, rest = text.partition(":")
    options = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        options[key] = _number(value)
    return strategy, options


def _number(value: str) -> int | float | str:
    for kind in (int, float):
        with contextlib.suppress(ValueError):
            return kind(value)
    return value


def ranges(report, old: int, new: int) -> dict[str, float]:
    """Masked-sentence perplexity near (the original range) and far (the last ``old`` positions)."""
    return {"near": report.range_perplexity(0, old), "far": report.range_perplexity(new - old, new),
            "all": report.perplexity}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True, help="directory of .txt files (one is held out)")
    ap.add_argument("--heldout", default="emma.txt", help="file in --data used only for evaluation")
    ap.add_argument("--factor", type=int, default=4, help="extend the source's length this many times")
    ap.add_argument("--quick", action="store_true", help="small settings that finish in about a minute")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", type=Path, default=Path(".bench/seq2seq"))
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--recipes", nargs="+", default=RECIPES, metavar="STRATEGY[:KEY=VALUE,...]",
                    help="fine-tunes to run, each a strategy and the options that differ from the defaults "
                         f"(default: {' '.join(RECIPES)})")
    args = ap.parse_args()
    s = SETTINGS["quick" if args.quick else "full"]
    held = args.data / args.heldout
    train_files = sorted(p for p in args.data.glob("*.txt") if p != held)
    if not held.is_file() or not train_files:
        raise SystemExit(f"--data needs {args.heldout} and at least one other .txt file")
    start = time.perf_counter()
    ref, info = build_reference(args.workdir, train_files, s, args.seed)
    old, new = s["length"], s["length"] * args.factor
    score = dict(objective="seq2seq", buckets=args.factor, max_sequences=s["eval_sequences"], seed=args.seed)
    own = posextend.evaluate(ref, [held], length=old, **{**score, "buckets": 1})
    rows = {f"source at its own length ({old}-token windows)": {"near": own.perplexity, "far": own.perplexity,
                                                                "all": own.perplexity}}
    seconds = {}
    recipes = [recipe(r) for r in args.recipes]
    for strategy, extra in recipes:
        resized = args.workdir / f"{strategy}-{new}"
        if f"{strategy}, untrained" not in rows:
            posextend.resize_checkpoint(ref, resized, new, strategy, seed=args.seed, overwrite=True)
            rows[f"{strategy}, untrained"] = ranges(posextend.evaluate(resized, [held], length=new, **score), old, new)
        label = f"{strategy} + seq2seq fine-tune ({'defaults' if not extra else ', '.join(f'{k} {v}' for k, v in extra.items())})"
        t0 = time.perf_counter()
        tuned = args.workdir / f"{strategy}-{new}-ft{len(seconds)}"
        posextend.finetune(ref, tuned, train_files, length=new, strategy=strategy, seed=args.seed, overwrite=True,
                           **{**({"steps": s["steps"]} if s["steps"] else {}), **extra})
        seconds[label] = time.perf_counter() - t0
        rows[label] = ranges(posextend.evaluate(tuned, [held], length=new, **score), old, new)
        # its control: the same fine-tuned model reading the text in windows of the old length
        rows[label]["self"] = posextend.evaluate(tuned, [held], length=old, **{**score, "buckets": 1}).perplexity
    reference = rows[f"source at its own length ({old}-token windows)"]["all"]
    print(f"\n### BART {s['layers']}+{s['layers']}x{s['width']}, {old} -> {new} positions; held-out "
          f"{args.heldout}, masked-sentence perplexity by source position\n")
    print(f"| model | near (0-{old - 1}) | far ({new - old}-{new - 1}) | far / source | itself in {old}-token windows | "
          "far / itself |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        own_windows = f"{r['self']:.1f} | {r['far'] / r['self']:.3f}" if "self" in r else "– | –"
        print(f"| {name} | {r['near']:.1f} | {r['far']:.1f} | {r['far'] / reference:.3f} | {own_windows} |")
    total = time.perf_counter() - start
    print(f"\nreference: pretrained {s['pretrain_steps']} steps in {info['seconds']:.0f} s (loss {info['first_loss']:.2f} "
          f"-> {info['last_loss']:.2f}); fine-tunes {', '.join(f'{k} {v:.0f} s' for k, v in seconds.items())}; "
          f"{total:.0f} s in all")
    if args.json:
        args.json.write_text(json.dumps({"settings": s, "factor": args.factor, "heldout": args.heldout,
                                         "reference": info, "rows": rows, "fine_tune_seconds": seconds,
                                         "seconds": total}, indent=2))


if __name__ == "__main__":
    main()
