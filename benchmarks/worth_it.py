"""Are the one-command defaults worth it? ``posextend finetune SRC DST --data CORPUS --length 4xOLD``, nothing else.

    python benchmarks/worth_it.py --data ../shared/data/austen             # up to 15 min per cell on 2 CPU cores
    python benchmarks/worth_it.py --data ../shared/data/austen --quick     # ~1 min (used by the tests)

The quality grid's references (``quality_grid.py``: GPT-2s pretrained here at 128 positions on the texts
of ``--data`` that are not held out) are extended 2x and 4x by ``finetune`` with its defaults only: the
length, the training texts, the seed. The run holds out its own few percent of the training texts, measures
the source's sliding-window reading there, trains until it beats it (or its default budget, 15 minutes, is
spent) and gives its verdict. Each output is then scored on two texts it never trained on: the grid's
(``--tuned``, which the defaults were chosen by looking at) and one kept aside (``--aside``, never used to
choose anything). Per cell and text:

- ``far``: perplexity on the far range (the last half of the new length) against the source reading the same
  tokens through a sliding window of its own length (target: at or below it, ``far / window <= 1.00``);
- ``original Δ``: the first ``old`` positions against the source on the same positions (target: within +2%).

Beside them, the controls (what the same training gives without the longer context; the extension is worth it
only when the far range beats them too):

- ``self``: the fine-tuned model itself reading the far range through a sliding window of the old length;
- ``exact``: the source fine-tuned at its own length on the same training texts and as many tokens (the run's
  lr, schedule and batch; ``--no-exact`` leaves it out), read through its window. It trains on every training
  text, the few percent the run held out included.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import torch
import transformers
from quality import SETTINGS, build_reference, machine
from quality_grid import SIZES

import posextend
from posextend.scoring.by_position import position_losses
from posextend.data.text import read_documents
from posextend.scoring.text import pack
from posextend.scoring.verdict import MARGIN, TOLERANCE, far_start
from posextend.training.objectives.causal import CausalLM

TUNED, ASIDE = "emma.txt", "northangerabbey.txt"


def ranges(model, seqs: torch.Tensor, old: int, *, window: int | None = None) -> tuple[float, float]:
    """(far, original) perplexity of ``model`` on ``seqs`` (through a sliding ``window`` when given)."""
    total, count = position_losses(model, seqs, "causal", batch_size=8, window=window)
    start, n = far_start(seqs.shape[1], old), seqs.shape[1]
    far, original = (math.exp(float(total[a:b].sum() / count[a:b].sum())) for a, b in ((start, n), (0, old)))
    return far, original


def run_cell(name: str, settings: dict, factor: int, args, train_files: list[Path], texts: dict[str, list[str]]) -> dict:
    ref, _ = build_reference(args.cache, train_files, settings, args.seed)
    old, new = settings["length"], settings["length"] * factor
    out = args.out / f"{name}-{factor}x"
    t0 = time.perf_counter()
    report = posextend.finetune(ref, out, train_files, length=new, seed=args.seed, overwrite=True,
                                **({"budget": args.budget} if args.budget else {}))
    seconds = time.perf_counter() - t0
    tok = transformers.AutoTokenizer.from_pretrained(ref)
    source = transformers.AutoModelForCausalLM.from_pretrained(ref).eval()
    tuned = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    exact = train_exact(ref, out, report, old, train_files, args.data / args.tuned, args.seed) if args.exact else None
    row = {"size": name, "factor": factor, "seconds": seconds, "steps": report.steps, "tokens": report.tokens,
           "verdict": report.verdict.to_dict() if report.verdict else None}
    for label, docs in texts.items():
        seqs = pack(tok, docs, new)[: settings["eval_sequences"]]
        window_far, source_original = ranges(source, seqs, old, window=old)
        far, original = ranges(tuned, seqs, old)
        self_far, _ = ranges(tuned, seqs, old, window=old)
        row[label] = {"far": far, "window": window_far, "far_ratio": far / window_far, "original": original,
                      "source_original": source_original, "original_change": original / source_original - 1,
                      "self_window": self_far, "self_ratio": far / self_far}
        if exact is not None:
            row[label]["exact"] = ranges(exact, seqs, old, window=old)[0]
            row[label]["exact_ratio"] = far / row[label]["exact"]
    shutil.rmtree(out, ignore_errors=True)
    return row


def train_exact(ref: Path, out: Path, report, old: int, train_files: list[Path], eval_file: Path, seed: int):
    """The exact control: the source fine-tuned at its own length on the training texts and as many tokens as the
    run trained on (its lr and schedule, the causal objective's batch at the old length: what a user fine-tuning
    there runs, whatever batch the run took), held out nothing (``eval_file``, not a training text, is what its run reads;
    the texts scored are not training texts)."""
    batch = CausalLM.batch_size
    steps = max(1, round(report.tokens / (batch * old)))
    control = out.with_name(out.name + "-exact")
    posextend.finetune(ref, control, train_files, steps=steps, lr=report.lr, schedule=report.schedule,
                       batch_size=batch, seed=seed, overwrite=True, eval_data=[eval_file],
                       eval_sequences=2)
    model = transformers.AutoModelForCausalLM.from_pretrained(control).eval()
    shutil.rmtree(control, ignore_errors=True)
    return model


def table(rows: list[dict], labels: list[str]) -> str:
    head = " | ".join(f"{label}: far / window; / self; / exact; original Δ" for label in labels)
    lines = [f"| model | time | steps | the run's verdict (its own held-out split) | {head} |",
             "|---|---|---|---|" + "---|" * len(labels)]
    for r in rows:
        v = r["verdict"]
        said = "–"
        if v:
            head_word = ("worth it" if v["worth_it"] else "context did not help" if v.get("context_loses_to")
                         and v["far_ratio"] < 1 else "not yet")
            said = f"{head_word} ({v['far_ratio']:.3f}; {100 * v['original_change']:+.1f}%)"
        cells = [f"{r[label]['far']:.1f} / {r[label]['window']:.1f} = **{r[label]['far_ratio']:.3f}**; "
                 f"/ {r[label]['self_window']:.1f} = {r[label]['self_ratio']:.3f}; "
                 + (f"/ {r[label]['exact']:.1f} = {r[label]['exact_ratio']:.3f}; " if "exact" in r[label] else "")
                 + f"{100 * r[label]['original_change']:+.1f}%" for label in labels]
        lines.append(f"| {r['size']} {r['factor']}x | {r['seconds'] / 60:.1f} min | {r['steps']} | {said} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: dict[str, list[dict]], path: Path) -> None:
    """Each cell's held-out checks along its run (``runs``: a label, e.g. a version of posextend, and its rows):
    the far and the original range over the baseline's (the source through its own window, on the run's split)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    for i, (label, rows) in enumerate(runs.items()):
        for j, row in enumerate(r for r in rows if r["verdict"]):
            v, style = row["verdict"], ("-", "--", ":", "-.")[i % 4]
            minutes = [p["seconds"] / 60 for p in v["curve"]]
            for ax, key in zip(axes, ("far", "original")):
                ax.plot(minutes, [p[key] / v["baseline"][key] for p in v["curve"]], style, color=f"C{j}",
                        label=f"{row['size']} {row['factor']}x{', ' + label if label else ''}")
    verdicts = [row["verdict"] for rows in runs.values() for row in rows if row["verdict"]]
    for ax, title, lines in (
            (axes[0], "far range / the source through its own window (dotted: the margin)",
             sorted({1 - v.get("margin", MARGIN) for v in verdicts})),  # each run's own (the default has changed)
            (axes[1], "original range / the source's (dotted: the tolerance)",
             sorted({1 + v.get("tolerance", TOLERANCE) for v in verdicts}))):
        ax.axhline(1.0, color="k", linewidth=1)
        for line in lines:
            ax.axhline(line, color="k", linestyle=":", linewidth=1)
            ax.annotate(f"{abs(1 - line):.0%}", (1.0, line), xycoords=("axes fraction", "data"), fontsize=7,
                        ha="right", va="bottom")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("minutes of training")
    axes[0].set_ylabel("perplexity on the run's held-out split, over the baseline's")
    axes[1].legend(fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True, help="directory of .txt files")
    ap.add_argument("--tuned", default=TUNED, help="held-out text the defaults were chosen on")
    ap.add_argument("--aside", default=ASIDE, help="held-out text kept aside: never used to choose anything")
    ap.add_argument("--quick", action="store_true", help="a tiny reference and a 10 s budget (the tests)")
    ap.add_argument("--factors", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--sizes", nargs="+", help="only these reference sizes (default: all of the mode's)")
    ap.add_argument("--budget", help="the run's budget (default: finetune's own; --quick: 10s)")
    ap.add_argument("--no-exact", dest="exact", action="store_false",
                    help="leave out the exact control (the source fine-tuned at its own length on the same tokens)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", type=Path, default=Path(".cache/quality"), help="reference model cache")
    ap.add_argument("--out", type=Path, default=Path("worth-it-results"))
    args = ap.parse_args()
    mode = "quick" if args.quick else "full"
    args.budget = args.budget or ("10s" if args.quick else None)
    files = sorted(args.data.glob("*.txt"))
    held = [args.data / args.tuned, args.data / args.aside]
    train_files = [p for p in files if p not in held]
    if any(p not in files for p in held) or not train_files:
        raise SystemExit(f"--tuned and --aside must name two of {', '.join(p.name for p in files)} and leave one to train on")
    texts = {"tuned " + args.tuned.removesuffix(".txt"): read_documents([held[0]]),
             "aside " + args.aside.removesuffix(".txt"): read_documents([held[1]])}
    t_start = time.perf_counter()
    rows = []
    for name, changes in SIZES[mode].items():
        if args.sizes and name not in args.sizes:
            continue
        for factor in args.factors:
            rows.append(run_cell(name, {**SETTINGS[mode], **changes}, factor, args, train_files, texts))
            print(f"  {name} {factor}x: {json.dumps({k: v for k, v in rows[-1].items() if k != 'verdict'})}", flush=True)
    hardware = machine()
    text = table(rows, list(texts))
    meta = {"mode": mode, "seed": args.seed, "budget": args.budget or "finetune's default", "train": [p.name for p in train_files],
            "wall_seconds": time.perf_counter() - t_start, "hardware": hardware, "torch": torch.__version__,
            "posextend": posextend.__version__}
    print(f"\n{text}\n\n{meta['wall_seconds'] / 60:.1f} min on {hardware}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "worth_it.md").write_text(text + "\n")
    (args.out / "worth_it.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    plot({"": rows}, args.out / "worth_it.png")
    print(f"written: {args.out}/worth_it.md, worth_it.json, worth_it.png")


if __name__ == "__main__":
    main()
