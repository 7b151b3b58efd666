"""The ``seq2seq`` objective: gap-sentence generation for encoder-decoders (BART, mBART, PLBART, MVP,
BlenderBot), the fine-tune of the LED recipe (Longformer, arXiv 2004.05150, §6: BART's 1,024 encoder
positions copied to 16K, then trained).

Self-supervised from raw text, as PEGASUS (arXiv 1912.08777) pretrains: in each window of the run's
length, whole sentences spread over the window (one per equal region, about 15% of its tokens) are each
replaced by one mask token, and the decoder generates them in order. So every encoder position, the new
ones included, holds text the loss depends on. Evaluated by position: each masked sentence's loss, binned
by where its mask sat in the source.

With data of supervised pairs instead (JSON Lines of ``source`` and ``target`` fields: a document and its
summary), the decoder learns to generate each target from its source, cut to the run's length; evaluated
by each target's loss, binned by its source's length.

One file, registered through the ``posextend.objectives`` entry point as a third-party objective is.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Container, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from posextend.training.context import RunContext, sample_generator
from posextend.errors import TrainingError
from posextend.scoring.by_position import EvalReport, bucket_edges, evaluating, report_from, token_losses
from posextend.scoring.verdict import Reading, far_start
from posextend.training.loading import Loaded
from posextend.training.objectives.base import CheckpointFacts, Objective, register_objective

GAP_RATIO = 0.15  # the share of the source's tokens masked, PEGASUS's
SENTENCE_TOKENS = 24  # a typical sentence, to set the number of gaps
MAX_SENTENCE = 96  # longer sentences are not masked (their target would dominate); Austen's run ~50 tokens
ENDS = (".", "!", "?")  # a token whose text ends so (closing quotes aside) ends a sentence
# the anchor's default weight: off. On the small BART of benchmarks/seq2seq.py (256 -> 1024, tile, 200 steps) anchor 1
# left the original range where anchor 0 did (631.0 both) and the far range worse (626.8 vs 621.7); --anchor 1 turns it on
ANCHOR = 0.0
# the window anchor's default weight (the masked sentences held to the model's own reading of each old-length window):
# off. On benchmarks/seq2seq.py (256 -> 1024, tile, 15 minutes each) weight 1 read far / itself 1.017 against 1.022
# but the far range 8% worse (373.5 vs 346.5, 1,777 steps vs 2,295); at 600 steps each 1.052 vs 1.055
WINDOW_ANCHOR = 0.0
METRICS = {False: "masked-sentence perplexity", True: "target perplexity by source length"}  # raw text, pairs
HELD_OUT = 10**9  # held-out window i draws its gaps from sample HELD_OUT + i's generator (no training sample's)


def framing(tokenizer) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer puts before and after a text's ids (BART: ``<s>`` and ``</s>``)."""
    bare = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    at = next((i for i in range(len(full)) if full[i : i + len(bare)] == bare), None)
    if not bare or at is None:
        raise TrainingError("Cannot tell which special tokens this tokenizer adds around a text.")
    return full[:at], full[at + len(bare):]


def gap_count(source_tokens: int) -> int:
    """How many sentences a source of ``source_tokens`` tokens has masked: about :data:`GAP_RATIO` of them."""
    return max(1, round(GAP_RATIO * source_tokens / SENTENCE_TOKENS))


def raw_tokens(source_tokens: int) -> int:
    """Tokens of text a sample needs so that, once its gaps are masked, the source still has ``source_tokens``."""
    return source_tokens + gap_count(source_tokens) * (MAX_SENTENCE - 1)


def sentence_ends(tokenizer) -> frozenset[int]:
    """The vocabulary ids whose text ends a sentence (``.``, ``."``, ``!\n`` …)."""
    texts = [tokenizer.decode([i]) for i in range(len(tokenizer))]
    return frozenset(i for i, t in enumerate(texts) if t.strip().rstrip("\"'\u201d\u2019)").endswith(ENDS))


