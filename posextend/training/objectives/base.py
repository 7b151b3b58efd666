"""What every objective is and shares: :class:`Objective`, the registry, the default choice, and helpers.

An objective is one class that declares what it trains and how, and the registry that finds it by name.
It declares the transformers auto class that loads its model (``model_class``: its head), how
messages call that head, its metric (what its held-out numbers are), its help line (``description``,
shown by ``posextend finetune --help``), which checkpoints it is the default for (:meth:`Objective.accepts`
and ``priority``) and its per-run state (``State``, a dataclass it defines). It inherits
:meth:`Objective.load` (tokenizer, model, fresh-head check, no dropout, the anchor's frozen copy) and
overrides only what differs; it writes ``loss`` and ``evaluate``. The loop (accumulation, resume, NaN,
Ctrl-C, progress, distribution) and the save (the checkpoint writer of ``resize-model``, into the source's
files and layout) are shared (:mod:`posextend.training.loop`); the loop hands each objective a
:class:`~posextend.training.context.RunContext`, its one view of the run. Every random choice of a sample
comes from ``run.generator(p)`` for its global number ``p``, so a run is the same whatever the number of
processes.

Built-ins, one module each: :mod:`posextend.training.objectives.causal`,
:mod:`posextend.training.objectives.masked`, :mod:`posextend.training.objectives.contrastive`, and
:mod:`posextend.training.objectives.seq2seq` (registered through the ``posextend.objectives`` entry point,
as a third-party objective is).

Example (a plug-in: one file, published under the entry-point group ``posextend.objectives``)::

    from posextend.training.objectives import Objective, register_objective

    @register_objective("tokens", description="Token classification (a head posextend does not ship).")
    class Tokens(Objective):
        model_class = "AutoModelForTokenClassification"
        head = "token-classification"
        metric = "token perplexity"
        def loss(self, run, positions, batch): ...
        def evaluate(self, run): ...
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from posextend.errors import TrainingError
from posextend.files.checkpoint import Checkpoint
from posextend.registry import Registry
from posextend.training.context import RunContext
from posextend.training.loading import Loaded, load_headed_model, stack_specs
from posextend.training.options import DEFAULT_BATCH

if TYPE_CHECKING:
    from posextend.families.specs import ArchitectureSpec
    from posextend.scoring.by_position import EvalReport
    from posextend.scoring.context_use import ContextUse
    from posextend.scoring.verdict import Reading
    from posextend.training.sizes import Sizes

ENTRY_POINT_GROUP = "posextend.objectives"


class CheckpointFacts:
    """What an objective is shown of a checkpoint to say whether it is its default (:meth:`Objective.accepts`):
    a view of the command's one :class:`~posextend.files.checkpoint.Checkpoint` (resolved once, facts read
    once), with the family's positions; ``config`` and ``spec`` are read when first asked for (a
    sentence-transformers folder needs neither)."""

    def __init__(self, checkpoint: str | Path | Checkpoint):
        self.checkpoint = Checkpoint.resolve(checkpoint)

    @property
    def directory(self) -> Path:
        return self.checkpoint.directory

    @property
    def sentence_transformer(self) -> bool:
        """A sentence-transformers folder (``modules.json`` at its root)."""
        return self.checkpoint.sentence_transformers

    @property
    def config(self) -> dict[str, Any]:
        """The config of its transformers model."""
        return self.checkpoint.config

    @functools.cached_property
    def spec(self) -> ArchitectureSpec:
        """The positions a fine-tune's length sizes (``spec.rank`` 2: an image grid). Raises for a family
        posextend does not resize."""
        return stack_specs(self.config)[0]


@dataclass
class NoState:
    """The per-run state of an objective that keeps none."""


class Objective:
    """Base class of an objective: ``loss`` and ``evaluate`` are per objective; the rest has defaults. The order in
    which a fine-tune calls its hooks is written once, in :func:`posextend.training.setup.setup`'s docstring."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""  # its help line (posextend finetune --help)
    # what its data may be, as ``--data``'s help lists it by objective (the readers: :mod:`posextend.data`)
    data: ClassVar[str] = "UTF-8 text files, folders of them, or JSON Lines with a 'text' field"
    model_class: ClassVar[str | type | None] = None  # what loads it (its head): a transformers auto class or its name
    head: ClassVar[str] = ""  # how messages call that head ("causal-LM")
    metric: ClassVar[str] = "perplexity"  # what its held-out numbers are, as reports print it
    priority: ClassVar[int] = 0  # among the objectives that accept a checkpoint, the highest is its default
    State: ClassVar[type] = NoState  # its per-run state (``run.state``), a dataclass made empty for each run
    unused_parameters: ClassVar[bool] = False  # some trainable parameters get no gradient from the loss
    steps: ClassVar[int] = 200  # default number of optimizer steps
    batch_size: ClassVar[int] = DEFAULT_BATCH  # default sequences per micro-batch (see :meth:`batch_size_for`)
    eval_sequences: ClassVar[int] = 16  # held-out samples each check reads, unless the run sets them
    early_stop: ClassVar[bool] = True  # a budget's run may stop once its reading stops improving (False: it trains
    # the whole budget)
    extension: ClassVar[str] = "the longer context"  # what the run gives the model, as its verdict names it
    whole: ClassVar[str] = "with the whole context"  # how its verdict says the extended model read the far range
    # its samples are consecutive windows of one stream of tokens (what :meth:`samples` cuts by default), so each
    # pass over the data after the first may cut them at another offset (:func:`posextend.training.batches.batch_rows`);
    # False for samples of another kind
    stream: ClassVar[bool] = True
    # by train mode: the default lr, schedule, and strategy when the fine-tune extends (README, quality grid)
    # lora: LoRA's matrices beside the tables and norms (:mod:`posextend.training.adapters`); measured for causal
    # LMs only (2e-3: benchmarks/lora.py), the others' are not
    lr: ClassVar[dict[str, float]] = {"new-rows": 3e-3, "positions": 1e-3, "all": 1e-4, "lora": 1e-3}
    lr_width: ClassVar[int | None] = None  # the table width ``lr["all"]`` was measured at (None: any width)
    schedule: ClassVar[dict[str, str]] = {"new-rows": "constant", "positions": "constant", "all": "constant",
                                          "lora": "constant"}
    strategy: ClassVar[dict[str, str]] = {"new-rows": "tile", "positions": "tile", "all": "tile", "lora": "tile"}
    anchor: ClassVar[float | None] = None  # weight of a term keeping the source's outputs (None: no such term)
    # weight of a term holding the new positions to the model's own reading through its old window (None: no such term)
    window_anchor: ClassVar[float | None] = None

    def accepts(self, checkpoint: CheckpointFacts) -> bool:
        """Whether this objective is a default for ``checkpoint`` (of those that are, the one of the highest
        ``priority`` is chosen). False by default: a plug-in is used when named, unless it says otherwise."""
        return False

    def has_head(self, checkpoint: CheckpointFacts) -> bool:
        """The checkpoint's positions are a length (not an image grid) and its model type has this
        objective's head (``model_class`` loads it)."""
        if not self.model_class:
            return False
        mapping = getattr(self.auto_class(), "_model_mapping", None)  # an auto class's: model type -> class name
        types = getattr(mapping, "_model_mapping", {})
        return checkpoint.spec.rank == 1 and checkpoint.config.get("model_type") in types

    def auto_class(self) -> Any:
        """The class ``model_class`` names (a transformers auto class, by name or itself)."""
        if not self.model_class:
            raise TrainingError(f"The {self.name} objective declares no model_class and does not override load_model.")
        import transformers

        return getattr(transformers, self.model_class) if isinstance(self.model_class, str) else self.model_class

    def load(self, directory: Path, *, init_head: bool) -> Loaded:
        """The model this objective trains and its tokenizer (:meth:`load_model`), checked (:meth:`check`),
        with the anchor's frozen copy of it when ``anchor`` is set."""
        loaded = self.load_model(directory, init_head=init_head)
        self.check(loaded, directory)
        if self.anchor:  # the source model, frozen, before its table is extended
            loaded.reference = self.copy_reference(loaded)
        return loaded

    def load_model(self, directory: Path, *, init_head: bool) -> Loaded:
        """The checkpoint in ``model_class`` (a fresh head only with ``init_head``), trained without dropout."""
        loaded = load_headed_model(directory, self.auto_class(), self.head or str(self.model_class), self.name,
                                   init_head=init_head)
        without_dropout(loaded.model)
        return loaded

    def check(self, loaded: Loaded, directory: Path) -> None:
        """Refuse a loaded checkpoint this objective cannot train (nothing by default)."""

    def copy_reference(self, loaded: Loaded) -> torch.nn.Module:
        """The anchor's reference (``run.reference``) when it is the checkpoint being trained: a frozen copy of
        its model as loaded, before its table is extended. :meth:`load` makes it when ``anchor`` is set."""
        return frozen_copy(loaded.model)

    def read_reference(self, directory: Path, *, init_head: bool) -> torch.nn.Module:
        """The anchor's reference read from ``directory`` instead (the original model the checkpoint was
        extended from), frozen: this objective's model there, at its own length."""
        plain = copy.copy(self)
        plain.anchor = 0.0  # no frozen copy of the reference itself
        return plain.load(directory, init_head=init_head).model.eval().requires_grad_(False)

    def default_lr(self, train: str, width: int) -> float:
        """The lr for train mode ``train`` on a model ``width`` wide: ``lr[train]``; for ``all``, on
        models wider than ``lr_width``, scaled by ``lr_width / width`` (Adam's rule for hidden
        weights, as in muP; GPT-3's pretraining lrs fall about as 1/width too). Tables (the other
        modes) keep their lr at any width."""
        lr = self.lr[train] if train in self.lr else Objective.lr[train]  # a plug-in's table from before the mode
        if train == "all" and self.lr_width and width > self.lr_width:
            lr *= self.lr_width / width
        return lr

    def with_anchor(self, weight: float) -> Objective:
        """This objective with its anchor term weighted ``weight`` (0: off, and no frozen source copy)."""
        return self._weighted("anchor", "anchor", weight)

    def with_window_anchor(self, weight: float) -> Objective:
        """This objective with its window anchor (the new positions held to the model's own reading through its old
        window) weighted ``weight`` (0: off)."""
        return self._weighted("window_anchor", "window anchor", weight)

    def window_anchor_for(self, unextended: torch.nn.Module, processor: Any, held_out: Any, old: int
                          ) -> tuple[float | None, str]:
        """The window anchor's weight for a run that extends and gives none, and a line saying why (empty: nothing
        to say): ``window_anchor`` by default. ``unextended``: the source at its own length; ``held_out``: the
        run's held-out samples; ``old``: the old length."""
        return self.window_anchor, ""

    def batch_size_for(self, old: int, new: int) -> int:
        """The micro-batch of a run that gives none, from its old and new length: :attr:`batch_size`, whatever
        the lengths."""
        return self.batch_size

    def _weighted(self, term: str, said: str, weight: float) -> Objective:
        """A copy with the weight of its term ``term`` (``said`` in messages) set to ``weight``, checked."""
        if getattr(self, term) is None:
            raise TrainingError(f"The {self.name} objective has no {said} term to weight; leave the {said} unset.")
        if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight >= 0):
            raise TrainingError(f"The {said} weight must be a finite number >= 0, got {weight!r}.")
        changed = copy.copy(self)
        setattr(changed, term, float(weight))
        return changed

    def documents(self, paths: Sequence[str | Path]) -> Sequence[Any]:
        """What :meth:`samples` cuts, read from the data the user gave (files, folders, or what this objective reads:
        a dataset of images): their texts by default (:func:`posextend.data.text.read_documents`)."""
        from posextend.data.text import read_documents

        return read_documents(paths)

    def for_data(self, documents: Sequence[Any]) -> Objective:
        """This objective for a run on ``documents`` (what :meth:`documents` read), before the model is loaded: a
        copy that knows what the data holds (an image objective: its classes, so that :meth:`load_model` gives the
        model a head for them), or itself (the default)."""
        return self

    def split(self, documents: Sequence[Any], *, processor: Any, length: int, config: Any) -> tuple[Sequence[Any], Sequence[Any]]:
        """``(train, held_out)``: the documents set aside for judging the run, never trained on
        (:func:`posextend.data.heldout.split_documents`): a few percent of the data, and enough for
        ``config.eval_sequences`` samples of ``length`` tokens at the data's characters per token."""
        from posextend.data.heldout import split_documents

        sample = next((d for d in documents if isinstance(d, str)), "")[:20_000]
        tokens = len(processor(sample, add_special_tokens=False, verbose=False)["input_ids"]) if sample else 0
        per_token = len(sample) / max(1, tokens) if sample else 4
        return split_documents(documents, least=int(1.1 * config.eval_sequences * length * per_token), seed=config.seed)

    def size_processor(self, processor: Any, sizes: Sizes) -> None:
        """Make the processor read inputs of the run's ``sizes``: a tokenizer's ``model_max_length``, the run's length
        (an image processor's size is the image objectives' to set)."""
        if hasattr(processor, "model_max_length"):
            processor.model_max_length = sizes.length.new

    def samples(self, tokenizer, documents: Sequence[str], length: int) -> torch.Tensor | Sequence[Any]:
        """What the loop takes micro-batches of: ``[n, length]`` token windows by default (documents joined with
        EOS/SEP and packed); an objective whose samples are items (images, pairs) returns a sequence of them."""
        from posextend.scoring.text import pack

        return pack(tokenizer, documents, length)

    def count(self, batch: torch.Tensor | Sequence[Any]) -> tuple[int, int]:
        """``(items, tokens)`` a micro-batch holds, as the run reports them: by default rows of token ids, the
        tokens being the ids >= 0 (samples of pairs pad with -1). An image's tokens are its patches."""
        return len(batch), int((batch >= 0).sum())

    def loss(self, run: RunContext, positions: range, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The micro-batch's mean loss on this process and the number of items it averages."""
        raise NotImplementedError

    def evaluate(self, run: RunContext) -> EvalReport:
        """The held-out samples (``run.eval_samples``) scored by position, as an :class:`EvalReport` whose
        ``metric`` is this objective's."""
        raise NotImplementedError

    def baseline(self, run: RunContext, unextended: torch.nn.Module) -> Reading | None:
        """The held-out data read without the extension (:class:`~posextend.scoring.verdict.Reading`): by
        ``unextended``, this objective's model of the source at its own length (``run.sizes.length.old``), as a user
        would read a long text with it (in its own windows, or in chunks). What the extension must beat; None:
        this objective names no baseline (no verdict then)."""
        return None

    def baseline_name(self, run: RunContext) -> str:
        """How :meth:`baseline` reads the text, as the verdict says it ("the source through its own window")."""
        return "the source model"

    def reading(self, run: RunContext) -> Reading | None:
        """The held-out data read by the model being trained (``run.model``), on the ranges :meth:`baseline`
        scores (None when it names no baseline)."""
        return None

    def control(self, run: RunContext) -> Reading | None:
        """The control: the model being trained (``run.model``) read as :meth:`baseline` reads the source, without
        its longer context (through its old window, or in chunks). It had the same training, so what the far range
        gains over it is the longer context's; the verdict asks the far range to beat it too. By default
        :meth:`baseline` given the trained model, which any objective that names a baseline has."""
        return self.baseline(run, run.model)

    def control_name(self, run: RunContext) -> str:
        """How :meth:`control` reads the text, as the verdict says it ("the same model through a 64-token window")."""
        return "the same model read as the source is"

    def context_use(self, run: RunContext) -> ContextUse | None:
        """Whether the model being read (``run.model``) uses its positions past ``run.sizes.length.old``: the probe of
        :mod:`posextend.scoring.context_use`, read on the run's held-out data. None: this objective reads no such
        probe (the default), or the run adds too few positions to hold it."""
        return None

    def written_config(self, run: RunContext) -> dict[str, Any]:
        """Fields of the written ``config.json`` (dotted for nested configs) that the run sets beyond its sizes: a new
        head's ``id2label`` and ``label2id``. None by default."""
        return {}

    def notes(self, run: RunContext) -> list[str]:
        """Lines about the run that the fine-tune's report, the CLI and the model card carry (none by default)."""
        return []

    @staticmethod
    def reference_kl(run: RunContext, inputs: torch.Tensor | Mapping[str, torch.Tensor], logits: torch.Tensor,
                  keep: torch.Tensor | None = None) -> torch.Tensor:
        """Mean KL divergence of ``logits`` (the model's, for the last ``logits.shape[1]`` tokens of
        ``inputs``: token ids, or the model's keyword inputs) from the frozen source's predictions
        (``run.reference``) reading ``inputs`` at its own positions, over the positions ``keep`` marks (all)."""
        reference = run.reference.to(run.accelerator.device)  # where the model trains (nothing moves once there)
        kwargs = dict(inputs) if isinstance(inputs, Mapping) else {"input_ids": inputs}
        with torch.no_grad():
            target = reference(**kwargs).logits[:, -logits.shape[1]:].float().log_softmax(-1)
        kl = torch.nn.functional.kl_div(logits.float().log_softmax(-1), target, log_target=True, reduction="none").sum(-1)
        return kl.mean() if keep is None else (kl * keep).sum() / keep.sum().clamp(min=1)


class LanguageModel(Objective):
    """A language model scored on held-out text by position (:func:`posextend.scoring.by_position.score_model`):
    ``scoring`` is ``causal`` (every next token) or ``masked`` (BERT-masked tokens)."""

    scoring: ClassVar[str]

    def evaluate(self, run: RunContext) -> EvalReport:
        from posextend.scoring.by_position import score_model

        report = score_model(run.model, run.eval_samples, self.scoring, tokenizer=run.tokenizer,
                             buckets=run.config.buckets, old_length=run.sizes.length.new_from,
                             batch_size=run.config.batch_size, seed=run.config.seed)
        return dataclasses.replace(report, metric=self.metric)

    def baseline(self, run: RunContext, unextended: torch.nn.Module) -> Reading | None:
        """The source reading each held-out sequence through a sliding window of its own length (stride half
        of it): each far token with at least half the old length of context, as the source reads a long text."""
        return self._reading(run, unextended.to(run.accelerator.device), window=run.sizes.length.old)

    def baseline_name(self, run: RunContext) -> str:
        return f"the source through its own {run.sizes.length.old}-token window"

    def control_name(self, run: RunContext) -> str:
        return f"the same model through a {run.sizes.length.old}-token window"

    def reading(self, run: RunContext) -> Reading | None:
        return self._reading(run, run.model, window=None)

    def _reading(self, run: RunContext, model: torch.nn.Module, *, window: int | None) -> Reading | None:
        from posextend.scoring.by_position import position_losses
        from posextend.scoring.verdict import Reading, far_start

        old, length = run.sizes.length.old, run.sizes.length.new
        if old >= length:
            return None
        total, count = position_losses(model, run.eval_samples, self.scoring, tokenizer=run.tokenizer, window=window,
                                       batch_size=run.config.batch_size, seed=run.config.seed, device=run.accelerator.device)
        start = far_start(length, old)
        far, original = (float(total[a:b].sum() / count[a:b].sum().clamp(min=1)) for a, b in ((start, length), (0, old)))
        return Reading(far=math.exp(min(far, 50)), original=math.exp(min(original, 50)), metric=self.metric)


_REGISTRY: Registry[Objective] = Registry("objective", "objectives", ENTRY_POINT_GROUP, TrainingError)


def register_objective(name: str, *, description: str | None = None) -> Callable[[type[Objective]], type[Objective]]:
    """Class decorator registering an :class:`Objective` under ``name``; refuses invalid or duplicate names.

    Args:
        name: the objective's name: lowercase letters, digits, ``-`` and ``_``, starting with a letter;
            a name already registered is refused.
        description: its help line (default: the class's ``description``, else the first line of its
            docstring).

    Returns:
        The class decorator; it returns the class, with ``name`` and ``description`` set.

    Raises:
        TrainingError: the name is invalid or taken, or the class is no :class:`Objective`.

    Examples:
        >>> @posextend.register_objective("my-masked", description="My masking.")
        ... class MyMasked(Objective):
        ...     ...
    """
    _REGISTRY.check_name(name)

    def decorator(cls: type[Objective]) -> type[Objective]:
        if not (isinstance(cls, type) and issubclass(cls, Objective)):
            raise TrainingError(f"Objective {name!r} must be a subclass of posextend.training.objectives.base.Objective.")
        _REGISTRY.check_name(name)
        cls.name = name
        cls.description = description or cls.description or (cls.__doc__ or "").strip().split("\n")[0]
        _REGISTRY.add(name, cls())
        return cls

    return decorator


def available_objectives() -> dict[str, Objective]:
    """All registered objectives (built-ins and plug-ins), by name.

    Examples:
        >>> sorted(posextend.available_objectives())
        ['causal', 'contrastive', 'masked', 'seq2seq']
    """
    return _REGISTRY.available()


def get_objective(name: str) -> Objective:
    """The registered objective ``name``; raises :class:`TrainingError` listing the valid ones."""
    return _REGISTRY.get(name)


def default_objective(checkpoint: str | Path | Checkpoint) -> str:
    """The objective the registry prefers for a checkpoint: of those that accept it (:meth:`Objective.accepts`),
    the one of the highest ``priority``. Built-ins: ``contrastive`` for a sentence-transformers folder, else
    the one whose head the family has (``seq2seq`` for encoder-decoders, ``masked``, ``causal``)."""
    facts = CheckpointFacts(checkpoint)
    for objective in sorted(available_objectives().values(), key=lambda o: -o.priority):
        if objective.accepts(facts):
            return objective.name
    raise TrainingError(
        "This family has no causal, masked or sequence-to-sequence language-model head; fine-tuning it is not "
        "supported yet. Resize it and train it with your own trainer."
    )


def draw_mates(run: RunContext, positions: range, mates: int) -> tuple[list[Any], list[torch.Generator]]:
    """``mates`` training samples more for each sample at ``positions``, drawn by that sample's generator (so that a
    run is the same on any number of processes): the drawn samples, in the samples' order, and each sample's
    generator for its other random choices."""
    pool, drawn, generators = run.train_samples, [], []
    for p in positions:
        g = run.generator(p)
        drawn += [pool[int(i)] for i in torch.randint(len(pool), (mates,), generator=g)]
        generators.append(g)
    return drawn, generators


def without_dropout(model: torch.nn.Module, *, attention_only: bool = False) -> int:
    """Zero ``model``'s dropout for this run (its config, and so the written model, keeps its values).

    Language models train without dropout, as if in eval mode (what every earlier posextend run
    did), but in training mode, so that gradient checkpointing applies. ``attention_only``: zero
    only attention-probability dropout (the contrastive objective keeps the rest), because with it
    PyTorch's fused attention falls back to its math kernel: on 2 CPU cores MiniLM at 2048 tokens
    took 38 s per forward pass of 4 documents instead of 3.4 s. Returns how many were zeroed.
    """
    zeroed = 0
    for module in model.modules():
        if attention_only and "attention" not in type(module).__name__.lower():
            continue
        for name, value in list(vars(module).items()) + list(module.named_children()):
            if "dropout" not in name.lower() and not isinstance(value, torch.nn.Dropout):
                continue
            if isinstance(value, torch.nn.Dropout) and value.p:
                value.p = 0.0
                zeroed += 1
            elif isinstance(value, float) and value and not attention_only:  # functional dropout (OPT, BART)
                setattr(module, name, 0.0)
                zeroed += 1
    return zeroed


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` in eval mode that never trains: the source an anchor term compares with."""
    return copy.deepcopy(model).eval().requires_grad_(False)
