"""Does the recommended recipe hold beyond one benchmark? A grid of settings, one table.

    python benchmarks/quality_grid.py --data ../shared/data/austen            # ~30 min on 2 CPU cores (14 with the references cached)
    python benchmarks/quality_grid.py --data ../shared/data/austen --quick    # ~1 min (used by the tests)

Cells: two reference sizes (one with ``--quick``): small GPT-2s pretrained here from random init,
as in ``quality.py``, on the texts of ``--data`` that are not held out; × two extension factors
(2x, 4x) × two held-out texts (never trained on). Every recipe (strategy, train mode, anchor,
lr; posextend's defaults where unnamed) is fine-tuned once per size and factor from the
reference (150 steps, batch 4) and scored on both held-out texts. Three recipes are plug-ins
registered here: PoSE (arXiv 2309.10400; an objective): windows of the old length whose position
ids skip ahead to cover the new length, at the same token budget (batch 4 x factor); a sliding-
window teacher (an objective): the anchor's KL to the source extended to the new range, where the
source reads the last old-length tokens; and ``byparts`` (a strategy): the table's lowest DCT
components stretched, the rest continued periodically (YaRN's "by parts" for a learned table).
``--recipes``, ``--factors`` and ``--steps`` run a part of the grid. Per cell:

- ``far / in-range``: perplexity on the far range (the last half of the new length: the 3rd and
  4th quarters at 4x, the new rows at 2x), divided by the source model's perplexity within its
  own length on the same text (cut at that length). Target: <= 1.00.
- ``original Δ``: the change of perplexity on the original range (the first ``old`` positions of
  each sequence) against the source on the same positions. Target: within 2%.
- ``far gain``: how much the far range improved over the same recipe before training.

A first row, for reference: the source itself on the far range's tokens, each read through a
sliding window of its own length (how hard those tokens are for it, against its in-range average).
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

import posextend
from posextend.data.text import read_documents
from posextend.scoring.text import pack
from posextend.scoring.by_position import score_model, position_losses
from posextend.training.objectives import get_objective, register_objective
from posextend.training.objectives.causal import CausalLM
from posextend.training.loop import finetune

HELDOUT = ("emma.txt", "northangerabbey.txt")
SIZES = {  # name: changes to quality.py's settings
    "full": {
        "2x128": dict(n_layer=2, n_embd=128, pretrain_steps=1200),
        "4x192": {},
    },
    "quick": {"2x48": dict(n_layer=2, n_embd=48, pretrain_steps=150)},
}
FACTORS = (2, 4)

# label: finetune's arguments besides posextend's defaults (``posextend finetune``'s); "pose": the PoSE objective;
# "resized": fine-tune the output of resize-model (the two-command path: the anchor finds the original by provenance)
RECIPES = {
    "defaults, all: interpolate, lr 1e-3 cosine, anchor 1": {},
    "resize-model (interpolate), then finetune with the defaults": {"resized": True},
    "all, lr 1e-4 constant (the defaults before)": {"lr": 1e-4, "schedule": "constant"},
    "all, no anchor": {"anchor": 0.0},
    "kps + all": {"strategy": "kps"},
    "PoSE windows + all (same tokens)": {"pose": True},
    "sliding-window teacher on the new range + all": {"teacher": True},
    "defaults, 1.6x the steps (the teacher's time at 4x)": {"steps_scale": 1.6},
    "byparts (4 lowest DCT components stretched) + all": {"strategy": "byparts"},
    "defaults, new-rows: tile, lr 3e-3": {"train": "new-rows"},
    "tile + new-rows, lr 1e-3": {"train": "new-rows", "lr": 1e-3},
    "interpolate + new-rows (lr 3e-3)": {"train": "new-rows", "strategy": "interpolate"},
}


class PoSE(CausalLM):
    """Causal LM on windows of ``1 / factor`` of the new length; each window's position ids are
    split at a random point and the second part skips ahead by a random offset, so every position
    of the new length is trained without reading that many tokens (arXiv 2309.10400). The anchor
    compares the first part (positions as the source reads them) with the source."""

    factor: int = 1

    def samples(self, tokenizer, documents, length):
        return pack(tokenizer, documents, length // self.factor)

    def loss(self, run, positions, batch):
        device = run.accelerator.device
        batch = batch.to(device)
        n = batch.shape[1]
        cuts, ids = [], []
        for p in positions:
            g = run.generator(p)
            cut = int(torch.randint(1, n, (1,), generator=g))
            skip = int(torch.randint(run.sizes.length.new - n + 1, (1,), generator=g))
            cuts.append(cut)
            ids.append(torch.cat([torch.arange(cut), torch.arange(cut, n) + skip]))
        ids = torch.stack(ids)
        out = run.model(input_ids=batch, position_ids=ids.to(device), labels=batch)
        loss = out.loss
        if run.reference is not None:  # the anchor, on each window's first part (read at the source's positions)
            first = (torch.arange(n, device=device)[None] < torch.tensor(cuts, device=device)[:, None]).float()
            loss = loss + self.anchor * self.reference_kl(run, batch, out.logits, first)
        return loss, batch.shape[0] * (n - 1)


class WindowTeacher(CausalLM):
    """The anchor on every position: the old range as the source reads it, and the new range in
    blocks of half the old length, each taught by the source reading the old-length window that
    ends with it (so with half to all of the old length of context)."""

    def loss(self, run, positions, batch):
        batch = batch.to(run.accelerator.device)
        out = run.model(input_ids=batch, labels=batch)
        old, n = run.sizes.length.old, batch.shape[1]
        kl = self.reference_kl(run, batch[:, :old], out.logits[:, :old])
        step, far = old // 2, 0.0
        for start in range(old, n, step):
            end = min(start + step, n)
            far = far + self.reference_kl(run, batch[:, end - old : end], out.logits[:, start:end]) * ((end - start) / (n - old))
        return out.loss + self.anchor * (kl + far), batch.shape[0] * (n - 1)


@posextend.register_strategy("byparts", description="Lowest DCT components stretched, the rest periodic.")
def byparts(table: torch.Tensor, new_len: int, *, generator: torch.Generator, low: int = 4) -> torch.Tensor:
    """The table as a DCT-II series over its positions: the ``low`` lowest-frequency components
    (absolute position) are stretched over the new length like ``interpolate``; the others (local
    structure) keep their wavelengths and continue as the series does (mirrored periods)."""
    old = table.shape[0]
    k = torch.arange(old, dtype=torch.float64)
    basis = torch.cos(torch.pi * k[:, None] * (k[None] + 0.5) / old)  # component k at old position p
    coeff = (2.0 / old) * basis @ table.double()
    coeff[0] /= 2
    p = torch.arange(new_len, dtype=torch.float64)
    stretched = (p + 0.5) * (old / new_len) - 0.5
    at = lambda x, ks: torch.cos(torch.pi * ks[None] * (x[:, None] + 0.5) / old)  # noqa: E731
    return (at(stretched, k[:low]) @ coeff[:low] + at(p, k[low:]) @ coeff[low:]).to(table.dtype)


def plugin_objective(base: type, name: str, **attrs) -> str:
    """Register a subclass of ``base`` as objective ``name`` (once) and return the name."""
    try:
        get_objective(name)
    except posextend.PosExtendError:
        register_objective(name)(type(name.title().replace("-", ""), (base,), attrs))
    return name


def pose_objective(factor: int) -> str:
    """The PoSE objective for extending ``factor``-fold."""
    return plugin_objective(PoSE, f"causal-pose-{factor}x", factor=factor)


def perplexities(path: Path, seqs: torch.Tensor, old: int) -> tuple[float, float]:
    """(original range, far range) perplexity of the model at ``path`` on ``seqs``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    report = score_model(model, seqs, "causal", buckets=4, batch_size=8)
    new = seqs.shape[1]
    return report.range_perplexity(0, old), report.range_perplexity(new // 2, new)


def source_scores(ref: Path, seqs: torch.Tensor, old: int) -> dict[str, float]:
    """The source model within its own length: on the held-out text cut at ``old`` (in-range), on
    the first ``old`` positions of each long sequence (the original range), and on the far range's
    tokens read through a sliding window (what the source itself makes of those tokens)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(ref)
    in_range = score_model(model, seqs.reshape(-1, old), "causal", buckets=1, batch_size=8).perplexity
    original = score_model(model, seqs[:, :old], "causal", buckets=1, batch_size=8).perplexity
    return {"in_range": in_range, "original": original, "far_window": window_perplexity(model, seqs, old)}


def window_perplexity(model, seqs: torch.Tensor, old: int) -> float:
    """The source's perplexity on the far range's tokens (the last half of each sequence), each
    block of half the old length read with the old-length window that ends with it."""
    n, step = seqs.shape[1], old // 2
    loss = count = 0.0
    for start in range(n // 2, n, step):
        end = min(start + step, n)
        total, tokens = position_losses(model, seqs[:, end - old : end], "causal", batch_size=8)
        loss += float(total[start - (end - old) :].sum())
        count += float(tokens[start - (end - old) :].sum())
    return math.exp(loss / count)


def run_size(name: str, s: dict, args, train_files: list[Path], held: dict[str, str], work: Path,
             recipes: dict[str, dict]) -> list[dict]:
    ref, info = build_reference(args.cache, train_files, s, args.seed)
    how = "cached" if info["reused"] else f"pretrained in {info['seconds'] / 60:.1f} min"
    print(f"[{name}] reference: validation loss {info['validation_curve'][-1][1]:.3f}, {how}", flush=True)
    tok = transformers.AutoTokenizer.from_pretrained(ref)
    rows = []
    for factor in args.factors:
        old, new = s["length"], s["length"] * factor
        seqs = {h: pack(tok, text, new)[: s["eval_sequences"]] for h, text in held.items()}
        source = {h: source_scores(ref, x, old) for h, x in seqs.items()}
        for label, recipe in recipes.items():
            steps = round((args.steps or s["ft_steps"]) * recipe.get("steps_scale", 1))
            kwargs = {"train": "all", "batch_size": 4, "steps": steps,
                      **{k: v for k, v in recipe.items() if k not in ("pose", "teacher", "steps_scale", "resized")}}
            if recipe.get("pose"):  # the same tokens per step as the full-length recipes
                kwargs.update(objective=pose_objective(factor), batch_size=4 * factor)
            if recipe.get("teacher"):
                kwargs["objective"] = plugin_objective(WindowTeacher, "causal-window-teacher")
            strategy = kwargs.setdefault("strategy", get_objective("causal").strategy[kwargs["train"]])
            start, out = work / f"{name}-{factor}-{strategy}", work / f"{name}-{factor}-{len(rows)}"
            if not start.exists():  # the untrained start, for the far range's gain
                posextend.resize_checkpoint(ref, start, new, strategy, seed=args.seed)
            t0 = time.perf_counter()  # from the reference itself, or from its resize (whose provenance names it)
            src, length = (start, None) if recipe.get("resized") else (ref, new)
            finetune(src, out, train_files, length=length, eval_sequences=1, seed=args.seed, **kwargs)
            seconds = time.perf_counter() - t0
            for h, x in seqs.items():
                (orig0, far0), (orig, far) = perplexities(start, x, old), perplexities(out, x, old)
                row = {"size": name, "factor": factor, "heldout": h, "recipe": label, "seconds": seconds,
                       "source_in_range": source[h]["in_range"], "source_original": source[h]["original"],
                       "source_far_window": source[h]["far_window"],
                       "original": orig, "far": far, "far_untrained": far0, "original_untrained": orig0,
                       "far_ratio": far / source[h]["in_range"], "original_change": orig / source[h]["original"] - 1,
                       "far_gain": 1 - far / far0}
                rows.append(row)
                print(f"  {name} {factor}x {h} {label}: far/in-range {row['far_ratio']:.3f}, original "
                      f"{100 * row['original_change']:+.1f}%, far gain {100 * row['far_gain']:.0f}%", flush=True)
            shutil.rmtree(out)
    return rows


def source_window_ratios(rows: list[dict], cells: list[tuple]) -> list[float]:
    """Per cell, the source's own sliding-window perplexity on the far tokens over its in-range one."""
    by_cell = {(r["size"], r["factor"], r["heldout"]): r for r in rows}
    return [by_cell[c]["source_far_window"] / by_cell[c]["source_in_range"] for c in cells]


def table(rows: list[dict]) -> str:
    cells = sorted({(r["size"], r["factor"], r["heldout"]) for r in rows}, key=lambda c: (c[0], c[1], c[2]))
    head = " | ".join(f"{size} {factor}x {h.removesuffix('.txt')}" for size, factor, h in cells)
    lines = ["far / in-range (target <= 1.00); original Δ (target within 2%); far gain over the untrained start",
             "", f"| recipe | {head} | worst far / in-range | original Δ, lowest…highest |",
             "|---|" + "---|" * (len(cells) + 2)]
    window = source_window_ratios(rows, cells)
    lines.append("| *the source itself on the far range's tokens, through a sliding window of its length* | "
                 + " | ".join(f"{w:.2f}" for w in window) + f" | {max(window):.2f} | – |")
    for recipe in dict.fromkeys(r["recipe"] for r in rows):
        mine = {(r["size"], r["factor"], r["heldout"]): r for r in rows if r["recipe"] == recipe}
        parts = [f"{mine[c]['far_ratio']:.2f}; {100 * mine[c]['original_change']:+.1f}%; {100 * mine[c]['far_gain']:.0f}%"
                 for c in cells]
        worst_ratio = max(r["far_ratio"] for r in mine.values())
        changes = [100 * r["original_change"] for r in mine.values()]
        lines.append(f"| {recipe} | " + " | ".join(parts) + f" | {worst_ratio:.2f} | {min(changes):+.1f}…{max(changes):+.1f}% |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sorted({(r["size"], r["factor"], r["heldout"]) for r in rows})
    recipes = list(dict.fromkeys(r["recipe"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    width = 0.8 / len(recipes)
    colors = plt.get_cmap("tab20").colors
    for i, recipe in enumerate(recipes):
        mine = {(r["size"], r["factor"], r["heldout"]): r for r in rows if r["recipe"] == recipe}
        xs = [j + i * width for j in range(len(cells))]
        color = colors[(2 * i) % 20 + (2 * i) // 20]  # the darker shades first: distinct for up to 20 recipes
        axes[0].bar(xs, [mine[c]["far_ratio"] for c in cells], width, label=recipe, color=color)
        axes[1].bar(xs, [100 * mine[c]["original_change"] for c in cells], width, label=recipe, color=color)
    axes[0].hlines(source_window_ratios(rows, cells),
                   [j - width / 2 for j in range(len(cells))], [j + 0.8 - width / 2 for j in range(len(cells))],
                   color="k", linewidth=1.5, label="the source itself on the far tokens (sliding window)")
    for ax, target, title in ((axes[0], [1.0], "far range / source in-range perplexity"),
                              (axes[1], [-2, 2], "original range: change vs source (%)")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cells))],
                      [f"{s} {f}x\n{h.removesuffix('.txt')[:9]}" for s, f, h in cells], fontsize=7)
        for t in target:
            ax.axhline(t, color="k", linestyle=":", linewidth=1)
        ax.set_title(title, fontsize=10)
    axes[0].set_ylim(bottom=0.5)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True, help="directory of .txt files (two are held out)")
    ap.add_argument("--heldout", nargs=2, default=HELDOUT, help="two files in --data used only for evaluation")
    ap.add_argument("--quick", action="store_true", help="small settings that finish in a few minutes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--recipes", nargs="+", metavar="TEXT", help="only the recipes whose label contains one of these")
    ap.add_argument("--steps", type=int, help="fine-tuning steps of every recipe (default: 150; --quick: fewer)")
    ap.add_argument("--factors", nargs="+", type=int, default=list(FACTORS), help="extension factors (default: 2 4)")
    ap.add_argument("--cache", type=Path, default=Path(".cache/quality"), help="reference model cache")
    ap.add_argument("--out", type=Path, default=Path("quality-results"), help="table, JSON and plot go here")
    args = ap.parse_args()
    t_start = time.perf_counter()
    mode = "quick" if args.quick else "full"
    files = sorted(args.data.glob("*.txt"))
    missing = [h for h in args.heldout if args.data / h not in files]
    if missing or len(files) <= len(args.heldout):
        raise SystemExit(f"--heldout must name two of {', '.join(p.name for p in files)} and leave one to train on")
    train_files = [p for p in files if p.name not in args.heldout]
    recipes = {k: v for k, v in RECIPES.items() if not args.recipes or any(t in k for t in args.recipes)}
    if not recipes:
        raise SystemExit(f"--recipes matches none of: {'; '.join(RECIPES)}")
    held = {h: read_documents([args.data / h]) for h in args.heldout}
    work = args.out / "grid-models"
    shutil.rmtree(work, ignore_errors=True)
    rows = []
    for name, changes in SIZES[mode].items():
        rows += run_size(name, {**SETTINGS[mode], **changes}, args, train_files, held, work, recipes)
    shutil.rmtree(work, ignore_errors=True)
    hardware = machine()
    meta = {"mode": mode, "seed": args.seed, "sizes": SIZES[mode], "factors": args.factors, "recipes": recipes, "steps": args.steps,
            "heldout": list(args.heldout), "train": [p.name for p in train_files],
            "wall_seconds": time.perf_counter() - t_start, "hardware": hardware, "torch": torch.__version__,
            "posextend": posextend.__version__}
    text = table(rows)
    print(f"\n{text}\n\n{meta['wall_seconds'] / 60:.1f} min on {hardware}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quality_grid.md").write_text(text + "\n")
    (args.out / "quality_grid.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    plot(rows, args.out / "quality_grid.png")
    print(f"written: {args.out}/quality_grid.md, quality_grid.json, quality_grid.png")


if __name__ == "__main__":
    main()
