"""The ``causal`` objective: next-token prediction for GPT-style models, with an anchor on the old range and a
window anchor on the new one."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from posextend.errors import DataError
from posextend.training.context import RunContext
from posextend.training.objectives.base import CheckpointFacts, LanguageModel, register_objective

if TYPE_CHECKING:
    from posextend.scoring.context_use import ContextUse


@register_objective("causal", description="Next-token prediction (GPT-style models).")
class CausalLM(LanguageModel):
    """Next-token loss on every position, plus ``anchor`` × the KL divergence from the frozen
    source model's predictions on the old range (the first ``old_length`` positions, which the
    source reads exactly as it was trained to), so that training the new range keeps the old one, plus
    ``window_anchor`` × the KL divergence of the new positions' predictions from the model's own reading
    of them through its old window, on the tokens that window reads better (:func:`own_window_kl`), so that the
    longer context does not read worse than that window; off for a source that uses its context within its window
    (:meth:`window_anchor_for`), which the extension may learn to use past it."""

    model_class = "AutoModelForCausalLM"
    head = "causal-LM"
    scoring = "causal"
    metric = "perplexity"
    priority = 10  # below masked: a family with both heads (BERT) is a masked LM
    # training every weight: far range / in-range 0.93-1.06 across the quality grid from interpolate (tile is
    # far worse); new-rows keeps tile, whose old rows are the source's (interpolate moves them: +23-57%)
    strategy = {"new-rows": "tile", "positions": "tile", "all": "interpolate", "lora": "interpolate"}
    # all: 1e-3 with a cosine decay beat 1e-4..5e-4 constant and 3e-4, 5e-4, 2e-3 cosine at 4x (README);
    # measured on models 128-192 wide, so wider ones get 192/width of it (GPT-2 small: 2.5e-4)
    # lora (benchmarks/lora.py, 2x128 at 4x, the same time as all's 150 steps): far range 1e-3 1.035x all's, 2e-3
    # 1.035x, 3e-3 1.042x, 5e-4 1.042x; original range +5.9%, +5.0%, +4.6%, +7.6%
    lr = {"new-rows": 3e-3, "positions": 1e-3, "all": 1e-3, "lora": 2e-3}
    lr_width = 192
    schedule = {"new-rows": "constant", "positions": "constant", "all": "cosine", "lora": "cosine"}
    anchor = 1.0  # the original range at 4x, lr 1e-3 cosine: up to +6.8% without, +3.9% at 0.3, +2.3% at 1 (README)
    # benchmarks/no_harm.py (3 x 128, 64 -> 256, the far range on unseen novels): without it the far range read
    # 1.03-1.10x the same model through its old window at 500-5,000 steps (the window reading improved faster than
    # the whole one); with it 1.003-1.012 and the whole reading itself better at equal time. Off for a source that
    # copies within its window (window_anchor_for): on uses_context.py's it kept the extension from learning to
    # copy past the old window (6,000 steps: far range 0.995x its own window, against 0.683x without) (README)
    window_anchor = 1.0

    def batch_size_for(self, old: int, new: int) -> int:
        """With the window anchor on (a source that does not use its context within its window), as many tokens per
        step as :attr:`batch_size` sequences of the old length (one sequence at 4x, two at 2x), so a time budget does
        not buy ``new / old`` times fewer updates than a run at the old length; else :attr:`batch_size`.
        benchmarks/no_harm.py, 15 minutes each side by side, batch 1 against 4 at 4x: the far range with the whole
        context 1.8-3.5% better on two unseen novels and two sources (83.3 / 90.8 against 86.3 / 93.5 on the grid's
        2 x 128; 80.6 / 81.8 against 82.2 / 83.3 on issue 60's 3 x 128). On uses_context.py's source, which copies
        (window anchor off), batch 1 stopped on its held-out check at 276 s, 2.4M tokens, before the copy's phase
        change (3.5-4.5M tokens at batch 4): far range 45.9 against 13.9 with batch 4's 15 minutes (README)."""
        if new <= old or not self.window_anchor:
            return self.batch_size
        return max(1, round(self.batch_size * old / new))

    def accepts(self, checkpoint: CheckpointFacts) -> bool:
        """A family with a causal-LM head that is not an encoder-decoder's."""
        return self.has_head(checkpoint) and not checkpoint.config.get("is_encoder_decoder")

    def loss(self, run: RunContext, positions: range, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        batch = batch.to(run.accelerator.device)
        out = run.model(input_ids=batch, labels=batch)
        loss, old = out.loss, run.sizes.length.old
        if old < run.sizes.length.new:
            if run.reference is not None and not run.short_inputs_fixed:
                loss = loss + self.anchor * self.reference_kl(run, batch[:, :old], out.logits[:, :old])
            if self.window_anchor:
                loss = loss + self.window_anchor * own_window_kl(run.model, batch, out.logits, old,
                                                                 keep_logits=keeps_logits(run.unwrapped))
        return loss, batch.shape[0] * (batch.shape[1] - 1)

    def window_anchor_for(self, unextended: torch.nn.Module, processor, held_out: torch.Tensor, old: int
                          ) -> tuple[float | None, str]:
        """``window_anchor``, or 0 for a source that uses its context within its own window (the repeated passage of
        :func:`~posextend.scoring.context_use.context_use`, its rule, read within it, over a quarter of it, on the
        held-out text): such a model may learn to read past its old window, which the window anchor would hold back."""
        from posextend.scoring.context_use import repeat_reading, repeated_passages, uses_context

        window = old // 4
        try:
            repeats, passage = repeated_passages(window, old, text=held_out[:, :old], tokenizer=processor)
        except DataError:  # too short an old length to read the probe in: the default
            return self.window_anchor, ""
        whole, windowed = repeat_reading(unextended, repeats, passage, window)
        read = (f"a passage repeated {old - passage} tokens later reads at perplexity {whole:.1f} with its whole "
                f"context against {windowed:.1f} through a {window}-token window")
        if uses_context(whole, windowed):
            return 0.0, (f"window anchor off: the source uses its context within its window ({read}), so the "
                         "extension may learn to use it past the old length")
        return self.window_anchor, (f"window anchor {self.window_anchor:g}: the source does not use its context within "
                                    f"its window ({read}), so the new positions are held to its reading through it")

    def context_use(self, run: RunContext) -> ContextUse | None:
        """A passage repeated and a pass key planted past the old window, read whole and through it, on the run's
        held-out windows (:func:`~posextend.scoring.context_use.context_use`)."""
        from posextend.scoring.context_use import context_use

        length = run.sizes.length
        try:
            return context_use(run.model, run.tokenizer, old_length=length.old, length=length.new,
                               text=run.eval_samples, seed=run.config.seed, batch_size=run.config.batch_size,
                               device=run.accelerator.device)
        except DataError:  # no extension, or too few new positions to plant the probe in
            return None


def keeps_logits(model: torch.nn.Module) -> bool:
    """Whether ``model`` (a peft model: its base model) computes the logits of its last positions only when asked
    (``logits_to_keep``, transformers' causal LMs)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "logits_to_keep" in inspect.signature(base.forward).parameters


def own_window_kl(model: torch.nn.Module, batch: torch.Tensor, logits: torch.Tensor, old: int, *,
                  keep_logits: bool = False, harm_only: bool = True) -> torch.Tensor:
    """The KL divergence of ``logits`` (``model``'s on ``batch``, read whole) at the tokens past the first ``old``
    from ``model``'s own predictions of them through a sliding window of ``old`` tokens, summed over the tokens
    where the window gives the next token the higher probability (every token unless ``harm_only``: where the
    whole context reads a token better, nothing holds it back) and divided by the number of tokens past ``old``.
    The windows are the reads of :func:`~posextend.scoring.by_position.windows`, each block of half a window read
    by the window that ends with it, as the run's control reads the held-out text (no gradient through that
    reading; eval mode); they go through the model a few at a time, about as many tokens as ``batch`` at once.
    ``keep_logits``: ask the model for the logits of each window's last positions only (:func:`keeps_logits`)."""
    from posextend.scoring.by_position import evaluating, windows

    reads = [(first, start, end) for first, start, end in windows(batch.shape[1], old) if start >= old]
    if not reads:
        return logits.new_zeros((), dtype=torch.float32)
    keep = {"logits_to_keep": max(end - start for _, start, end in reads) + 1} if keep_logits else {}
    total, count = logits.new_zeros((), dtype=torch.float32), 0
    group = max(1, batch.shape[1] // old)  # windows per forward
    for i in range(0, len(reads), group):
        chunk = reads[i:i + group]
        with evaluating(model), torch.no_grad():
            read = model(input_ids=torch.cat([batch[:, first:end] for first, _, end in chunk]), **keep).logits
        rows = batch.shape[0]
        for j, (first, start, end) in enumerate(chunk):
            # the tokens start..end-1, each predicted from the logits one before it (the control's reading, by_position)
            teacher = read[j * rows:(j + 1) * rows, read.shape[1] - 1 - (end - start):read.shape[1] - 1]
            teacher, student = teacher.float().log_softmax(-1), logits[:, start - 1:end - 1].float().log_softmax(-1)
            kl = F.kl_div(student, teacher, log_target=True, reduction="none").sum(-1)
            if harm_only:
                token = batch[:, start:end, None]
                kl = kl * (teacher.gather(-1, token) > student.detach().gather(-1, token))[..., 0]
            total, count = total + kl.sum(), count + kl.numel()
    return total / count
