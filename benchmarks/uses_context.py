"""A model that uses its context, so an extension's gain can be shown: a synthetic language of repeats.

    python benchmarks/uses_context.py --json docs/uses_context.json     # over 45 min on one CPU core
    python benchmarks/uses_context.py --quick                            # ~25 s (used by the tests)

No LM pretrained here on real text reads past its window (``context_probe.py``: a repeated passage reads as
badly whole as windowed), so no extension of one can show that the longer context helps. This script makes one
that does, on a task where the far tokens carry what a window cannot see:

- **The language.** :data:`VOCABULARY`: the pass-key probe's own words, the ten digits and a few made-up words
  ``za zb ...`` (48 in all), one token each (a word-level tokenizer, digits split). A document is a run of
  segments of 8-24 words (:func:`document`): half drawn at random, half a copy of an earlier stretch of the same
  document, up to ``4 x OLD`` = 256 words back in the corpora written (64 in pretraining). Random words are unpredictable (perplexity about the vocabulary's size); a copied
  segment reads almost for free to a model that sees its original and copies (an induction head), and as random
  to one that does not.
- **The source.** A GPT-2 (:data:`MODEL`: 2 layers, width 64, 4 heads, no dropout) pretrained from scratch at
  ``OLD`` = 64 positions (:func:`pretrain`): first a few hundred steps of a language whose every word follows from
  the one two back (:func:`skip_rows`: it needs a head that attends to the previous token, the first half of an
  induction head, and forms one fast), then a mix of that, random passages repeated (:func:`repeat_rows`, the
  classic induction-head task) and 64-word passages of the language cut from longer documents (:func:`passage`);
  the last fifth without the skip rows. The copy of a held-out random passage
  falls from the vocabulary's perplexity to near 1 in a phase change (here after about 1,800 steps: the curve
  is printed). The probe is shown first, *within its window*: a passage repeated 40 tokens later, whole against
  a 16-token window.
- **The extension.** ``posextend.finetune(SRC, DST, [train.jsonl], length=4 x OLD)``: the length, the data and
  the seed, nothing else (the defaults' own budget, 15 minutes; ``--budget`` gives another); or, with
  ``--strategies``, recipes (``STRATEGY[:KEY=VALUE,...]``: ``interpolate:steps=6000`` trains exactly 6,000 steps,
  which no held-out check stops; ``anchor=0``; ``keep-local``, :mod:`local_rows`'s strategy). The training
  documents are 1,024 words long with copies up to 4 x OLD back: most of them farther back than the old window
  reaches.
- **The reading**, on held-out documents (the settings here were chosen on them) and on documents kept aside
  (never trained on, never used to choose anything), packed into sequences of ``4 x OLD``: the far range
  (positions ``2 x OLD .. 4 x OLD - 1``) with the whole context, against the same model through its old
  ``OLD``-token window (``self``: the control), against the exact control through its window (``exact``: the
  source fine-tuned at ``OLD`` on the same documents and as many tokens, ``worth_it.train_exact``), and against
  the source through its window (``source``); and the probe (:func:`posextend.scoring.context_use.context_use`)
  before and after: a passage repeated beyond the old window, read whole and windowed. Issue 60's target for a
  model that passes the probe: far range <= 0.97 x its own window and <= 0.97 x the exact control.
- **Why**, per run: the source's previous-token head (``table_causes.previous_token``: the first layer's attention
  from the position rows alone, its weight on the previous token within the old length and past it) in the
  source, in the untrained resize and in the fine-tuned model.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
import local_rows  # noqa: E402, F401  (registers keep-local, a strategy --strategies may name)
import quality_grid  # noqa: E402, F401  (registers byparts, a strategy --strategies may name)
from quality import machine  # noqa: E402
from seq2seq import recipe  # noqa: E402
from table_causes import previous_token  # noqa: E402
from worth_it import ranges, train_exact  # noqa: E402

import posextend  # noqa: E402
from posextend.scoring.context_use import context_use  # noqa: E402
from posextend.data.text import read_documents  # noqa: E402
from posextend.scoring.text import pack  # noqa: E402
from posextend.training.options import DEFAULT_BUDGET  # noqa: E402

OLD = 64
EOS, UNK = "<|endoftext|>", "<unk>"
PROBE_WORDS = ("the grass is green . sky blue sun yellow here we go there and back again pass key remember it "
               "what ?").split()
DIGITS = [str(d) for d in range(10)]
SYNTHETIC = 14  # made-up words beside the probe's words and the digits
VOCABULARY = [UNK, EOS, *PROBE_WORDS, *DIGITS, *(f"z{chr(ord('a') + i)}" for i in range(SYNTHETIC))]  # no digits in a word
MODEL = dict(n_layer=2, n_embd=64, n_head=4, n_inner=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
LAST_SKIPS = 0.8  # the share of pretraining steps with skip rows in their batches (the induction head forms first)
SETTINGS = {
    "full": dict(pretrain_steps=2500, prelude=300, batch=32, lr=3e-3, warmup=100, train_docs=800, eval_docs=40, doc_words=1024,
                 budget=DEFAULT_BUDGET, eval_sequences=32),
    "quick": dict(pretrain_steps=150, prelude=50, batch=16, lr=3e-3, warmup=20, train_docs=40, eval_docs=6, doc_words=1024,
                  budget="8s", eval_sequences=8),
}


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Word-level: one id a word of :data:`VOCABULARY` (its index), digits one a token, lower-cased."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCABULARY)}, unk_token=UNK))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(),
                                                 pre_tokenizers.Digits(individual_digits=True)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=UNK,
                                                pad_token=EOS, model_max_length=OLD)


def document(rng: random.Random, words: int, far: int) -> list[int]:
    """``words`` token ids: segments of 8-24, each random or (half of them, once 32 ids are written) a copy of the
    ids ``d`` back, ``d`` from the segment's length to ``far`` (or the start)."""
    first = VOCABULARY.index(EOS) + 1  # no special tokens in the text
    ids: list[int] = []
    while len(ids) < words:
        size = rng.randint(8, 24)
        if len(ids) >= 32 and rng.random() < 0.5:
            start = len(ids) - rng.randint(size, min(len(ids), far))
            ids += ids[start:start + size]
        else:
            ids += [rng.randrange(first, len(VOCABULARY)) for _ in range(size)]
    return ids[:words]


