"""Which strategy works? A small-scale Longformer Table 5, measured on real text.

    python benchmarks/quality.py --data ../shared/data/austen             # full (~20 min on 2 CPU cores; ~8 with the reference cached)
    python benchmarks/quality.py --data ../shared/data/austen --quick     # a few minutes
    python benchmarks/quality.py --data ../shared/data/austen --strategies tile interpolate   # only these

No GPT-2 or MLM checkpoint is available offline, so the reference model is made here,
honestly: a small GPT-2 pretrained from random init (with posextend's own training loop,
``--train all --schedule cosine``) at a short context, with a byte-level BPE trained on the training text
(4k vocabulary: a 50k one makes each CPU step ~8x slower). One novel (``--heldout``) is
never trained on and is the evaluation text. The reference is cached under ``--cache``.
It trains until its validation loss (on the end of the training text, never trained on)
has flattened: the full mode's 1500 cosine steps end with less than 1% fall over the last
fifth, and the script warns when a setting falls more, or rises (overfitting: at 2500
steps, ~10 passes over 0.5M tokens, the validation loss rose 1.6% over the last fifth).

Then, for every registered strategy, the reference is extended 4x through the public API
(``posextend.resize_checkpoint``) and evaluated with no training, and after a short
fine-tune (one fixed budget of steps) in each ``--train`` mode. Reported: held-out
perplexity per position bucket (the original range, then each quarter of the new range).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import time
from pathlib import Path

import torch
import transformers

import posextend
from posextend.data.text import read_documents
from posextend.scoring.text import pack
from posextend.scoring.by_position import score_model, plot_reports
from posextend.training.loop import finetune

MODES = ("new-rows", "positions", "all")
LR = {"new-rows": 1e-3, "positions": 1e-3, "all": 1e-4}  # the learning rates this table was measured with (constant)
SETTINGS = {
    #          short ctx, layers, width, vocab, pretrain steps, pretrain lr, ft steps, batch, eval seqs
    "quick": dict(schedule="cosine", length=64, n_layer=2, n_embd=64, vocab=1024, pretrain_steps=300, pretrain_lr=3e-3,
                  ft_steps=12, batch_size=8, eval_sequences=6, train_chars=600_000),
    "full": dict(schedule="cosine", length=128, n_layer=4, n_embd=192, vocab=4096, pretrain_steps=1500, pretrain_lr=2e-3,
                 ft_steps=150, batch_size=8, eval_sequences=48, train_chars=None),
}


def split_corpus(data: Path, heldout: str) -> tuple[list[Path], Path]:
    files = sorted(p for p in data.glob("*.txt"))
    held = data / heldout
    if held not in files:
        raise SystemExit(f"--heldout {heldout} is not among {', '.join(p.name for p in files)}")
    train = [p for p in files if p != held]
    if not train:
        raise SystemExit("need at least one training text besides the held-out one")
    return train, held


def flattening(curve: list[tuple[int, float]]) -> float:
    """Relative fall of the validation loss over the last fifth of pretraining (0.01 = 1%)."""
    last = curve[-1][1]
    at_80 = min(curve, key=lambda point: abs(point[0] - 0.8 * curve[-1][0]))[1]
    return (at_80 - last) / at_80


def build_reference(cache: Path, train_files: list[Path], s: dict, seed: int) -> tuple[Path, dict]:
    """Train tokenizer and model once; reuse them while the settings and data are the same."""
    recipe = 2  # bump when build_reference changes what it trains or records
    key = hashlib.sha256(json.dumps([s, [p.name for p in train_files], seed, recipe]).encode()).hexdigest()[:12]
    ref = cache / f"reference-{key}"
    if (ref / "reference.json").exists():
        return ref, {**json.loads((ref / "reference.json").read_text()), "reused": True}
    from tokenizers import ByteLevelBPETokenizer

    t0 = time.perf_counter()
    texts = [p.read_text(encoding="utf-8") for p in train_files]
    if s["train_chars"]:
        texts = [t[: s["train_chars"] // len(texts)] for t in texts]
    work = cache / f"work-{key}"
    shutil.rmtree(work, ignore_errors=True)
    (work / "init").mkdir(parents=True)
    for i, text in enumerate(texts):
        (work / f"train{i}.txt").write_text(text, encoding="utf-8")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=s["vocab"], special_tokens=["<|endoftext|>"])
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
        unk_token="<|endoftext|>", model_max_length=s["length"],
    )
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        vocab_size=len(tok), n_positions=s["length"], n_embd=s["n_embd"], n_layer=s["n_layer"],
        n_head=max(1, s["n_embd"] // 32), eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id,
    )
    transformers.GPT2LMHeadModel(cfg).save_pretrained(work / "init")
    tok.save_pretrained(work / "init")
    print(f"pretraining the reference ({s['n_layer']}x{s['n_embd']}, vocab {len(tok)}, {s['length']} positions, "
          f"{s['pretrain_steps']} steps)...", flush=True)
    report = finetune(
        work / "init", ref, sorted(work.glob("train*.txt")), steps=s["pretrain_steps"], train="all",
        lr=s["pretrain_lr"], schedule=s["schedule"], batch_size=16, seed=seed, overwrite=True,
        eval_every=max(1, s["pretrain_steps"] // 20), eval_sequences=64,  # validation: the end of the training text
        progress=lambda step, total, loss, tps: step % max(1, total // 10) == 0
        and print(f"  step {step}/{total}: loss {loss:.3f} ({tps:,.0f} tok/s)", flush=True),
    )
    n = len(report.losses)
    curve = {f"{q}%": sum(report.losses[int(n * q / 100) - n // 20: int(n * q / 100)]) / max(1, n // 20)
             for q in (25, 50, 75, 100)}
    info = {"tokens": report.tokens, "seconds": time.perf_counter() - t0, "loss_curve": curve,
            "validation_curve": report.eval_losses, "flattening": flattening(report.eval_losses),
            "vocab": len(tok), "length": s["length"]}
    (ref / "reference.json").write_text(json.dumps(info, indent=2))
    shutil.rmtree(work, ignore_errors=True)
    return ref, {**info, "reused": False}


def evaluate(path: Path, sequences: torch.Tensor, buckets: int, old: int | None):
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    return score_model(model, sequences, "causal", buckets=buckets, old_length=old, batch_size=8)


def strategies(chosen: list[str] | None) -> list[str]:
    """The registered strategies that extend a table of positions (not only a grid), or those of them ``chosen``."""
    every = [n for n, s in posextend.available_strategies().items() if 1 in s.ranks]
    unknown = sorted(set(chosen or ()) - set(every))
    if unknown:
        raise SystemExit(f"--strategies: no table strategy {', '.join(unknown)} (there are: {', '.join(every)})")
    return [n for n in every if not chosen or n in chosen]


def machine() -> str:
    """What a benchmark ran on, for its table and JSON: the GPU's name, or the CPU and its cores."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"{platform.machine()} CPU, {os.cpu_count()} cores"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True, help="directory of .txt files (one is held out)")
    ap.add_argument("--heldout", default="emma.txt", help="file in --data used only for evaluation")
    ap.add_argument("--quick", action="store_true", help="small settings that finish in a few minutes")
    ap.add_argument("--factor", type=int, default=4, help="extend the context this many times")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pretrain-steps", type=int, help="pretraining steps of the reference (cached per value)")
    ap.add_argument("--strategies", nargs="+", metavar="NAME", help="only these strategies (default: every one "
                    "that extends a table of positions)")
    ap.add_argument("--cache", type=Path, default=Path(".cache/quality"), help="reference model cache")
    ap.add_argument("--out", type=Path, default=Path("quality-results"), help="table, JSON and plot go here")
    args = ap.parse_args()
    s = dict(SETTINGS["quick" if args.quick else "full"])
    if args.pretrain_steps:
        s["pretrain_steps"] = args.pretrain_steps
    t_start = time.perf_counter()
    train_files, held = split_corpus(args.data, args.heldout)
    ref, ref_info = build_reference(args.cache, train_files, s, args.seed)
    if abs(ref_info["flattening"]) > 0.01:
        change = "still fell" if ref_info["flattening"] > 0 else "rose (overfitting)"
        print(f"warning: the reference's validation loss {change} {100 * abs(ref_info['flattening']):.1f}% over the "
              f"last fifth of pretraining; give --pretrain-steps {'more' if ref_info['flattening'] > 0 else 'fewer'} "
              "steps", flush=True)
    old, new = s["length"], s["length"] * args.factor
    tok = transformers.AutoTokenizer.from_pretrained(ref)
    held_text = read_documents([held])
    seq_new = pack(tok, held_text, new)[: s["eval_sequences"]]
    seq_old = seq_new.reshape(-1, old)  # the same tokens, cut at the reference's own length
    ft_data = [p for p in train_files]
    work = args.out / "models"
    shutil.rmtree(work, ignore_errors=True)

    rows: dict[str, dict] = {}
    reports = {}
    r = evaluate(ref, seq_old, 1, None)
    rows["reference @ own length"] = {"buckets": [r.buckets[0].perplexity], "overall": r.perplexity, "steps": 0}
    for strategy in strategies(args.strategies):
        ext = work / f"{strategy}-0"
        posextend.resize_checkpoint(ref, ext, new, strategy, seed=args.seed)
        r = evaluate(ext, seq_new, 5, old)
        rows[f"{strategy}, no training"] = {"buckets": [b.perplexity for b in r.buckets], "overall": r.perplexity,
                                            "steps": 0}
        reports[f"{strategy}, no training"] = r
        for mode in MODES:
            out = work / f"{strategy}-{mode}"
            t0 = time.perf_counter()
            # each mode alone (no anchor: from a copy extended already, it would anchor to that copy;
            # benchmarks/quality_grid.py measures the defaults)
            ft = finetune(ext, out, ft_data, steps=s["ft_steps"], train=mode, batch_size=s["batch_size"] // 2,
                          eval_sequences=1, seed=args.seed, old_length=old, anchor=0, lr=LR[mode],
                          schedule="constant")
            r = evaluate(out, seq_new, 5, old)
            label = f"{strategy} + {mode}"
            rows[label] = {"buckets": [b.perplexity for b in r.buckets], "overall": r.perplexity,
                           "steps": s["ft_steps"], "tokens": ft.tokens, "seconds": time.perf_counter() - t0}
            reports[label] = r
            shutil.rmtree(out)
            print(f"  {label}: overall perplexity {r.perplexity:.2f}", flush=True)
        shutil.rmtree(ext)

    hardware = machine()
    meta = {"mode": "quick" if args.quick else "full", "seed": args.seed, "settings": s, "reference": ref_info,
            "old_length": old, "new_length": new, "heldout": held.name, "train": [p.name for p in train_files],
            "eval_tokens": int(seq_new.numel()), "wall_seconds": time.perf_counter() - t_start,
            "hardware": hardware, "torch": torch.__version__, "posextend": posextend.__version__}
    labels = [f"{b.start}–{b.end - 1}" + (" (original)" if b.end <= old else "") for b in r.buckets]
    lines = [
        f"Held-out perplexity ({held.name}, {meta['eval_tokens']:,} tokens) by position; reference GPT-2 "
        f"{s['n_layer']}x{s['n_embd']} pretrained {s['pretrain_steps']} steps at {old} positions, extended to {new}; "
        f"fine-tunes: {s['ft_steps']} steps, batch {s['batch_size'] // 2} x {new} tokens; seed {args.seed}; "
        f"{hardware}; {meta['wall_seconds'] / 60:.1f} min "
        + (f"with the cached reference (its pretraining took {ref_info['seconds'] / 60:.1f} min)" if ref_info["reused"]
           else f"in all, of which pretraining the reference took {ref_info['seconds'] / 60:.1f} min (cached for later runs)")
        + ". The reference's validation loss "
        f"(the end of its training text) fell {100 * ref_info['flattening']:.1f}% over the last fifth of its "
        f"pretraining, to {ref_info['validation_curve'][-1][1]:.3f}.",
        "",
        "| model | steps | " + " | ".join(labels) + " | all |",
        "|---|---|" + "---|" * (len(labels) + 1),
    ]
    for label, row in rows.items():
        cells = row["buckets"] + [float("nan")] * (len(labels) - len(row["buckets"]))
        lines.append(f"| {label} | {row['steps']} | " + " | ".join("-" if c != c else f"{c:.2f}" for c in cells)
                     + f" | {row['overall']:.2f} |")
    table = "\n".join(lines)
    print("\n" + table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quality.md").write_text(table + "\n")
    (args.out / "quality.json").write_text(json.dumps({"meta": meta, "rows": rows, "columns": labels}, indent=2))
    colors = {name: f"C{i}" for i, name in enumerate(posextend.available_strategies())}
    dashes = {"no training": ":", "new-rows": "--", "positions": "-.", "all": "-"}
    styles = {label: {"color": colors[label.split(",")[0].split(" + ")[0]],
                      "linestyle": dashes[label.split(", ")[-1].split(" + ")[-1]]} for label in reports}
    plot_reports(reports, args.out / "quality.png", reference=rows["reference @ own length"]["overall"], styles=styles)
    shutil.rmtree(work, ignore_errors=True)
    print(f"\nwritten: {args.out}/quality.md, quality.json, quality.png")


if __name__ == "__main__":
    main()
