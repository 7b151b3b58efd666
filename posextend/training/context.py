"""What an objective sees of a fine-tune: :class:`RunContext`, its one public contract.

The training loop (:mod:`posextend.training.loop`) builds it and hands it to the objective's ``loss``,
``evaluate`` and ``save``; objectives import nothing from the loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from posextend.training.options import FinetuneConfig

if TYPE_CHECKING:
    import torch

    from posextend.families.specs import ArchitectureSpec


def sample_generator(seed: int, position: int) -> torch.Generator:
    """The generator of global sample ``position``'s random choices."""
    import torch

    return torch.Generator().manual_seed(seed * 1_000_003 + position)


@dataclass(kw_only=True)
class RunContext:
    """One fine-tune, set up, as its objective sees it.

    - ``model``: the model as prepared by accelerate (wrapped when distributed: call it for forwards);
      ``unwrapped``: the model itself (its attributes, saving).
    - ``processor``: what turns the objective's data into the model's inputs, as its ``load_model`` loaded it: a
      tokenizer (``tokenizer`` names it too), an image processor, or both (a CLIP processor);
      ``accelerator`` (``device``, ``num_processes``, ``reduce``).
    - ``config``: the run's options, resolved (:class:`~posextend.training.options.FinetuneConfig`: ``seed``,
      ``batch_size``, ``buckets``, ``lr`` …); ``spec``: the family's position tables.
    - ``train_seqs`` / ``eval_seqs``: the samples the objective cut (:meth:`Objective.samples`): a tensor of
      token windows, or any sequence of items (images, pairs of image and caption); the loop takes micro-batches
      of them by index and hands each to ``loss`` as the objective made it (rows of the tensor, or a list);
      ``eval_documents``: the held-out documents they were cut from (never trained on).
    - ``length`` / ``old_length``: the run's number of positions, and the source's (an image grid's patches, for a
      vision tower); ``decoder_length``: an encoder-decoder's decoder positions where it has a length of its own
      (LED; None: ``length``); ``image_size`` / ``old_image_size``: the run's image size in pixels (height, width)
      and the source's, for a model with an image grid (None without one).
    - ``short_inputs_fixed``: only new rows train, so outputs on inputs within the old length never change.
    - ``reference``: the frozen model the objective's anchor term compares with, when the run keeps one
      (:meth:`Objective.read_reference`, :meth:`Objective.copy_reference`).
    - ``state``: the objective's per-run state, an instance of its ``State`` dataclass (its loss
      modules, what it found once), made empty for each run.
    """

    accelerator: Any
    model: torch.nn.Module
    unwrapped: torch.nn.Module
    processor: Any
    config: FinetuneConfig
    spec: ArchitectureSpec | None = None
    train_seqs: torch.Tensor
    eval_seqs: torch.Tensor
    eval_documents: Sequence[Any] = ()
    length: int
    old_length: int
    decoder_length: int | None = None
    image_size: tuple[int, int] | None = None
    old_image_size: tuple[int, int] | None = None
    short_inputs_fixed: bool = False
    reference: torch.nn.Module | None = None
    state: Any = None

    @property
    def tokenizer(self) -> Any:
        """The processor of a text objective: its tokenizer."""
        return self.processor

    def generator(self, position: int) -> torch.Generator:
        """Global sample ``position``'s generator: every random choice of that sample comes from it, so a run
        is the same on any number of processes."""
        return sample_generator(self.config.seed, position)