def text(ids: list[int]) -> str:
    return " ".join(VOCABULARY[i] for i in ids)


def write_corpus(path: Path, docs: int, words: int, far: int, seed: int) -> Path:
    """``docs`` documents as JSON Lines (``{"text": ...}``), reproducible from ``seed``."""
    rng = random.Random(seed)
    path.write_text("".join(json.dumps({"text": text(document(rng, words, far))}) + "\n" for _ in range(docs)))
    return path


def copy_loss(model, seqs: torch.Tensor, half: int) -> tuple[float, float]:
    """(first, second) half's perplexity on rows that repeat their first ``half`` ids (the second's first
    token left out)."""
    from posextend.scoring.by_position import position_losses

    total, count = position_losses(model, seqs, "causal", batch_size=16)
    first, second = slice(1, half), slice(half + 1, 2 * half)
    return tuple(math.exp(float(total[s].sum() / count[s].sum())) for s in (first, second))


def skip_rows(gen: torch.Generator, n: int, perm: torch.Tensor) -> torch.Tensor:
    """``n`` rows of ``OLD`` ids where each id is ``perm`` of the one two back: read only by a head that attends to
    the previous token (the first half of an induction head), which a model learns in a few hundred steps."""
    first = VOCABULARY.index(EOS) + 1
    rows = torch.randint(first, len(VOCABULARY), (n, OLD), generator=gen)
    for t in range(2, OLD):
        rows[:, t] = perm[rows[:, t - 2] - first]
    return rows