def gaps(row: Sequence[int], ends: Container[int], source_tokens: int, mask: int, generator: torch.Generator,
         target_tokens: int | None = None) -> tuple[list[int], list[int], list[int]]:
    """``(source, target, where)`` of one window ``row`` of token ids: the source, exactly ``source_tokens``
    long, with one sentence per region of ``source_tokens / gap_count`` replaced by ``mask``; the target, those
    sentences in order; and for each target token, the source position of its mask.

    A region's gap is the whole sentence (2 to :data:`MAX_SENTENCE` tokens) starting in it nearest to a
    point drawn uniformly in it, so gaps fall at every position; a region where no such sentence starts
    (or none fits in the ``target_tokens`` the decoder reads) has none."""
    k = gap_count(source_tokens)
    size = source_tokens / k
    row = list(row)
    cuts = [0] + [i + 1 for i, t in enumerate(row[:-1]) if t in ends] + [len(row)]
    spans = list(zip(cuts[:-1], cuts[1:]))
    chosen, removed, taken = set(), 0, 0  # the gaps' tokens out of the source (less their masks), in the target
    room = target_tokens if target_tokens is not None else source_tokens
    for j in range(k):
        point = (j + float(torch.rand((), generator=generator))) * size
        fits = [(abs(a - removed - point), i) for i, (a, b) in enumerate(spans)
                if j * size <= a - removed < (j + 1) * size and 2 <= b - a <= min(MAX_SENTENCE, room - taken)]
        if fits:
            i = min(fits)[1]
            chosen.add(i)
            removed += spans[i][1] - spans[i][0] - 1
            taken += spans[i][1] - spans[i][0]
    source: list[int] = []
    target: list[int] = []
    where: list[int] = []
    for i, (a, b) in enumerate(spans):
        if len(source) >= source_tokens:
            break
        if i in chosen:
            where += [len(source)] * (b - a)
            target += row[a:b]
            source.append(mask)
        else:
            source += row[a:b]
    if len(source) < source_tokens:
        raise TrainingError(f"A window of {len(row)} tokens gave a source of {len(source)}, fewer than "
                            f"{source_tokens}: the text is too short for this length.")
    return source[:source_tokens], target, where


def _collate(sources: list[list[int]], targets: list[list[int]], pad: int | None, device) -> dict[str, torch.Tensor]:
    """Sources padded with ``pad`` (with an attention mask where their lengths differ) and targets as labels
    padded with -100."""
    ids = torch.full((len(sources), max(map(len, sources))), pad if pad is not None else 0, dtype=torch.long)
    labels = torch.full((len(targets), max(map(len, targets))), -100, dtype=torch.long)
    for i, (s, t) in enumerate(zip(sources, targets)):
        ids[i, : len(s)], labels[i, : len(t)] = torch.tensor(s), torch.tensor(t)
    inputs = {"input_ids": ids.to(device), "labels": labels.to(device)}
    if len(set(map(len, sources))) > 1:
        inputs["attention_mask"] = (torch.arange(ids.shape[1]) < torch.tensor([[len(s)] for s in sources])).long().to(device)
    return inputs


@dataclass
class Gaps:
    """The run's per-run state: the tokenizer's framing and sentence ends (found once), and the longest target."""

    framing: tuple[list[int], list[int]] | None = None
    ends: frozenset[int] | None = None
    longest_target: int = 0  # in a training batch at the run's length (:meth:`GapSentences.notes`)


@register_objective("seq2seq", description="Encoder-decoders: masked sentences spread over the source are generated "
                                           "(gap-sentence generation, as PEGASUS).")
