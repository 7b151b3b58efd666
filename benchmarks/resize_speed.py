"""Resize speed and memory: posextend vs the naive transformers path vs `cp`, side by side.

    python benchmarks/resize_speed.py --target             # medium: resize-model vs cp + sync + python, 5 runs
    python benchmarks/resize_speed.py                      # small, medium, xl; every method; 3 repetitions
    python benchmarks/resize_speed.py --sizes vit-l        # ViT-L/16, 224 -> 448 px
    python benchmarks/resize_speed.py --sizes tiny vit-tiny --reps 1
    python benchmarks/resize_speed.py --target --baseline /tmp/before   # and an older tree's resize-model

Builds random GPT-2-shaped checkpoints (fp32; xl sharded into 2 GB files) and ViT ones under --workdir,
then times whole processes (wall clock, peak RSS of the process tree's largest member):
  posextend   `posextend resize-model SRC DST --length 2*n_positions` (tile: row bytes copied,
              no torch), also with `--link` and with `--strategy interpolate` (computed in torch)
  naive       from_pretrained → swap the wpe table (ViT: interpolate the grid, bicubic) →
              save_pretrained (transformers only)
  For ViT, posextend is `resize-model SRC DST --image-size 2*image_size` (bicubic, in torch).
  cp          `cp -r SRC DST`; "cp + fsync" also fsyncs the copy (`sync DST DST/*`), as posextend
              does before its output appears (durable after a crash or power cut)
  python      `python -c pass`: the interpreter's start-up, which any Python tool pays
  startup     `posextend --version`: the interpreter and the tool, with no work;
              "startup + torch" is `python -c "import posextend.cli, torch"`, with the framework
              that non-row strategies need (posextend imports it in the background while copying)
The target table compares `posextend` (a subprocess, so its start-up counts) with "cp + fsync" plus
"python"; --target times only those three, and the time `posextend` takes before its first byte: a
second run of it ("posextend, first byte") under an audit hook that notes when it first opens a file
for writing beside DST (the hook's own cost, well under a millisecond, counts there). --baseline DIR
(repeatable) adds "posextend (DIR)": resize-model with DIR on PYTHONPATH (a source tree of another
commit), in the same rounds, for a before/after on one machine.
The package's bytecode (and each baseline tree's) is compiled before timing, as an installed package's
is: where PYTHONDONTWRITEBYTECODE is set (or the tree is read-only), a source tree's modules would
otherwise be compiled again on every run, which no user of a wheel pays.
The source files are read once before timing so every method starts from a warm page cache,
and `sync` runs before each timed command. Each method writes a folder of its own, and a round's
outputs are deleted only after the round (then flushed, and the disk left idle a few seconds), so no
timed command follows the deletion of another's gigabytes (on a disk mounted with `discard`, a deletion's
trims can run on into the next command). Each round starts one method further on, so none always runs first.
What the script builds under --workdir is removed at the end (unless --keep).
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers

SIZES = {  # family, config, shard size
    "tiny": ("gpt2", dict(n_embd=64, n_layer=2, n_head=2), None),
    "small": ("gpt2", dict(n_embd=768, n_layer=12, n_head=12), None),  # 124M
    "medium": ("gpt2", dict(n_embd=1024, n_layer=24, n_head=16), None),  # 355M
    "xl": ("gpt2", dict(n_embd=1600, n_layer=48, n_head=25), 2 * 2**30),  # 1.5B, sharded
    "vit-tiny": ("vit", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128), None),
    "vit-l": ("vit", dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
              None),  # ViT-L/16 at 224 px, 304M
}
FAMILIES = {  # config class, model class, the tensor save_pretrained ties away
    "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel, "lm_head.weight"),
    "vit": (transformers.ViTConfig, transformers.ViTModel, None),
}

NAIVE = """
import sys, torch
from transformers import GPT2LMHeadModel
src, dst, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = GPT2LMHeadModel.from_pretrained(src)
old = model.transformer.wpe.weight.data
new = torch.nn.Embedding(n, old.shape[1])
new.weight.data.copy_(old[torch.arange(n) % old.shape[0]])
model.transformer.wpe = new
model.config.n_positions = n
model.save_pretrained(dst)
"""

NAIVE_VIT = """
import sys, torch
from transformers import ViTModel
src, dst, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = ViTModel.from_pretrained(src)
table = model.embeddings.position_embeddings.data  # [1, 1 + n*n, D]: class token, then the grid
old, new = int((table.shape[1] - 1) ** 0.5), size // model.config.patch_size
grid = table[:, 1:].reshape(1, old, old, -1).permute(0, 3, 1, 2)
grid = torch.nn.functional.interpolate(grid, size=(new, new), mode="bicubic", align_corners=False)
grid = grid.permute(0, 2, 3, 1).reshape(1, new * new, -1)
model.embeddings.position_embeddings = torch.nn.Parameter(torch.cat([table[:, :1], grid], dim=1))
model.config.image_size = size
model.save_pretrained(dst)
"""

MEASURE = """
import resource, subprocess, sys, time
start, t = time.time(), time.perf_counter()
rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode
wall = time.perf_counter() - t
print(wall, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, rc, repr(start))
"""

# Runs a console script (argv[1]) with an audit hook that writes, to the file FIRST_BYTE_FILE names, the time it
# first opens a file for writing under FIRST_BYTE_UNDER: when its first byte is about to be written.
FIRST_BYTE = """
import os, runpy, sys, time
fd = os.open(os.environ["FIRST_BYTE_FILE"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
under = os.environ["FIRST_BYTE_UNDER"]
done = []
def hook(event, args):
    if event != "open" or done or not isinstance(args[0], (str, os.PathLike)):
        return
    mode, flags = args[1], args[2]
    writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool((flags or 0) & (os.O_WRONLY | os.O_RDWR))
    if writes and os.path.abspath(os.fspath(args[0])).startswith(under):
        done.append(True)
        os.write(fd, repr(time.time()).encode())
sys.addaudithook(hook)
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # as when the script runs itself: not the cwd
runpy.run_path(sys.argv[0], run_name="__main__")
"""
FIRST = ", first byte"  # the suffix of a method that times posextend's first byte
SETTLE = 3.0  # seconds the disk is left idle after a round's outputs are deleted (see clear)


def build_checkpoint(path: Path, size: str) -> Path:
    """A random checkpoint written tensor by tensor (never holding the model in memory)."""
    from posextend.files.tensorfile import Entry, write_safetensors

    if (path / "config.json").exists():
        return path
    family, kwargs, shard_bytes = SIZES[size]
    config_cls, model_cls, tied = FAMILIES[family]
    config = config_cls(**kwargs)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in model_cls(config).state_dict().items()}
    if tied:
        shapes.pop(tied)  # tied to the input embeddings, not saved (as save_pretrained does)
    shapes = dict(sorted(shapes.items()))  # safetensors orders same-dtype tensors by name
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards, current, used = [], [], 0
    for name, shape in shapes.items():
        nbytes = 4 * int(torch.Size(shape).numel())
        if shard_bytes and current and used + nbytes > shard_bytes:
            shards.append(current)
            current, used = [], 0
        current.append((name, shape))
        used += nbytes
    shards.append(current)
    gen = torch.Generator().manual_seed(0)
    weight_map = {}
    for i, names in enumerate(shards, 1):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        items = [
            (Entry(n, Path(fname), "F32", s), (lambda s=s: torch.randn(s, generator=gen) * 0.02)) for n, s in names
        ]
        write_safetensors(tmp / fname, items, {"format": "pt"})
        weight_map.update({n: fname for n, _ in names})
    if len(shards) > 1:
        total = sum(4 * int(torch.Size(s).numel()) for s in shapes.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.save_pretrained(tmp)
    os.rename(tmp, path)
    return path


def clear(outs: Path) -> None:
    """Delete the last round's outputs, flush, and give the disk :data:`SETTLE` seconds: on a file system mounted
    with ``discard`` (ext4 here), the trims of gigabytes just freed can run on after the deletion."""
    if outs.exists():
        shutil.rmtree(outs)
        os.sync()
        time.sleep(SETTLE)
    outs.mkdir(parents=True)


def measure(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, float, float]:
    """``(wall s, peak RSS MiB, the time.time() it started at)`` of ``cmd`` run as a whole process."""
    out = subprocess.run([sys.executable, "-c", MEASURE, *cmd], capture_output=True, text=True, check=True, env=env)
    wall, rss, rc, start = out.stdout.split()
    if rc != "0":
        raise SystemExit(f"command failed ({rc}): {' '.join(cmd)}")
    return float(wall), float(rss), float(start)


def compile_bytecode(trees: list[Path]) -> None:
    """Compile the posextend package of each source tree (and the installed one's) to bytecode, as installing a
    wheel does: a run then reads it instead of compiling every module again."""
    import posextend

    for package in [Path(posextend.__file__).parent, *(tree / "posextend" for tree in trees)]:
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(package)], check=True, stdout=subprocess.DEVNULL,
                       env={**os.environ, "PYTHONDONTWRITEBYTECODE": ""})


TARGET = ("posextend", "cp + fsync", "python")  # what --target times


def baseline(tree: Path) -> str:
    return f"posextend ({tree})"


def methods_for(size: str, src: Path, config: dict, nfiles: int, args: argparse.Namespace) -> dict[str, list[str]]:
    """The commands timed on checkpoint ``src`` (DST stands for the output), by method."""
    posextend_bin = str(Path(sys.executable).with_name("posextend"))
    methods = {
        "python": [sys.executable, "-c", "pass"],
        "startup": [posextend_bin, "--version"],
        "startup + torch": [sys.executable, "-c", "import posextend.cli, torch"],
        "cp": ["cp", "-r", str(src), "DST"],
        # what posextend does on top of a copy: every written file and the folder on disk before the rename
        "cp + fsync": ["sh", "-c", 'cp -r "$0" "$1" && sync "$1" "$1"/*', str(src), "DST"],
    }
    if SIZES[size][0] == "gpt2":  # the table doubled (tile: row bytes copied), and interpolated
        n = 2 * config["n_positions"]
        resize = [posextend_bin, "resize-model", str(src), "DST", "--length", str(n)]
        methods |= {"posextend": resize, "posextend --link": [*resize, "--link"],
                    "posextend interpolate": [*resize, "--strategy", "interpolate"],
                    "naive": [sys.executable, "-c", NAIVE, str(src), "DST", str(n)]}
    else:  # the image size doubled: the grid resampled bicubic (computed in torch)
        n = 2 * config["image_size"]
        methods |= {"posextend": [posextend_bin, "resize-model", str(src), "DST", "--image-size", str(n)],
                    "naive": [sys.executable, "-c", NAIVE_VIT, str(src), "DST", str(n)]}
    if nfiles == 1:
        methods.pop("posextend --link", None)
    for tree in args.baseline:
        methods[baseline(tree)] = methods["posextend"]
    if args.target:
        methods = {m: cmd for m, cmd in methods.items() if m in TARGET or m.startswith("posextend (")}
        methods |= {m + FIRST: [sys.executable, "-c", FIRST_BYTE, *cmd] for m, cmd in methods.items()
                    if m.startswith("posextend")}
    return methods


def run_size(size: str, args: argparse.Namespace) -> tuple[int, int, dict[str, tuple[float, float]]]:
    """Time every method on checkpoint ``size``, round robin; (bytes, files, method -> (median wall, max RSS))."""
    src = build_checkpoint(args.workdir / f"{SIZES[size][0]}-{size}", size)
    files = sorted(src.glob("*.safetensors"))
    nbytes = sum(f.stat().st_size for f in files)
    for f in files:  # warm the page cache
        with open(f, "rb") as h:
            while h.read(1 << 26):
                pass
    methods = methods_for(size, src, json.loads((src / "config.json").read_text()), len(files), args)
    outs = args.workdir / "out"  # each method writes a folder of its own here; a round's are deleted after it
    envs = _environments(methods, args, outs / "dst")
    walls: dict[str, list[float]] = {m: [] for m in methods}
    rsss: dict[str, list[float]] = {m: [] for m in methods}
    names = list(methods)
    for rep in range(args.reps):
        clear(outs)
        for i, method in enumerate(names[rep % len(names):] + names[:rep % len(names)]):  # each round starts one on
            dst = outs / f"dst{i}"
            os.sync()
            wall, rss, start = measure([str(dst) if c == "DST" else c for c in methods[method]], envs[method])
            if method.endswith(FIRST):  # its time: when it first opened a file to write
                wall = float(Path(envs[method]["FIRST_BYTE_FILE"]).read_text()) - start
            walls[method].append(wall)
            rsss[method].append(rss)
            if rep == 0 and method == "posextend" and len(files) > 1:
                same = sum(filecmp.cmp(f, dst / f.name, shallow=False) for f in files)
                print(f"  {size}: {same} of {len(files)} shards byte-identical to the source (not rewritten)")
            if rep == 0 and method == "posextend --link":
                linked = sum(os.stat(f).st_ino == os.stat(dst / f.name).st_ino for f in files)
                print(f"  {size}: {linked} of {len(files)} shards hard-linked (same inode)")
    shutil.rmtree(outs)
    results = {m: (statistics.median(walls[m]), max(rsss[m])) for m in methods}
    for method, (wall, rss) in results.items():
        print(f"  {size} {method:20s} {wall:7.2f} s  {rss:8.0f} MiB  (runs: "
              + ", ".join(f"{w:.2f}" for w in walls[method]) + ")", flush=True)
    if not args.keep:
        shutil.rmtree(src)
    return nbytes, len(files), results


def _environments(methods: dict[str, list[str]], args: argparse.Namespace, dst: Path) -> dict[str, dict | None]:
    """Each method's environment: a baseline's tree first on the path; a first-byte run's file and folder."""
    envs: dict[str, dict | None] = {m: None for m in methods}
    for tree in args.baseline:  # that tree's package first on the path
        for method in (baseline(tree), baseline(tree) + FIRST):
            envs[method] = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    for method in methods:
        if method.endswith(FIRST):
            envs[method] = {**(envs[method] or os.environ), "FIRST_BYTE_UNDER": str(dst.parent.resolve()),
                            "FIRST_BYTE_FILE": str(args.workdir.resolve() / "first-byte")}
    return envs


def print_target(rows: list) -> None:
    """The target: resize-model (a whole process) against cp -r + sync plus the interpreter's start-up, and the
    time before its first byte."""
    print("\n| size | checkpoint | method | wall s | peak RSS MiB | cp + fsync s | python -c pass s "
          "| wall / (cp + fsync + python) | before the first byte s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for size, nbytes, _, results in rows:
        synced, python = results["cp + fsync"][0], results["python"][0]
        for method, (wall, rss) in results.items():
            if method.startswith("posextend") and not method.endswith(FIRST):
                first = f"{results[method + FIRST][0]:.3f}" if method + FIRST in results else "-"
                print(f"| {size} | {nbytes / 2**30:.2f} GiB | {method} | {wall:.2f} | {rss:.0f} | {synced:.2f} | "
                      f"{python:.2f} | {wall / (synced + python):.2f}× | {first} |")


def print_all(rows: list) -> None:
    """Every method against cp, and the naive path against posextend."""
    print("| size | checkpoint | files | method | wall s | peak RSS MiB | wall vs cp | wall vs cp + startup "
          "| wall vs cp + fsync + startup | wall vs cp + fsync + startup + torch |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for size, nbytes, nfiles, results in rows:
        cp, startup, with_torch = results["cp"][0], results["startup"][0], results["startup + torch"][0]
        synced = results["cp + fsync"][0]
        for method, (wall, rss) in results.items():
            print(f"| {size} | {nbytes / 2**30:.2f} GiB | {nfiles} | {method} | {wall:.2f} | {rss:.0f} | "
                  f"{wall / cp:.2f}× | {wall / (cp + startup):.2f}× | {wall / (synced + startup):.2f}× | "
                  f"{wall / (synced + with_torch):.2f}× |")
    print("\n| size | naive / posextend (wall) | naive / posextend (peak RSS) | naive / posextend interpolate (wall) |")
    print("|---|---|---|---|")
    for size, _, _, results in rows:
        naive, interpolated = results["naive"], results.get("posextend interpolate")
        print(f"| {size} | {naive[0] / results['posextend'][0]:.1f}× | {naive[1] / results['posextend'][1]:.1f}× | "
              + (f"{naive[0] / interpolated[0]:.1f}× |" if interpolated else "- |"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", choices=list(SIZES), help="default: small medium xl (--target: medium)")
    ap.add_argument("--reps", type=int, help="repetitions (default 3; --target: 5)")
    ap.add_argument("--target", action="store_true",
                    help="only resize-model, cp + fsync and python -c pass: the target's table")
    ap.add_argument("--baseline", type=Path, action="append", default=[],
                    help="also time resize-model from this source tree (an older commit); repeatable")
    ap.add_argument("--workdir", type=Path, default=Path(".bench"))
    ap.add_argument("--keep", action="store_true", help="keep the built checkpoints for the next run")
    args = ap.parse_args()
    args.sizes = args.sizes or (["medium"] if args.target else ["small", "medium", "xl"])
    args.reps = args.reps or (5 if args.target else 3)
    made = not args.workdir.exists()
    compile_bytecode(args.baseline)
    rows = []
    try:
        for size in args.sizes:
            rows.append((size, *run_size(size, args)))
    finally:
        shutil.rmtree(args.workdir / "dst", ignore_errors=True)
        (args.workdir / "first-byte").unlink(missing_ok=True)
        if made and not args.keep:
            shutil.rmtree(args.workdir, ignore_errors=True)
    print(f"\nfp32 checkpoints: GPT-2's table doubled, ViT's image size doubled; median of {args.reps} runs; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.1f}\n")
    if not args.target:
        print_all(rows)
    if all(m in results for _, _, _, results in rows for m in TARGET):
        print_target(rows)


if __name__ == "__main__":
    main()
