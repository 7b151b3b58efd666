"""No harm first: does an extended, fine-tuned LM read its far tokens worse with its whole context than
through its old window, and which change fixes it? (issue 60, item 1)

    python benchmarks/no_harm.py --data ../shared/data/austen --json docs/no_harm.json   # ~30 min on 1 CPU core (+15 to pretrain the reference once)
    python benchmarks/no_harm.py --data ../shared/data/austen --quick                      # ~30 s
    python benchmarks/no_harm.py --data ../shared/data/austen --candidates defaults "no window anchor" \
        --budget 15min --exact                                                             # ~35 min on 2 cores
    python benchmarks/no_harm.py --data ../shared/data/austen --reference grid-2x128 ...   # another source (below)
    python benchmarks/no_harm.py --data ../shared/data/austen --candidates defaults --budget 15min --budget-control

``--budget`` gives every candidate the same wall-clock budget (``finetune``'s own: it stops early once its held-out
reading stops improving), two candidates side by side on one core each, so that a candidate whose step costs more
trains fewer of them on the same machine at the same time. ``--exact`` also trains each candidate's exact control
(``worth_it.train_exact``: the source fine-tuned at its own length on the same novels and as many tokens) and reads
the far range against it through its window (``whole / exact``; the issue's second target, <= 1.00). That control
trains a fixed number of steps and can overfit; ``--budget-control`` (with ``--budget``) trains what a user would run
instead of extending, side by side with the candidates: the source fine-tuned at its own length with the same budget
and ``finetune``'s defaults (its own held-out tail, its early stop), read through its window (``whole / budget
control``, a table of its own).

A small GPT-2 is pretrained here at ``length`` positions (``quality.py``'s ``build_reference``, cached) on the
``--train`` novels, extended 4x and fine-tuned on the same novels, every candidate for the same number of
steps of the same batch (equal cost; a candidate whose step costs more trains fewer: ``COST``; the seconds are
printed, but on a shared machine they follow its load). Two novels are never trained on: ``--tuned`` (the one
choices were made by looking at) and ``--aside`` (kept aside, never used to choose). Per candidate and novel,
after training and untrained (step 0):

- ``whole``: perplexity on the far range (the last half of the new length) reading the whole context;
- ``self``: the same model reading those tokens through a sliding window of the old length, at positions
  ``0..old-1`` (its own control); ``whole / self`` is the target (<= 1.00: the longer context does no harm);
- ``source``: the source reading them through its own window (``whole / source``);
- ``in place``: the same model through the same window, each window at its tokens' own positions in the long
  sequence: against ``self`` it isolates the far positions, against ``whole`` the longer context;
- ``original Δ``: the first ``old`` positions against the source's (target: within 2%).

Why, per candidate (a second table): the far range with the first layer, and with the later layers, made to see
only the last ``old`` keys (``table_causes.banded``), and the first layer's attention entropy at positions
``old - 1`` and ``4 * old - 1`` (a head averaging its whole prefix spreads as the log of the position).

``--reference`` picks the source: ``issue60`` (the default, the model above), ``grid-2x128`` (``worth_it.py``'s and
``quality_grid.py``'s 2 x 128 at 128 positions, extended to 512: the same cached reference), ``16rows`` (3 x 128 at
16 positions, extended to 64: a table too short for the window anchor's probe, which then keeps its weight) or
``pretrained-longer`` (issue 60's model pretrained 4,000 steps, not 2,000: a source already good at its size).

``--seen`` scores a training novel too (not a target: what the longer context does on text trained on).

Candidates (``--candidates`` picks some):

- ``defaults``: ``finetune(src, dst, data, length=4*old)``, nothing else (interpolate, train all, lr 1e-3 cosine,
  anchor 1, window anchor 1: the new range pulled toward the model's own reading through its old window, the
  default since the ninth session; the candidates below keep it unless they say otherwise);
- ``no window anchor``: the defaults with ``window_anchor=0`` (the defaults before the ninth session: every row of
  the first two sessions' tables was trained so);
- ``temperature``: the interpolated table with YaRN's attention temperature folded into the query and key
  projections (each scaled by 0.1 ln s + 1, s the length factor: the logits by its square), then the same
  fine-tune (anchored to the source);
- ``tile``: the tile strategy in place of interpolate;
- ``no-anchor``: the defaults with ``anchor=0`` (the anchor holds the first ``old`` positions, which see at most
  ``old`` keys, to the source: it keeps the self control as good as the source);
- ``temperature, no anchor``: both;
- ``window teacher``: the anchor on every position, the far range taught by the source reading it through its
  own window (``quality_grid.py``'s objective), at 1/1.6 of the steps (its step costs 1.6x at 4x);
- ``anchor 0.3``: the defaults with a weaker anchor;
- ``table lr x10``, ``table lr x0.1``: the position table at that multiple of the run's lr
  (``table_causes.table_lr``: the new rows train on fewer updates than the old ones had);
- ``self teacher``: the defaults, plus the far range taught by the model itself reading each block through its
  old window (:class:`SelfTeacher`: the whole context must read at least as its own window does), at 1/1.9 of
  the steps;
- ``byparts``: ``quality_grid.py``'s strategy (the table's 4 lowest DCT components stretched, the rest continued
  at their own wavelengths: YaRN's "by parts" for a learned table) in place of interpolate.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import math
import multiprocessing
import shutil
import time
from pathlib import Path

import torch
import transformers
from quality import SETTINGS, build_reference, machine
from quality_grid import SIZES, WindowTeacher, plugin_objective
from table_causes import banded, entropy_by_position, table_lr
from worth_it import ranges, train_exact

import posextend
from posextend.data.text import read_documents
from posextend.scoring.by_position import evaluating, token_losses, windows
from posextend.scoring.text import pack
from posextend.scoring.verdict import far_start
from posextend.training.objectives.causal import CausalLM

MODES = {
    # the reference: 3 layers x 128 at 64 positions (issue 60's model), pretrained on --train
    "full": dict(SETTINGS["full"], length=64, n_layer=3, n_embd=128, pretrain_steps=2000, eval_sequences=128),
    "quick": dict(SETTINGS["quick"], length=32, n_layer=2, n_embd=48, pretrain_steps=60, eval_sequences=4,
                  train_chars=200_000),
}
# --reference: the source extended in full mode (each pretrained once on --train, cached). Not the defaults' own
# model: the grid's 2 x 128 at 128 positions (worth_it.py's and quality_grid.py's, the same cached reference),
# a table of 16 rows (its probe window, 4 tokens, is too short to read: the window anchor keeps its weight) and
# issue 60's model pretrained twice as long (a source already good at its size)
REFERENCES = {
    "issue60": MODES["full"],
    "grid-2x128": dict(SETTINGS["full"], **SIZES["full"]["2x128"]),
    "16rows": dict(MODES["full"], length=16, pretrain_steps=4000, eval_sequences=512),
    "pretrained-longer": dict(MODES["full"], pretrain_steps=4000),
}
STEPS = {"full": 500, "quick": 6}  # fine-tune steps of every candidate (the defaults' batch: before 2026-12-08 4 x the
# new length, since then 1)
FACTOR = 4
# label: (strategy, fold the temperature, finetune's options besides length/steps/seed)
CANDIDATES = {
    "defaults": ("interpolate", False, {}),
    "no window anchor": ("interpolate", False, {"window_anchor": 0.0}),
    "temperature": ("interpolate", True, {}),
    "tile": ("tile", False, {}),
    "no-anchor": ("interpolate", False, {"anchor": 0.0}),
    "temperature, no anchor": ("interpolate", True, {"anchor": 0.0}),
    # the anchor on every position: the far range taught by the source reading it through its own window
    # (quality_grid.py's objective); a step costs 1.6x the defaults' at 4x (quality_grid's measure), so it trains
    # 1/1.6 of their steps
    "window teacher": ("interpolate", False, {"objective": "window-teacher"}),
    # added in the sixth session of 2026-11-28: a weaker anchor, the table's own lr, YaRN's by-parts for a table
    "anchor 0.3": ("interpolate", False, {"anchor": 0.3}),
    "table lr x10": ("interpolate", False, {}),
    "table lr x0.1": ("interpolate", False, {}),
    "byparts": ("byparts", False, {}),
    "self teacher": ("interpolate", False, {"objective": "self-teacher"}),
    # the defaults before 2026-12-08: 4 sequences of the new length a step (the defaults now take as many tokens a step
    # as 4 sequences of the old length: 1 sequence at 4x, so 4x the updates on the same tokens)
    "batch 4": ("interpolate", False, {"batch_size": 4}),
}
TABLE_LR = {"table lr x10": 10.0, "table lr x0.1": 0.1}  # the position table at this multiple of the run's lr
# a step's cost over the defaults' before the window anchor (the others: 1; no-anchor's is lower, given 1), for runs of
# fixed steps; the self teacher's, measured side by side with the defaults' on one core each: 1,030-1,181 tokens/s
# against 2,149. --budget needs none: every candidate gets the same time
COST = {"window teacher": 1.6, "self teacher": 1.9}


class SelfTeacher(CausalLM):
    """The causal objective, plus the KL divergence of the far range's predictions from the model's own reading of
    each block of half the old length through the old-length window that ends with it (no gradient through that
    reading, dropout off for it), weighted by the block's share of the new range."""

    def loss(self, run, positions, batch):
        batch = batch.to(run.accelerator.device)
        out = run.model(input_ids=batch, labels=batch)
        old, n = run.sizes.length.old, batch.shape[1]
        loss = out.loss + self.anchor * self.reference_kl(run, batch[:, :old], out.logits[:, :old])
        blocks = [(start, min(start + old // 2, n)) for start in range(old, n, old // 2)]
        with evaluating(run.model), torch.no_grad():
            taught = [run.model(input_ids=batch[:, end - old:end]).logits[:, start - end:] for start, end in blocks]
        for (start, end), target in zip(blocks, taught):
            kl = torch.nn.functional.kl_div(out.logits[:, start:end].float().log_softmax(-1),
                                            target.float().log_softmax(-1), log_target=True, reduction="none")
            loss = loss + kl.sum(-1).mean() * ((end - start) / (n - old))
        return loss, batch.shape[0] * (n - 1)


def temperature(factor: float) -> float:
    """YaRN's sqrt(1/t) for a length factor ``factor``: what the query and the key are each multiplied by."""
    return 0.1 * math.log(factor) + 1


def fold_temperature(model: transformers.GPT2LMHeadModel, scale: float) -> None:
    """Multiply every layer's attention logits by ``scale ** 2``: GPT-2's fused ``c_attn`` (a Conv1D, weight
    ``[width, 3 * width]``: query, key, value column blocks) gets its query and key columns and biases times
    ``scale``."""
    width = model.config.n_embd
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight[:, : 2 * width] *= scale
            block.attn.c_attn.bias[: 2 * width] *= scale


def start_model(ref: Path, dst: Path, new: int, strategy: str, fold: bool, seed: int) -> Path:
    """The untrained start: ``ref`` resized to ``new`` by ``strategy``, the temperature folded in when ``fold``."""
    posextend.resize_checkpoint(ref, dst, new, strategy, seed=seed, overwrite=True)
    if fold:
        model = transformers.AutoModelForCausalLM.from_pretrained(dst)
        fold_temperature(model, temperature(FACTOR))
        model.save_pretrained(dst)
    return dst


def _finetune(ref: Path, start: Path, dst: Path, train_files: list[Path], new: int, strategy: str, fold: bool, old: int,
              seed: int, options: dict):
    """One candidate's fine-tune: from the folded copy when ``fold`` (its length and strategy are the copy's
    already; the anchor holds to the reference), else from the reference with ``strategy``."""
    if fold:
        return posextend.finetune(start, dst, train_files, seed=seed, progress=progress, source=ref, old_length=old,
                                  overwrite=True, **options)
    return posextend.finetune(ref, dst, train_files, length=new, strategy=strategy, seed=seed, overwrite=True,
                              progress=progress, **options)


@torch.no_grad()
def far_in_place(model, seqs: torch.Tensor, old: int) -> float:
    """Far-range perplexity read through the old-length sliding window, each window at its tokens' own positions
    in the long sequence (position ids ``first..end-1``, not ``0..old-1``): the new rows' positions with the old
    window's context. Against ``self`` it isolates the positions; against ``whole``, the extra context."""
    n, start = seqs.shape[1], far_start(seqs.shape[1], old)
    loss = count = 0.0
    for first, a, end in windows(n, old):
        if end <= start:
            continue
        ids = torch.arange(first, end)[None].expand(seqs.shape[0], -1)
        logits = model(input_ids=seqs[:, first:end], position_ids=ids).logits.float()
        lo = max(a, start)  # predicted tokens at positions lo..end-1, from the logits one before each
        losses = token_losses(logits[:, lo - first - 1 : end - first - 1], seqs[:, lo:end])
        loss, count = loss + float(losses.double().sum()), count + losses.numel()
    return math.exp(loss / count)


def read(model, seqs: torch.Tensor, old: int) -> dict:
    """Far range whole, through the old window (the same model) and through it in place; original range."""
    far, original = ranges(model, seqs, old)
    self_far, _ = ranges(model, seqs, old, window=old)
    return {"whole": far, "self": self_far, "whole_over_self": far / self_far, "original": original,
            "in_place": far_in_place(model, seqs, old)}


def why(model, seqs: torch.Tensor, old: int) -> dict:
    """Which layers use keys past the old window at the far positions: the far range with the first layer, and
    with the later layers, made to see only the last ``old`` keys; the first layer's attention entropy at the old
    window's last position and the new length's (a head averaging its whole prefix spreads with the position).
    ``model``: loaded with eager attention, the path :func:`table_causes.banded` patches."""
    layers = model.config.n_layer
    with banded({0}, old):
        first, _ = ranges(model, seqs, old)
    with banded(set(range(1, layers)), old):
        later, _ = ranges(model, seqs, old)
    n = seqs.shape[1]
    return {"first_layer_in_window": first, "later_layers_in_window": later,
            "entropy": entropy_by_position(model, seqs[:16], [old - 1, n - 1])}


def scored(path: Path, texts: dict[str, torch.Tensor], old: int, source: dict, exact=None) -> dict:
    """Each text read by the model at ``path`` (:func:`read`, :func:`why`), against the source's window and, when
    given, the exact control's (``exact``: a model at the old length)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    eager = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    out = {}
    for label, seqs in texts.items():
        r = read(model, seqs, old)
        r["why"] = why(eager, seqs, old)
        r["whole_over_source"] = r["whole"] / source[label]["window"]
        r["original_change"] = r["original"] / source[label]["original"] - 1
        if exact is not None:
            r["exact"], _ = ranges(exact, seqs, old, window=old)
            r["whole_over_exact"] = r["whole"] / r["exact"]
        out[label] = r
    return out


def table(rows: dict, source: dict, labels: list[str]) -> str:
    exact = any("exact" in r for row in rows.values() for r in row.get("trained", {}).values())
    head = " | ".join(f"{t}: whole / self = ratio;{' whole / exact;' if exact else ''} whole / source; in place; "
                      "original Δ" for t in labels)
    lines = [f"| candidate | steps | seconds | {head} |", "|---|---|---|" + "---|" * len(labels)]
    lines.append("| source (its own window) | – | – | " + " | ".join(
        f"far {source[t]['window']:.1f}; original {source[t]['original']:.1f}" for t in labels) + " |")
    for name, row in rows.items():
        for when in ("untrained", "trained"):
            if when not in row:
                continue
            cells = [f"{row[when][t]['whole']:.1f} / {row[when][t]['self']:.1f} = **{row[when][t]['whole_over_self']:.3f}**;"
                     + (f" {row[when][t]['exact']:.1f} = **{row[when][t]['whole_over_exact']:.3f}**;"
                        if "exact" in row[when][t] else " –;" if exact else "")
                     + f" {row[when][t]['whole_over_source']:.3f}; {row[when][t]['in_place']:.1f};"
                     f" {100 * row[when][t]['original_change']:+.1f}%"
                     for t in labels]
            steps, secs = (row["steps"], f"{row['seconds']:.0f}") if when == "trained" else (0, "–")
            lines.append(f"| {name}{', untrained' if when == 'untrained' else ''} | {steps} | {secs} | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines)


def why_table(rows: dict, labels: list[str]) -> str:
    """Per candidate, before and after training: the far range whole, with the first layer and with the later
    layers seeing only the old window's keys, and the first layer's entropy at the old and the new last position."""
    head = " | ".join(f"{t}: whole; first layer in window; later layers in window; entropy" for t in labels)
    lines = [f"| candidate | {head} |", "|---|" + "---|" * len(labels)]
    for name, row in rows.items():
        for when in ("untrained", "trained"):
            if when in row:
                cells = []
                for t in labels:
                    r, w = row[when][t], row[when][t]["why"]
                    low, high = (w["entropy"][k] for k in sorted(w["entropy"], key=int))
                    cells.append(f"{r['whole']:.1f}; {w['first_layer_in_window']:.1f}; {w['later_layers_in_window']:.1f};"
                                 f" {low:.2f} → {high:.2f}")
                lines.append(f"| {name}{', untrained' if when == 'untrained' else ''} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def progress(step: int, total: int, loss: float, tps: float) -> None:
    if step % max(1, total // 5) == 0 or step == 10:
        print(f"    step {step}/{total}: loss {loss:.3f} ({tps:,.0f} tok/s)", flush=True)


def window_readings(model, texts: dict[str, torch.Tensor], old: int) -> dict:
    """Each text read by ``model`` through its ``old``-token window: the far range and the original range."""
    readings = {}
    for label, seqs in texts.items():
        window, original = ranges(model, seqs, old, window=old)
        readings[label] = {"window": window, "original": original}
    return readings


def run_budget_control(job: dict) -> dict:
    """The source fine-tuned at its own length with ``job["budget"]`` and ``finetune``'s defaults (what a user would
    run instead of extending), read through its window on every text; its folder removed after."""
    torch.set_num_threads(1)
    work = job["out"] / "budget-control"
    t0 = time.perf_counter()
    report = posextend.finetune(job["ref"], work, job["train_files"], budget=job["budget"], seed=job["seed"],
                                overwrite=True, progress=progress)
    seconds = time.perf_counter() - t0
    read_texts = window_readings(transformers.AutoModelForCausalLM.from_pretrained(work).eval(), job["texts"],
                                 job["old"])
    shutil.rmtree(work, ignore_errors=True)
    print(f"  budget control: {json.dumps(read_texts)} ({report.steps} steps, {seconds:.0f} s)", flush=True)
    return {"steps": report.steps, "tokens": report.tokens, "seconds": seconds, "texts": read_texts}


def control_table(rows: dict, control: dict, labels: list[str]) -> str:
    """Each candidate's far range, whole, against the same budget spent on the source at its own length."""
    lines = [f"| candidate | {' | '.join(f'{t}: whole / budget control' for t in labels)} |",
             "|---|" + "---|" * len(labels),
             f"| the budget control ({control['steps']} steps, {control['seconds']:.0f} s): its window | "
             + " | ".join(f"{control['texts'][t]['window']:.1f}" for t in labels) + " |"]
    for name, row in rows.items():
        lines.append(f"| {name} | " + " | ".join(
            f"{row['trained'][t]['whole']:.1f} / {control['texts'][t]['window']:.1f} = "
            f"**{row['trained'][t]['whole_over_budget_control']:.3f}**" for t in labels) + " |")
    return "\n".join(lines)


def run_candidate(name: str, job: dict) -> dict:
    """One candidate: its untrained start read, its fine-tune (``job["steps"]`` over its ``COST``, or
    ``job["budget"]``), its trained model read (and against its exact control when ``job["exact"]``); its working
    folders under ``job["out"] / name`` removed after."""
    torch.set_num_threads(1)
    strategy, fold, options = CANDIDATES[name]
    ref, texts, source, old, new, seed = (job[k] for k in ("ref", "texts", "source", "old", "new", "seed"))
    work = job["out"] / name.replace(" ", "-").replace(",", "")
    start = start_model(ref, work / "start", new, strategy, fold, seed)
    row = {"strategy": strategy, "temperature": temperature(FACTOR) if fold else None, "options": dict(options),
           "untrained": scored(start, texts, old, source)}
    if options.get("objective") == "window-teacher":
        options = {**options, "objective": plugin_objective(WindowTeacher, "causal-window-teacher")}
    if options.get("objective") == "self-teacher":
        options = {**options, "objective": plugin_objective(SelfTeacher, "causal-self-teacher")}
    cost = {"budget": job["budget"]} if job["budget"] else {"steps": max(1, round(job["steps"] / COST.get(name, 1)))}
    t0 = time.perf_counter()
    with table_lr(TABLE_LR[name], new) if name in TABLE_LR else contextlib.nullcontext():
        report = _finetune(ref, start, work / "tuned", job["train_files"], new, strategy, fold, old, seed,
                           {**options, **cost})
    row.update(steps=report.steps, tokens=report.tokens, seconds=time.perf_counter() - t0, lr=report.lr,
               schedule=report.schedule, window_anchor=report.window_anchor, budget=job["budget"])
    exact = (train_exact(ref, work / "tuned", report, old, job["train_files"], job["eval_file"], seed)
             if job["exact"] else None)
    row["trained"] = scored(work / "tuned", texts, old, source, exact)
    print(f"  {name}: {json.dumps({k: v for k, v in row.items() if k in ('untrained', 'trained', 'seconds')})}",
          flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True, help="directory of the novels (.txt)")
    ap.add_argument("--train", nargs="+", default=["mansfieldpark.txt", "prideprejudice.txt"],
                    help="novels to pretrain and fine-tune on")
    ap.add_argument("--tuned", default="emma.txt", help="never trained on; the text choices were made on")
    ap.add_argument("--aside", default="northangerabbey.txt", help="never trained on, never used to choose")
    ap.add_argument("--seen", default="prideprejudice.txt", help="a training novel, scored as well: what the "
                    "longer context does on text the model trained on (a diagnosis; '' leaves it out)")
    ap.add_argument("--quick", action="store_true", help="a tiny model and a few steps (the tests)")
    ap.add_argument("--reference", choices=list(REFERENCES), default="issue60",
                    help="the source (full mode): issue 60's 3 x 128 at 64 positions, the grid's 2 x 128 at 128, "
                    "a 3 x 128 table of 16 rows, or issue 60's pretrained twice as long")
    ap.add_argument("--steps", type=int, help="fine-tune steps of every candidate (default: the mode's)")
    ap.add_argument("--budget", help="in place of steps, every candidate the same wall-clock budget (finetune's, "
                    "e.g. 15min: it stops once its held-out reading stops improving), two side by side")
    ap.add_argument("--exact", action="store_true", help="also each candidate's exact control: the source fine-tuned "
                    "at its own length on the same novels and as many tokens, read through its window")
    ap.add_argument("--budget-control", action="store_true", help="with --budget: also the source fine-tuned at its "
                    "own length with the same budget and finetune's defaults, side by side, read through its window")
    ap.add_argument("--candidates", nargs="+", choices=list(CANDIDATES), help="only these (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", type=Path, default=Path(".cache/quality"), help="reference model cache")
    ap.add_argument("--out", type=Path, default=Path(".bench/no_harm"), help="scratch models go here")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    if args.budget_control and not args.budget:
        ap.error("--budget-control needs --budget (the control spends the candidates' budget)")
    if args.quick and args.reference != "issue60":
        ap.error("--reference picks a full-mode source; --quick has its own tiny one")
    torch.set_num_threads(1)
    mode = "quick" if args.quick else "full"
    s, steps = MODES["quick"] if args.quick else REFERENCES[args.reference], args.steps or STEPS[mode]
    train_files = [args.data / n for n in args.train]
    t_start = time.perf_counter()
    ref, info = build_reference(args.cache, train_files, s, args.seed)
    how = "cached" if info["reused"] else f"pretrained in {info['seconds']:.0f} s"
    print(f"reference: validation loss {info['validation_curve'][-1][1]:.3f} ({how})", flush=True)
    old, new = s["length"], s["length"] * FACTOR
    tok = transformers.AutoTokenizer.from_pretrained(ref)
    texts = {f"tuned {args.tuned.removesuffix('.txt')}": args.tuned, f"aside {args.aside.removesuffix('.txt')}": args.aside,
             **({f"seen {args.seen.removesuffix('.txt')}": args.seen} if args.seen else {})}
    texts = {label: pack(tok, read_documents([args.data / name]), new)[: s["eval_sequences"]]
             for label, name in texts.items()}
    source = window_readings(transformers.AutoModelForCausalLM.from_pretrained(ref).eval(), texts, old)
    print(f"source: {json.dumps(source)}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    names = args.candidates or list(CANDIDATES)
    job = dict(ref=ref, texts=texts, source=source, train_files=train_files, eval_file=args.data / args.tuned,
               old=old, new=new, seed=args.seed, out=args.out, exact=args.exact,
               budget=args.budget, steps=None if args.budget else steps)
    if args.budget:  # the same wall-clock budget for each: two at a time, side by side, one core each
        with concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
            control = pool.submit(run_budget_control, job) if args.budget_control else None
            rows = dict(zip(names, pool.map(run_candidate, names, [job] * len(names))))
            control = control.result() if control else None
    else:
        rows, control = {name: run_candidate(name, job) for name in names}, None
    labels = list(texts)
    for row in rows.values() if control else ():
        for t in labels:
            row["trained"][t]["whole_over_budget_control"] = row["trained"][t]["whole"] / control["texts"][t]["window"]
    against = f"\n\nAgainst the same budget spent at the old length:\n\n{control_table(rows, control, labels)}" if control else ""
    text = table(rows, source, labels) + against
    causes = why_table(rows, labels)
    hardware = machine()
    meta = {"mode": mode, "reference_name": None if args.quick else args.reference, "settings": s, "reference": info, "old_length": old, "new_length": new,
            "steps": None if args.budget else steps, "budget": args.budget, "train": args.train, "tuned": args.tuned, "aside": args.aside,
            "eval_tokens": {k: int(v.numel()) for k, v in texts.items()}, "seed": args.seed,
            "wall_seconds": time.perf_counter() - t_start, "hardware": hardware, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "posextend": posextend.__version__}
    print(f"\n{text}\n\nWhich layers read past the old window at the far positions (the far range; the first layer's "
          f"attention entropy at positions {old - 1} and {new - 1}):\n\n{causes}\n\n"
          f"{meta['wall_seconds'] / 60:.1f} min on {hardware}, {torch.get_num_threads()} thread(s)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "source": source, "rows": rows, "budget_control": control, "table": text, "why": causes}, indent=2) + "\n")
        print(f"written: {args.json}")


if __name__ == "__main__":
    main()