class GapSentences(Objective):
    data = ("UTF-8 text files, folders of them, or JSON Lines with a 'text' field (masked sentences), or with "
            "'source' and 'target' fields (supervised pairs)")
    """Gap-sentence generation (see the module doc). ``tile`` fills the new rows, as LED copies BART's."""

    model_class = "AutoModelForSeq2SeqLM"
    head = "sequence-to-sequence"
    metric = METRICS[False]  # with pairs for data: METRICS[True]
    priority = 30  # above masked: BART's family has a masked-LM class too
    State = Gaps
    strategy = {"new-rows": "tile", "positions": "tile", "all": "tile", "lora": "tile"}  # LED's copies
    lr = {"new-rows": 3e-3, "positions": 1e-3, "all": 1e-4, "lora": 1e-3}
    schedule = {"new-rows": "constant", "positions": "constant", "all": "cosine", "lora": "cosine"}
    anchor = ANCHOR
    window_anchor = WINDOW_ANCHOR

    def accepts(self, checkpoint: CheckpointFacts) -> bool:
        """An encoder-decoder family with a generation head."""
        return self.has_head(checkpoint) and bool(checkpoint.config.get("is_encoder_decoder"))

    def check(self, loaded: Loaded, directory: Path) -> None:
        """The tokenizer must have a mask token: it stands where each masked sentence was."""
        if loaded.tokenizer.mask_token_id is None:
            raise TrainingError(f"The tokenizer of {directory} has no mask token, which gap-sentence generation "
                                "puts where each sentence was; add one (tokenizer.add_special_tokens) and save it.")

    def documents(self, paths: Sequence[str | Path]) -> Sequence[str] | list[tuple[str, str]]:
        """Supervised ``(source, target)`` pairs where the data is JSON Lines holding them, else raw texts."""
        from posextend.data.text import read_documents, read_pairs

        return read_pairs(paths) or read_documents(paths)

    def samples(self, tokenizer, documents: Sequence[str] | Sequence[tuple[str, str]], length: int) -> torch.Tensor:
        """Raw text: ``[n, raw]`` token windows, enough for a source of ``length`` tokens once its gaps are
        masked. Pairs: ``[n, 2, length]``, each pair's source and target ids (cut to ``length``, -1 after)."""
        from posextend.scoring.text import pack

        before, after = framing(tokenizer)
        inner = length - len(before) - len(after)
        if not (documents and isinstance(documents[0], tuple)):
            return pack(tokenizer, documents, raw_tokens(inner))
        rows = torch.full((len(documents), 2, inner), -1, dtype=torch.long)
        for i, pair in enumerate(documents):
            for j, text in enumerate(pair):
                ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"][:inner]
                rows[i, j, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        return rows

    def batch(self, run: RunContext, rows: torch.Tensor, generators: list[torch.Generator], length: int | None = None
              ) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
        """The model's inputs (sources of at most ``length`` tokens, default the run's; targets of at most
        the decoder's, padded with -100) and, per target token, the source position it is scored at: its
        mask's (raw text), or the source's last (pairs: binned by how long a source was read)."""
        tok, state = run.tokenizer, run.state
        if state.framing is None:
            state.framing = framing(tok)
        before, after = state.framing
        length = length or run.sizes.length.new
        inner = length - len(before) - len(after)
        decoder = run.sizes.decoder.new if run.sizes.decoder else length  # an LED's own; else both stacks' length
        room = min(length, decoder) - len(before) - len(after)  # what the decoder reads
        if rows.dim() == 3:
            pairs = [([t for t in source if t >= 0][:inner], [t for t in target if t >= 0][:room])
                     for source, target in rows.tolist()]
            wheres = [[-1] * len(before) + [len(before) + len(s) + len(after) - 1] * len(t) + [-1] * len(after)
                      for s, t in pairs]
        else:
            if state.ends is None:
                state.ends = sentence_ends(tok)
            cut = [gaps(row, state.ends, inner, tok.mask_token_id, g, target_tokens=room)
                   for row, g in zip(rows.tolist(), generators)]
            pairs = [(source, target) for source, target, _ in cut]
            wheres = [[-1] * len(before) + [w + len(before) for w in where] + [-1] * len(after) for _, _, where in cut]
        sources = [before + s + after for s, _ in pairs]
        targets = [before + t + after for _, t in pairs]
        if run.unwrapped.training and length == run.sizes.length.new:
            state.longest_target = max(state.longest_target, max(map(len, targets)))
        return _collate(sources, targets, tok.pad_token_id, run.accelerator.device), wheres

    def loss(self, run: RunContext, positions: range, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The masked sentences' loss, plus (when set: off by default) ``anchor`` × the KL divergence of the model's predictions from the
        frozen source's on a second sample of each window cut to the old length (inputs the source reads as
        it was trained to), so that training the new range keeps the old one; plus ``window_anchor`` × the
        KL divergence of the masked sentences' predictions from the model's own, each window of the old length
        read alone (:func:`own_window_kl`)."""
        inputs, wheres = self.batch(run, batch, [run.generator(p) for p in positions])
        out = run.model(**inputs)
        loss = out.loss
        old, new = run.sizes.length.old, run.sizes.length.new
        if self.window_anchor and old < new and batch.dim() == 2:
            loss = loss + self.window_anchor * own_window_kl(run, inputs, wheres, out.logits)
        if run.reference is not None and not run.short_inputs_fixed and old < new:
            short, _ = self.batch(run, batch, [run.generator(p) for p in positions], length=old)
            keep = (short["labels"] != -100).float()  # the target tokens
            loss = loss + self.anchor * self.reference_kl(run, short, run.model(**short).logits, keep)
        return loss, int((inputs["labels"] != -100).sum())

    def notes(self, run: RunContext) -> list[str]:
        """How far the decoder's positions were trained: BART-like families have one length for both
        stacks, so the decoder's table grew too, but its targets (masked sentences, summaries) are short."""
        longest = run.state.longest_target
        if not longest:
            return []
        if run.short_inputs_fixed and run.sizes.decoder is not None:  # new rows only, a decoder of its own length
            return [f"decoder: its targets are at most {longest} tokens; only its rows from its old length to "
                    f"{longest - 1}, if any, trained (new rows only)"]
        if run.short_inputs_fixed:  # new rows only, both stacks of one length
            old = run.sizes.length.old
            trained = "none of its new rows" if longest <= old else f"only rows {old}-{longest - 1} of its new rows"
            return [f"decoder: its targets are at most {longest} tokens, so {trained} ({old}-{run.sizes.length.new - 1}) "
                    "trained; the rest of its table is as extended"]
        return [f"decoder: positions 0-{longest - 1} of {(run.sizes.decoder or run.sizes.length).new} trained (its targets are at "
                f"most {longest} tokens); the rest of its table is as extended"]

    @torch.no_grad()
    def _losses(self, run: RunContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed loss and count of target tokens at each source position of the held-out samples (the same
        gaps every time: held-out window ``i`` draws them from its own generator)."""
        with evaluating(run.model):
            total = torch.zeros(run.sizes.length.new, dtype=torch.float64)
            count = torch.zeros(run.sizes.length.new, dtype=torch.float64)
            size = run.config.batch_size
            for i in range(0, len(run.eval_samples), size):
                rows = run.eval_samples[i : i + size]
                inputs, wheres = self.batch(run, rows, [sample_generator(run.config.seed, HELD_OUT + i + j) for j in range(len(rows))])
                logits = run.model(**inputs).logits.float()
                losses = token_losses(logits, inputs["labels"]).cpu().double()
                for r, where in enumerate(wheres):
                    for t, pos in enumerate(where):
                        if pos >= 0 and inputs["labels"][r, t] != -100:
                            total[pos] += losses[r, t]
                            count[pos] += 1
        return total, count

    def evaluate(self, run: RunContext) -> EvalReport:
        """Each masked sentence's loss, binned by the source position of its mask; for pairs, each target's
        loss binned by its source's length (the position of its last token)."""
        total, count = self._losses(run)
        length = run.sizes.length
        old = length.old if length.old < length.new else None
        edges = bucket_edges(length.new, run.config.buckets, old_length=old)
        pairs = run.eval_samples.dim() == 3  # sources and targets: each target binned by its source's length
        report = report_from(total, count, edges, objective="seq2seq", sequences=len(run.eval_samples), old_length=old,
                             metric=METRICS[pairs])
        if pairs:
            report = dataclasses.replace(report, axis="source tokens", noun="pairs")
        if not math.isfinite(report.loss):
            raise TrainingError("No masked sentence in the held-out text: give more text, or text with sentences.")
        return report

    def baseline(self, run: RunContext, unextended: torch.nn.Module) -> Reading | None:
        """The source reading the held-out text in windows of its own length: its masked-sentence perplexity
        there, which both ranges are held to (raw text only; pairs have no far range to compare)."""
        old, new = run.sizes.length.old, run.sizes.length.new
        if run.eval_samples.dim() == 3 or old >= new or not run.eval_documents:
            return None
        windows = self.samples(run.tokenizer, run.eval_documents, old)
        windows = windows[: len(run.eval_samples) * max(1, new // old)]
        # the source's length for both stacks (no decoder of its own: an LED's source reads its windows whole)
        sizes = dataclasses.replace(run.sizes, length=dataclasses.replace(run.sizes.length, new=old), decoder=None)
        own = dataclasses.replace(run, model=unextended.to(run.accelerator.device), sizes=sizes, eval_samples=windows)
        total, count = self._losses(own)
        perplexity = math.exp(min(float(total.sum() / count.sum().clamp(min=1)), 50))
        return Reading(far=perplexity, original=perplexity, metric=METRICS[False])

    def baseline_name(self, run: RunContext) -> str:
        return f"the source reading the text in its own {run.sizes.length.old}-token windows"

    def control_name(self, run: RunContext) -> str:
        return f"the same model reading the text in {run.sizes.length.old}-token windows"

    def reading(self, run: RunContext) -> Reading | None:
        old, new = run.sizes.length.old, run.sizes.length.new
        if run.eval_samples.dim() == 3 or old >= new:
            return None
        total, count = self._losses(run)
        start = far_start(new, old)
        far, original = (float(total[a:b].sum() / count[a:b].sum().clamp(min=1)) for a, b in ((start, new), (0, old)))
        return Reading(far=math.exp(min(far, 50)), original=math.exp(min(original, 50)), metric=METRICS[False])


def own_window_kl(run: RunContext, inputs: dict[str, torch.Tensor], wheres: list[list[int]], logits: torch.Tensor,
                  *, harm_only: bool = True) -> torch.Tensor:
    """The KL divergence of the masked sentences' predictions (``logits``: the model's, reading each source whole)
    from the same model's reading each window of the old length alone: the source cut into windows of the old
    length (its framing tokens around each), each window's target the sentences whose masks fall in it, in
    order (no gradient; eval mode). Summed over the target tokens where the window gives the token the higher
    probability (every one unless ``harm_only``), over all of them; the run's control reads the held-out text
    in such windows. ``wheres``: each target token's mask position in the source (-1: framing)."""
    tok, (before, after) = run.tokenizer, run.state.framing
    inner = run.sizes.length.old - len(before) - len(after)  # a window's text
    ids, labels = inputs["input_ids"].tolist(), inputs["labels"]
    sources, targets, places = [], [], []  # per window: its source, target, and (row, token) of each target token
    for r, where in enumerate(wheres):
        chunks: dict[int, list[int]] = {}
        for t, pos in enumerate(where):
            if pos >= 0 and int(labels[r, t]) != -100:
                chunks.setdefault((pos - len(before)) // inner, []).append(t)
        for c, tokens in sorted(chunks.items()):
            text = ids[r][len(before) + c * inner: len(before) + (c + 1) * inner]
            sources.append(before + text + after)
            targets.append(before + [int(labels[r, t]) for t in tokens] + after)
            places.append([(r, t) for t in tokens])
    if not sources:
        return logits.new_zeros((), dtype=torch.float32)
    windowed = _collate(sources, targets, tok.pad_token_id, logits.device)
    with evaluating(run.model), torch.no_grad():
        read = run.model(**windowed).logits
    rows = torch.tensor([r for p in places for r, _ in p], device=logits.device)
    cols = torch.tensor([t for p in places for _, t in p], device=logits.device)
    wrows = torch.tensor([w for w, p in enumerate(places) for _ in p], device=logits.device)
    wcols = torch.tensor([len(before) + i for p in places for i in range(len(p))], device=logits.device)
    student = logits[rows, cols].float().log_softmax(-1)
    teacher = read[wrows, wcols].float().log_softmax(-1)
    kl = torch.nn.functional.kl_div(student, teacher, log_target=True, reduction="none").sum(-1)
    if harm_only:
        token = labels[rows, cols][:, None]
        kl = kl * (teacher.gather(-1, token) > student.detach().gather(-1, token))[:, 0]
    return kl.sum() / len(kl)
