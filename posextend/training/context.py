"""What an objective sees of a fine-tune: :class:`RunContext`, its one public contract.

The training loop (:mod:`posextend.training.loop`) builds it and hands it to the objective's ``loss``,
``evaluate`` and ``save``; objectives import nothing from the loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from posextend.training.options import FinetuneConfig
from posextend.training.sizes import Sizes

if TYPE_CHECKING:
    import torch

    from posextend.families.specs import ArchitectureSpec
    from posextend.training.loading import Loaded


def sample_generator(seed: int, position: int) -> torch.Generator:
    """The generator of global sample ``position``'s random choices."""
    import torch

    return torch.Generator().manual_seed(seed * 1_000_003 + position)


@dataclass(frozen=True)
class Samples:
    """What a run reads: ``train`` and ``held_out`` samples as the objective cut them (:meth:`Objective.samples`), the
    documents each was cut from, and ``note``: what the verdict is judged on
    (:func:`posextend.data.heldout.held_out_note`; empty when the held-out data was given)."""

    train: Any
    held_out: Any
    train_documents: Sequence[Any] = ()
    held_out_documents: Sequence[Any] = ()
    note: str = ""


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
    - ``train_samples`` / ``eval_samples``: the samples the objective cut (:meth:`Objective.samples`): a tensor of
      token windows, or any sequence of items (images, pairs of image and caption); the loop takes micro-batches
      of them by index and hands each to ``loss`` as the objective made it (rows of the tensor, or a list);
      ``eval_documents``: the held-out documents they were cut from (never trained on).
    - ``sizes``: the run's sizes and the source's, one axis each (:class:`~posextend.training.sizes.Sizes`, each an
      :class:`~posextend.training.sizes.Axis` of ``old`` and ``new``): ``sizes.length``, the number of positions (an
      image grid's patches, for a vision tower); ``sizes.decoder``, an encoder-decoder's decoder positions where it
      has a length of its own (LED; None: ``sizes.length``); ``sizes.image``, the image size in pixels (height,
      width) for a model with an image grid (None without one).
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
    train_samples: torch.Tensor | Sequence[Any]
    eval_samples: torch.Tensor | Sequence[Any]
    eval_documents: Sequence[Any] = ()
    sizes: Sizes
    short_inputs_fixed: bool = False
    reference: torch.nn.Module | None = None
    state: Any = None

    @classmethod
    def of(cls, loaded: Loaded, objective: Any, config: FinetuneConfig, sizes: Sizes, samples: Samples, /, *,
           accelerator: Any, model: torch.nn.Module | None = None, **own: Any):
        """The context of a run of ``objective`` on ``loaded`` (its processor, spec and reference; the objective's
        state made empty), read at ``sizes`` on ``samples``; ``model``: as prepared by ``accelerator`` (default:
        ``loaded.model`` as it is). ``own``: a subclass's own fields (a fine-tune's :class:`Run`). ``objective`` is
        an :class:`~posextend.training.objectives.base.Objective` (not annotated: that module imports this one)."""
        model = loaded.model if model is None else model
        return cls(accelerator=accelerator, model=model, unwrapped=accelerator.unwrap_model(model),
                   processor=loaded.processor, config=config, spec=loaded.spec, train_samples=samples.train,
                   eval_samples=samples.held_out, eval_documents=samples.held_out_documents, sizes=sizes,
                   short_inputs_fixed=config.train == "new-rows", reference=loaded.reference, state=objective.State(),
                   **own)

    @property
    def tokenizer(self) -> Any:
        """The processor of a text objective: its tokenizer."""
        return self.processor

    def generator(self, position: int) -> torch.Generator:
        """Global sample ``position``'s generator: every random choice of that sample comes from it, so a run
        is the same on any number of processes."""
        return sample_generator(self.config.seed, position)
