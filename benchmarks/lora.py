"""``--train lora`` against ``--train all`` at the same wall-clock budget, on the quality grid's small model.

    python benchmarks/lora.py --data ../shared/data/austen              # ~5 min on 2 shared CPU cores (reference cached)
    python benchmarks/lora.py --data ../shared/data/austen --quick      # a few minutes: the quick grid's model, few steps
    python benchmarks/lora.py --data ../shared/data/austen --heldout northangerabbey.txt emma.txt  # the one kept aside

The model is the quality grid's small reference (``quality_grid.py``'s ``2x128``: a GPT-2 2 layers x 128
pretrained here at 128 positions on the Austen novels the grid does not hold out; cached as the grid caches
it), extended 4x (128 -> 512) with posextend's defaults otherwise (interpolate, the anchor on, cosine).

Both modes get the same budget: the time ``--steps`` steps of ``all`` take (the grid's 150). A schedule needs
its length in advance, so lora is timed first on a few steps and gets budget / its step time steps; a lora
run whose time then misses the budget by more than 3% is run again with its steps scaled to fit (the 12-step
timing alone was 5-18% off).
The machine these tables are made on is shared, so time is counted in CPU seconds of one thread (the run
uses one): what a step takes on an idle core, which is its wall-clock time there; the loop's wall-clock
seconds on the shared machine are printed beside them. Scored on a held-out novel
(``emma.txt``, never trained on): the far range (the last half of the new length), the original range
against the source, and the source's own sliding-window reading of the far tokens. LoRA runs at each
``--lora-lr`` and ``--whole-lr`` (the lr of the table and norms over LoRA's; the defaults of ``lora`` were
chosen from this table). Target: lora's far range within 3%
of all's.

Also printed: the share of trainable parameters under lora for GPT-2-small-shaped and BERT-base-shaped
models (built from their configs on the meta device: no weights), extended 4x, and for the grid's model.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch
import transformers
from quality import SETTINGS, build_reference, machine
from quality_grid import HELDOUT, SIZES, perplexities, source_scores

import posextend
from posextend.data.text import read_documents
from posextend.scoring.text import pack
import posextend.training.adapters as adapters
from posextend.training.adapters import RANK, add_lora, trainable_share
from posextend.training.loop import finetune

FACTOR = 4
PROBE = 12  # steps of lora timed first, to size its first run in the budget
EQUAL = 0.03  # a lora run whose CPU seconds miss all's by more is run again, its steps scaled to fit
RETRIES = 2


def lora_share(model: torch.nn.Module, table: str) -> tuple[int, float]:
    """(parameters, trainable share under lora) of ``model`` with LoRA on it and ``table`` trainable."""
    total = sum(p.numel() for p in model.parameters())
    add_lora(model, [model.get_submodule(table).weight], init=True)  # on the meta device: no SVD (the share is the same)
    return total, trainable_share(model)


def shares(reference: Path) -> list[tuple[str, int, float]]:
    """The trainable share of lora on GPT-2 small, BERT base (4x their lengths, from config) and the grid's model."""
    rows = []
    with torch.device("meta"):
        gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_positions=4 * 1024))
        rows.append(("GPT-2 small shape, 4096 positions", *lora_share(gpt2, "transformer.wpe")))
        bert = transformers.BertForMaskedLM(transformers.BertConfig(max_position_embeddings=4 * 512))
        rows.append(("BERT base shape, 2048 positions", *lora_share(bert, "bert.embeddings.position_embeddings")))
    grid = transformers.AutoModelForCausalLM.from_pretrained(reference)
    posextend.extend_model(grid, FACTOR * grid.config.n_positions, "interpolate")
    rows.append((f"the grid's model, {grid.config.n_positions} positions", *lora_share(grid, "transformer.wpe")))
    return rows


