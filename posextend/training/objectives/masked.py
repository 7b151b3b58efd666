"""The ``masked`` objective: BERT masking for masked-LM families."""

from __future__ import annotations

import torch

from posextend.training.context import RunContext
from posextend.training.objectives.base import CheckpointFacts, LanguageModel, register_objective


@register_objective("masked", description="BERT masking: 15% of tokens (80% [MASK], 10% random, 10% kept).")
class MaskedLM(LanguageModel):
    """The masked-LM loss on 15% of the tokens, each sample masked by its own generator."""

    model_class = "AutoModelForMaskedLM"
    head = "masked-LM"
    scoring = "masked"
    metric = "masked-LM perplexity"
    priority = 20

    def accepts(self, checkpoint: CheckpointFacts) -> bool:
        """A family with a masked-LM head."""
        return self.has_head(checkpoint)

    def loss(self, run: RunContext, positions: range, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        from posextend.scoring.text import mask_tokens

        pairs = [mask_tokens(row[None], run.tokenizer, run.generator(p)) for row, p in zip(batch, positions)]
        inputs, labels = torch.cat([a for a, _ in pairs]), torch.cat([b for _, b in pairs])
        device = run.accelerator.device
        return run.model(input_ids=inputs.to(device), labels=labels.to(device)).loss, int((labels != -100).sum())