def repeat_rows(gen: torch.Generator, n: int) -> torch.Tensor:
    """``n`` rows of ``OLD`` ids: 8-32 random ids, repeated (the classic task that forms induction heads)."""
    first, rows = VOCABULARY.index(EOS) + 1, []
    for _ in range(n):
        period = int(torch.randint(8, 33, (1,), generator=gen))
        rows.append(torch.randint(first, len(VOCABULARY), (period,), generator=gen).repeat(OLD // period + 1)[:OLD])
    return torch.stack(rows) if rows else torch.zeros(0, OLD, dtype=torch.long)


def passage(rng: random.Random) -> list[int]:
    """``OLD`` words from a random place in a document of ``4 x OLD`` whose copies reach ``OLD`` back: as the
    fine-tune's sequences are cut from long documents, some copies start before the window (the source learns
    that a copy it cannot see is not there, rather than expecting one everywhere)."""
    start = rng.randrange(3 * OLD + 1)
    return document(rng, 4 * OLD, OLD)[start:start + OLD]


def pretrain(path: Path, s: dict, seed: int) -> dict:
    """The source: :data:`MODEL` at ``OLD`` positions. First ``prelude`` steps on :func:`skip_rows` (a previous-token
    head), then batches of half :func:`repeat_rows`, a quarter skip rows and a quarter 64-word passages of the
    language (:func:`passage`: copies within the window, or begun before it); after :data:`LAST_SKIPS` of the steps,
    passages in place of the skip rows (a source that reads the language, not the skip rule). AdamW, warm-up then cosine. Saved with its tokenizer at
    ``path``."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=len(VOCABULARY), n_positions=OLD, bos_token_id=1, eos_token_id=1,
                                     **MODEL)
    model = transformers.GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=s["lr"], weight_decay=0.0, betas=(0.9, 0.98))
    steps, batch = s["pretrain_steps"], s["batch"]
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / s["warmup"]) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(k, steps) / steps))))
    gen, rng = torch.Generator().manual_seed(seed), random.Random(f"pretrain-{seed}")
    first = VOCABULARY.index(EOS) + 1
    perm = torch.randperm(len(VOCABULARY) - first, generator=gen) + first
    check = torch.Generator().manual_seed(seed + 1000)  # held-out repeats: 32 random ids, then the same 32 again
    halves = torch.randint(first, len(VOCABULARY), (32, OLD // 2), generator=check)
    repeats = torch.cat([halves, halves], 1)
    curve, t0 = [], time.perf_counter()
    for step in range(steps + 1):
        if step % max(steps // 10, 1) == 0 or step == steps:
            model.eval()
            fresh, copied = copy_loss(model, repeats, OLD // 2)
            model.train()
            curve.append({"step": step, "seconds": time.perf_counter() - t0, "first": fresh, "second": copied})
            print(f"    pretrain step {step}: a random passage reads {fresh:.1f}, its copy {copied:.2f}", flush=True)
        if step == steps:
            break
        quarter = batch // 4
        skips = batch if step < s["prelude"] else quarter if step < LAST_SKIPS * steps else 0
        docs = 0 if step < s["prelude"] else batch - skips - 2 * quarter  # repeats: the rest
        rows = torch.cat([skip_rows(gen, skips, perm), repeat_rows(gen, batch - skips - docs),
                          torch.tensor([passage(rng) for _ in range(docs)], dtype=torch.long).view(docs, OLD)])
        loss = model(input_ids=rows, labels=rows).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
    model.eval().save_pretrained(path)
    tokenizer().save_pretrained(path)
    return {"steps": steps, "seconds": time.perf_counter() - t0, "curve": curve}


def probe(model, tok, old: int, length: int, rows: torch.Tensor | None = None) -> dict:
    """The context-use probe (random words, or ``rows``: the passages), as JSON."""
    return context_use(model, tok, old_length=old, length=length, text=rows, sequences=8).to_dict()


def read(tuned, source, exact, seqs: torch.Tensor) -> dict:
    """The far range whole; the controls through the old window (the same model, the exact control, the source);
    the original range against the source's."""
    far, original = ranges(tuned, seqs, OLD)
    self_window, _ = ranges(tuned, seqs, OLD, window=OLD)
    exact_window, _ = ranges(exact, seqs, OLD, window=OLD)
    source_window, source_original = ranges(source, seqs, OLD, window=OLD)
    return {"far": far, "self_window": self_window, "self_ratio": far / self_window, "exact_window": exact_window,
            "exact_ratio": far / exact_window, "source_window": source_window, "source_ratio": far / source_window,
            "original": original, "source_original": source_original,
            "original_change": original / source_original - 1, "sequences": len(seqs)}


def table(rows: dict[str, dict]) -> str:
    lines = ["| text | far range, whole | / itself through 64 | / the exact control through 64 | "
             "/ the source through 64 | original Δ |", "|---|---|---|---|---|---|"]
    for label, r in rows.items():
        lines.append(f"| {label} | {r['far']:.2f} | {r['self_window']:.2f} = **{r['self_ratio']:.3f}** | "
                     f"{r['exact_window']:.2f} = **{r['exact_ratio']:.3f}** | "
                     f"{r['source_window']:.2f} = {r['source_ratio']:.3f} | {100 * r['original_change']:+.1f}% |")
    return "\n".join(lines)


def probe_line(name: str, p: dict) -> str:
    return (f"{name}: a passage repeated {p['distance']} tokens later reads {p['repeat_whole']:.2f} whole against "
            f"{p['repeat_window']:.2f} through a {p['old_length']}-token window "
            f"({'uses' if p['uses'] else 'does not use'} its context); pass keys {p['passkey_whole']:.2f} whole, "
            f"{p['passkey_window']:.2f} windowed")


def finetune_options(text: str | None, src: Path, budget: str) -> dict:
    """``finetune``'s options for a recipe ``STRATEGY[:KEY=VALUE,...]`` (``seq2seq.recipe``; None or ``defaults``:
    the defaults): the strategy, the options given, ``budget`` unless ``steps`` is given, and ``keep-local``'s
    source."""
    if text in (None, "defaults"):
        return {"budget": budget}
    strategy, options = recipe(text)
    if strategy == "keep-local":
        options["params"] = {"source": str(src), **options.get("params", {})}
    return {"strategy": strategy, **({} if "steps" in options else {"budget": budget}), **options}


def extend_and_read(src: Path, work: Path, corpora: dict, tok, source, s: dict, budget: str, seed: int,
                    strategy: str | None) -> dict:
    """Extend ``src`` to 4x with ``finetune`` (its defaults, or the recipe ``strategy``), and read the far range and
    the probe on the held-out and kept-aside corpora; print them."""
    new = 4 * OLD
    dst = work / f"extended-{(strategy or 'defaults').replace(':', '-').replace(',', '-')}"
    t0 = time.perf_counter()
    report = posextend.finetune(src, dst, [corpora["train"]], length=new, seed=seed, overwrite=True,
                                **finetune_options(strategy, src, budget))
    seconds = time.perf_counter() - t0
    tuned = transformers.AutoModelForCausalLM.from_pretrained(dst).eval()
    exact = train_exact(src, dst, report, OLD, [corpora["train"]], corpora["held-out"], seed)
    posextend.resize_checkpoint(src, work / "untrained", new, report.strategy, seed=seed, overwrite=True,
                                **(report.config.params or {}))
    head = previous_token(source, OLD, OLD)["head"]
    local = {"source": previous_token(source, OLD, OLD),
             "resized": previous_token(transformers.AutoModelForCausalLM.from_pretrained(work / "untrained"), new, OLD,
                                       head),
             "fine-tuned": previous_token(tuned, new, OLD, head)}
    rows = {name: read(tuned, source, exact, pack(tok, read_documents([path]), new)[: s["eval_sequences"]])
            for name, path in corpora.items() if name != "train"}
    aside = pack(tok, read_documents([corpora["kept aside"]]), new)
    after = {"random words": probe(tuned, tok, OLD, new), "kept-aside text": probe(tuned, tok, OLD, new, aside)}
    print(f"\n{strategy or 'the defaults'}: fine-tuned {OLD} -> {new}: {report.steps} steps, {report.tokens:,} tokens, "
          f"{seconds:.0f} s (budget {budget}); {report.verdict.text if report.verdict else 'no verdict'}\n\n"
          f"{table(rows)}\n")
    for name, p in after.items():
        print(probe_line(f"the extended model, {name} ({new} over {OLD})", p))
    print("the source's previous-token head (first layer, from the positions alone), its weight on p-1 within "
          f"{OLD} / past it: " + "; ".join(f"{k} {v['within']:.2f} / {v['past']:.2f}" for k, v in local.items()))
    return {"finetune": {"strategy": report.strategy, "steps": report.steps, "tokens": report.tokens,
                         "seconds": seconds, "lr": report.lr, "written_step": report.written_step,
                         "verdict": report.verdict.to_dict() if report.verdict else None,
                         "context_use": report.context_use.to_dict() if report.context_use else None},
            "rows": rows, "probe_after": after, "previous_token": local}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a short pretraining and an 8 s budget (the tests)")
    ap.add_argument("--budget", help=f"the fine-tune's budget (default: the defaults' own, {DEFAULT_BUDGET}; "
                                     "--quick: 8s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", type=Path, default=Path(".bench/uses_context"), help="corpora and models")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--strategies", nargs="+", default=[None], metavar="STRATEGY[:KEY=VALUE,...]",
                    help="fine-tune the source once per recipe: a strategy and finetune's options (steps=3000 "
                         "trains that many steps in place of the budget; anchor=0; keep-local, this folder's "
                         "strategy, takes its source) or 'defaults', each with the same budget (default: the "
                         "defaults' own)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    mode = "quick" if args.quick else "full"
    s = SETTINGS[mode]
    budget, new = args.budget or s["budget"], 4 * OLD
    work = args.workdir
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t_start = time.perf_counter()
    corpora = {name: write_corpus(work / f"{name}.jsonl", docs, s["doc_words"], new, seed)
               for name, docs, seed in (("train", s["train_docs"], args.seed), ("held-out", s["eval_docs"], args.seed + 1),
                                        ("kept aside", s["eval_docs"], args.seed + 2))}
    src = work / "source"
    print(f"pretraining the source ({MODEL['n_layer']} x {MODEL['n_embd']}, {len(VOCABULARY)} words, {OLD} positions)")
    pretrained = pretrain(src, s, args.seed)
    tok = transformers.AutoTokenizer.from_pretrained(src)
    source = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    before = probe(source, tok, OLD // 4, OLD)
    print(probe_line(f"the source within its window ({OLD} over {OLD // 4})", before))
    runs = {}
    for strategy in args.strategies:
        runs[strategy or "defaults"] = extend_and_read(src, work, corpora, tok, source, s, budget, args.seed, strategy)
    meta = {"mode": mode, "seed": args.seed, "budget": budget, "old": OLD, "new": new, "model": MODEL,
            "vocabulary": len(VOCABULARY), "settings": s, "wall_seconds": time.perf_counter() - t_start,
            "hardware": machine(), "torch": torch.__version__, "posextend": posextend.__version__}
    result = {"meta": meta, "pretrain": pretrained, "probe_before": before, **runs.get("defaults", {}),
              "runs": runs}
    print(f"\n{meta['wall_seconds'] / 60:.1f} min on {meta['hardware']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"written: {args.json}")


if __name__ == "__main__":
    main()
