"""The ``causal`` objective: next-token prediction for GPT-style models, with an anchor on the old range."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from posextend.errors import DataError
from posextend.training.context import RunContext
from posextend.training.objectives.base import CheckpointFacts, LanguageModel, register_objective

if TYPE_CHECKING:
    from posextend.scoring.context_use import ContextUse


@register_objective("causal", description="Next-token prediction (GPT-style models).")
class CausalLM(LanguageModel):
    """Next-token loss on every position, plus ``anchor`` × the KL divergence from the frozen
    source model's predictions on the old range (the first ``old_length`` positions, which the
    source reads exactly as it was trained to), so that training the new range keeps the old one."""

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

    def accepts(self, checkpoint: CheckpointFacts) -> bool:
        """A family with a causal-LM head that is not an encoder-decoder's."""
        return self.has_head(checkpoint) and not checkpoint.config.get("is_encoder_decoder")

    def loss(self, run: RunContext, positions: range, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        batch = batch.to(run.accelerator.device)
        out = run.model(input_ids=batch, labels=batch)
        loss, old = out.loss, run.sizes.length.old
        if run.reference is not None and not run.short_inputs_fixed and old < run.sizes.length.new:
            loss = loss + self.anchor * self.reference_kl(run, batch[:, :old], out.logits[:, :old])
        return loss, batch.shape[0] * (batch.shape[1] - 1)

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