def step_durations(src: Path, out: Path, train_files: list[Path], steps: int, **kwargs) -> tuple[list[float], float]:
    """The CPU seconds of a run's optimizer steps (the first, a warm-up, aside) and its loop's wall-clock seconds.
    One thread: its CPU seconds are what the step takes on an idle core, whatever else the machine runs."""
    ticks = [time.process_time()]
    report = finetune(src, out, train_files, steps=steps, eval_sequences=1, overwrite=True,
                      progress=lambda *_: ticks.append(time.process_time()), **kwargs)
    return [b - a for a, b in zip(ticks[1:], ticks[2:])], report.seconds


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True, help="directory of .txt files (the grid's two are held out)")
    ap.add_argument("--quick", action="store_true", help="the quick grid's model and few steps (a smoke run)")
    ap.add_argument("--steps", type=int, help="steps of --train all; their time is the budget (default: 150; --quick 12)")
    ap.add_argument("--lora-lr", type=float, nargs="+", default=[2e-3], help="lrs of --train lora (default: 2e-3, lora's)")
    default_whole = adapters.WHOLE_LR
    ap.add_argument("--whole-lr", type=float, nargs="+", default=[default_whole],
                    help=f"the lr of the table and norms under lora, over LoRA's (default: {default_whole:g}, lora's)")
    ap.add_argument("--size", choices=sorted(SIZES["full"]), default="2x128", help="the grid's model (default: 2x128)")
    ap.add_argument("--heldout", nargs=2, default=HELDOUT, metavar=("SCORED", "ASIDE"),
                    help="two files in --data never trained on; the first is scored (default: the grid's: emma.txt "
                         "northangerabbey.txt; swap them to score the novel kept aside)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", type=Path, default=Path(".cache/quality"), help="reference model cache (the grid's)")
    ap.add_argument("--out", type=Path, default=Path("lora-results"), help="table and JSON go here")
    args = ap.parse_args()
    torch.set_num_threads(1)  # CPU seconds = an idle core's wall-clock seconds (see step_durations)
    t_start = time.perf_counter()
    mode = "quick" if args.quick else "full"
    name, changes = ("2x48", SIZES["quick"]["2x48"]) if args.quick else (args.size, SIZES["full"][args.size])
    s = {**SETTINGS[mode], **changes}
    steps = args.steps or (12 if args.quick else 150)
    train_files = sorted(p for p in args.data.glob("*.txt") if p.name not in args.heldout)
    ref, info = build_reference(args.cache, train_files, s, args.seed)
    how = "cached" if info["reused"] else f"pretrained in {info['seconds'] / 60:.1f} min"
    print(f"reference {name}: validation loss {info['validation_curve'][-1][1]:.3f}, {how}", flush=True)
    old, new = s["length"], s["length"] * FACTOR
    tok = transformers.AutoTokenizer.from_pretrained(ref)
    seqs = pack(tok, read_documents([args.data / args.heldout[0]]), new)[: s["eval_sequences"]]
    source = source_scores(ref, seqs, old)
    work = args.out / "models"
    common = dict(length=new, batch_size=4, seed=args.seed)
    runs = [("all", {"train": "all"}, None)] + [
        (f"lora, lr {lr:g}, table and norms x{w:g}", {"train": "lora", "lr": lr}, w)
        for lr in args.lora_lr for w in args.whole_lr]
    probe = median(step_durations(ref, work / "probe", train_files, PROBE, train="lora", **common)[0])
    budget, rows = 0.0, []
    for label, kwargs, whole in runs:  # all first: its CPU seconds are the budget
        adapters.WHOLE_LR = default_whole if whole is None else whole  # read by each run's optimizer
        n = steps if kwargs["train"] == "all" else max(1, round(budget / probe))
        for attempt in range(RETRIES + 1):
            durations, seconds = step_durations(ref, work / "run", train_files, n, **common, **kwargs)
            if kwargs["train"] == "all":
                budget = sum(durations)
                break
            if abs(sum(durations) - budget) <= EQUAL * budget or attempt == RETRIES:
                break
            fit = max(1, round(n * budget / sum(durations)))
            print(f"  {label}: {n} steps took {sum(durations):.0f} CPU s of a {budget:.0f} s budget; again with {fit}",
                  flush=True)
            n = fit
        original, far = perplexities(work / "run", seqs, old)
        rows.append({"run": label, "steps": n, "step_seconds": median(durations), "cpu_seconds": sum(durations),
                     "seconds": seconds, "lr": kwargs.get("lr"), "whole_lr": whole,
                     "far": far, "original": original, "original_change": original / source["original"] - 1,
                     "far_window": far / source["far_window"]})
        print(f"  {label}: {n} steps ({median(durations):.3f} CPU s each, {seconds:.0f} s wall-clock), far {far:.2f}, "
              f"original {original:.2f}", flush=True)
    adapters.WHOLE_LR = default_whole
    shutil.rmtree(work, ignore_errors=True)
    share_rows = shares(ref)
    text = table(rows, source, budget, share_rows)
    hardware = machine()
    meta = {"mode": mode, "model": name, "settings": s, "factor": FACTOR, "heldout": args.heldout[0],
            "budget_seconds": budget,
            "train": [p.name for p in train_files], "source": source, "wall_seconds": time.perf_counter() - t_start,
            "hardware": hardware, "torch": torch.__version__, "posextend": posextend.__version__}
    print(f"\n{text}\n\n{meta['wall_seconds'] / 60:.1f} min on {hardware}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lora.md").write_text(text + "\n")
    (args.out / "lora.json").write_text(json.dumps({"meta": meta, "rows": rows, "shares": share_rows}, indent=2))


def table(rows: list[dict], source: dict[str, float], budget: float, share_rows: list[tuple[str, int, float]]) -> str:
    all_far = rows[0]["far"]
    lines = [f"Same budget: {budget:.0f} s of one CPU thread each (`all`'s steps; lora's steps = budget / its step, timed "
             "first, run again when 3% off; one thread's CPU seconds are an idle core's wall-clock seconds). "
             "Far range = the last half of the new length, on a held-out text.", "",
             "| run | steps | CPU s / step (median) | CPU s (steps) | wall-clock s (loop, shared machine) | far range "
             "| far / all | far / source's window | original Δ |", "|---|---|---|---|---|---|---|---|---|",
             f"| *the source through a sliding window of its length* | – | – | – | – | {source['far_window']:.2f} | – "
             "| 1.000 | – |"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['steps']} | {r['step_seconds']:.3f} | {r['cpu_seconds']:.0f} | {r['seconds']:.0f} "
                     f"| {r['far']:.2f} | {r['far'] / all_far:.3f} | {r['far_window']:.3f} | {100 * r['original_change']:+.1f}% |")
    lines += ["", f"| model (lora: rank {RANK} on the attention's q, k, v and o, the table and the norms) | parameters | "
              "trainable |", "|---|---|---|"]
    lines += [f"| {label} | {total / 1e6:.1f}M | {100 * share:.2f}% |" for label, total, share in share_rows]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
