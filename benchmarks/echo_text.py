"""Text with long-range structure: a corpus whose sentences come back later, some soon, some far on.

    python benchmarks/echo_text.py ../shared/data/austen .cache/austen-echo     # the four novels, echoed

A small language model trained here cannot use context beyond a few dozen tokens of plain prose (the quality
grid's 3 x 128 GPT-2, trained from scratch at 256 positions on the four novels, reads the far range no better
with its whole context than through a 64-token window: ``benchmarks/context_probe.py``), so no extension can
show a gain there. Real long documents do hold what a longer context can use: names, terms and phrases defined
once and used again, quotations, repeated clauses, code identifiers. This script gives plain text that
structure in its simplest form: after a sentence, with probability ``--share``, an earlier sentence comes back
word for word, either ``near`` (1-2 sentences back: within a 64-token window, so a model trained at that length
learns to copy) or ``far`` (4-12 sentences back: about 100-400 tokens, beyond the old window and within the new
one). A model can then read the far range better with more context only by copying from further back: what
the extension must earn.

Each input ``*.txt`` gives one output of the same name; the echoes are drawn from a generator seeded by the
file's name, so the output is the same on every machine.
"""

from __future__ import annotations

import argparse
import random
import re
from pathlib import Path

SENTENCE = re.compile(r"(?<=[.!?])\s+|(?<=[.!?][\"'\u201d\u2019)])\s+")
NEAR, FAR = (1, 2), (4, 12)  # sentences back: within the old window, beyond it


def echo(text: str, *, seed: str, share: float = 0.25, far_share: float = 0.6) -> str:
    """``text`` with earlier sentences repeated after a ``share`` of its sentences, ``far_share`` of them from
    4-12 sentences back, the rest from 1-2 back. Paragraph breaks are kept where they were."""
    rng = random.Random(seed)
    said: list[str] = []  # every sentence so far, echoes included: what an echo is drawn from
    paragraphs = []
    for paragraph in text.split("\n\n"):
        out = []
        for sentence in (s for s in SENTENCE.split(paragraph.strip()) if s):
            out.append(sentence)
            said.append(sentence)
            if rng.random() < share:
                lo, hi = FAR if rng.random() < far_share else NEAR
                back = rng.randint(lo, hi)
                if back < len(said):
                    out.append(said[-1 - back])
                    said.append(out[-1])
        paragraphs.append(" ".join(out))
    return "\n\n".join(paragraphs).strip() + "\n"


def passages(text: str, *, seed: str, share: float = 0.5) -> str:
    """``text`` cut into passages of 1-8 sentences, a ``share`` of them said twice in a row (the second time word for
    word): a short passage comes back within a 64-token window, a long one from 100-300 tokens back. Repeated
    passages are what makes a small model learn to copy (induction heads) within a few million tokens."""
    rng = random.Random(seed)
    sentences = [s for paragraph in text.split("\n\n") for s in SENTENCE.split(paragraph.strip()) if s]
    out, at = [], 0
    while at < len(sentences):
        size = rng.randint(1, 8)
        passage = " ".join(sentences[at : at + size])
        at += size
        out.append(f"{passage} {passage}" if rng.random() < share else passage)
    return "\n\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="a folder of .txt files")
    ap.add_argument("dst", type=Path, help="where the echoed files are written")
    ap.add_argument("--share", type=float, default=0.25, help="sentences followed by an echo")
    ap.add_argument("--far-share", type=float, default=0.6, help="echoes from 4-12 sentences back (the rest 1-2)")
    ap.add_argument("--passages", action="store_true", help="passages said twice in a row (:func:`passages`)")
    args = ap.parse_args()
    args.dst.mkdir(parents=True, exist_ok=True)
    for path in sorted(args.src.glob("*.txt")):
        text = path.read_text(encoding="utf-8")
        text = (passages(text, seed=path.name) if args.passages else
                echo(text, seed=path.name, share=args.share, far_share=args.far_share))
        (args.dst / path.name).write_text(text, encoding="utf-8")
        print(f"{path.name}: {len(text):,} characters")


if __name__ == "__main__":
    main()
