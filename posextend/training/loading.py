"""Loading a checkpoint for training or evaluation: the model its objective needs, and its processor (a tokenizer,
an image processor, or both).

The checkpoint comes resolved (a :class:`~posextend.files.checkpoint.Checkpoint`); the functions here also
take its folder as a path, for callers that hold no checkpoint."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from posextend.files.checkpoint import Checkpoint
from posextend.files.sources import TOKENIZER_FILES
from posextend.errors import PosExtendError, SourceError, TrainingError
from posextend.families.lookup import all_specs, spec_for
from posextend.families.specs import ArchitectureSpec

if TYPE_CHECKING:
    from posextend.resize.plan import GroupPlan
    from posextend.training.saving import FileNames

log = logging.getLogger(__name__)


@dataclass
class Loaded:
    """A model ready to train: ``model`` trains; ``hf_model`` is the transformers model holding the
    table (the same object for language models, the first module of a sentence-transformers model);
    ``tables`` are named as in ``model``. ``processor``: what turns data into its inputs (a tokenizer, an image
    processor, or both). ``spec`` is the positions a fine-tune's length sizes (an image grid for a vision tower)."""

    model: torch.nn.Module
    hf_model: torch.nn.Module
    processor: Any
    spec: ArchitectureSpec
    objective: str
    usable: int
    reserved: int
    tables: tuple[str, ...]
    old_length: int | None  # from posextend provenance, when the checkpoint was extended by it
    reference: torch.nn.Module | None = None  # the frozen model the objective's anchor holds to (when it keeps one)
    decoder: Stack | None = None  # an encoder-decoder's decoder with a length of its own (LED); ``spec`` is the encoder's
    plans: list[GroupPlan] = field(default_factory=list)  # the resizes a fine-tune made, planned for the files, in order
    files: FileNames | None = None  # where the trained tensors sit in the checkpoint's files (set by a fine-tune)
    new_head: Callable[[], None] | None = None  # gives the model a head the objective made for the data (swap_head)

    @property
    def tokenizer(self) -> Any:
        """The processor of a text model: its tokenizer."""
        return self.processor

    def swap_head(self) -> None:
        """Give the model the head its objective made for the data (``new_head``: an image classifier's for the data's
        classes), once: a fine-tune calls it after ``files`` records where the old head's tensors sit in the checkpoint's
        files, so that the writer writes the new head, of another shape, under the old one's names (swapped before, those
        names would hold other values than the files: refused). A run that only reads the checkpoint keeps its head."""
        if self.new_head is not None:
            self.new_head, swap = None, self.new_head
            swap()


@dataclass(frozen=True)
class Stack:
    """A table group with a length of its own beside the run's: its spec, its tables (named as in the
    trained model), and its usable and reserved rows as loaded."""

    spec: ArchitectureSpec
    tables: tuple[str, ...]
    usable: int
    reserved: int


def load_tokenizer(directory: Path):
    import transformers

    advice = "save the tokenizer there (tokenizer.save_pretrained) so text can be tokenised."
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise SourceError(f"No usable tokenizer in {directory} (none of {', '.join(TOKENIZER_FILES)}); {advice}")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError, TypeError) as exc:
        raise SourceError(f"No usable tokenizer in {directory} ({str(exc).splitlines()[0]}); {advice}") from None
    if len(tokenizer) < 10:
        raise SourceError(f"No usable tokenizer in {directory} (its vocabulary has {len(tokenizer)} entries); {advice}")
    return tokenizer


def make_loaded(model: torch.nn.Module, hf_model: torch.nn.Module, processor, objective: str,
                directory: Path | Checkpoint) -> Loaded:
    """Locate the table(s) of ``hf_model`` (inside ``model``) and read the old length from provenance; ``processor``:
    the model's tokenizer, image processor, or both."""
    config = hf_model.config.to_dict()
    spec, decoder = stack_specs(config, type(hf_model))  # the loaded class's own names
    shapes = {n: tuple(p.shape) for n, p in hf_model.named_parameters()}
    prefix = next((f"{n}." for n, m in model.named_modules() if m is hf_model and n), "")
    encoder, decoder = (None if s is None else _stack(s, shapes, config, prefix) for s in (spec, decoder))
    old = Checkpoint.of(directory).provenance.get("posextend.old_length")
    return Loaded(model, hf_model, processor, spec, objective, encoder.usable, encoder.reserved, encoder.tables,
                  int(old) if old else None, decoder=decoder)


def image_grid(loaded: Loaded) -> Stack | None:
    """The image grid of the loaded model (its tables named as in ``loaded.model``): ``spec`` itself for a vision
    tower, the vision tower's beside a text length (CLIP), None for a model without one."""
    hf_model = loaded.hf_model
    config = hf_model.config.to_dict()
    spec = loaded.spec if loaded.spec.rank == 2 else next(
        (s for s in all_specs(config, cls=type(hf_model)) if s.rank == 2), None)
    if spec is None:
        return None
    shapes = {n: tuple(p.shape) for n, p in hf_model.named_parameters()}
    prefix = next((f"{n}." for n, m in loaded.model.named_modules() if m is hf_model and n), "")
    return _stack(spec, shapes, config, prefix)


def stack_specs(config: dict[str, Any], cls: type | None = None) -> tuple[ArchitectureSpec, ArchitectureSpec | None]:
    """The spec of the tables a fine-tune's length sizes, and the decoder's where an encoder-decoder has a
    length per stack (LED: the run's length is the encoder's; the decoder's is its own option)."""
    groups = {s.group: s for s in all_specs(config, cls=cls) if s.rank == 1}
    if set(groups) == {"encoder", "decoder"}:
        return groups["encoder"], groups["decoder"]
    return spec_for(config, cls=cls), None


def _stack(spec: ArchitectureSpec, shapes: dict[str, tuple[int, ...]], config: dict[str, Any], prefix: str) -> Stack:
    layout = spec.locate(shapes, config)
    return Stack(spec, tuple(prefix + t for t in layout.tables), layout.usable, layout.reserved)


def load_processor(directory: Path, kind: str = "image") -> Any:
    """The image processor (``kind="image"``: a vision tower's) or the processor of both text and images
    (``"both"``: a CLIP processor, tokenizer and image processor) saved in ``directory``; a one-line error when
    there is none."""
    import transformers

    auto = transformers.AutoImageProcessor if kind == "image" else transformers.AutoProcessor
    advice = "save it there (processor.save_pretrained) so images can be read."
    try:
        processor = auto.from_pretrained(directory)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise SourceError(f"No usable {'image ' if kind == 'image' else ''}processor in {directory} "
                          f"({str(exc).splitlines()[0]}); {advice}") from None
    if kind == "both" and not (hasattr(processor, "tokenizer") and hasattr(processor, "image_processor")):
        raise SourceError(f"The processor in {directory} ({type(processor).__name__}) does not read both text and "
                          f"images; {advice}")
    return processor


def load_headed_model(src: str | Path | Checkpoint, model_class: Any, head: str, objective: str, *,
                      init_head: bool = False, processor: Callable[[Path], Any] = load_tokenizer) -> Loaded:
    """The checkpoint loaded by ``model_class`` (a transformers auto class: the head objective ``objective``
    trains, called ``head`` in messages), and its processor (``processor(folder)``: its tokenizer by default). A
    checkpoint without that head is refused unless ``init_head`` asks for a fresh one."""
    checkpoint = Checkpoint.resolve(src)
    directory, model_dir = checkpoint.directory, checkpoint.model_dir  # an older ST folder: its 0_Transformer/
    tokenizer = processor(model_dir)
    model, info = model_class.from_pretrained(model_dir, output_loading_info=True,
                                              **attention_kwargs(model_class, checkpoint.config))
    missing = sorted(info["missing_keys"])
    if missing:
        if not init_head:
            raise TrainingError(
                f"{directory} has no {head} head ({len(missing)} missing weights, e.g. {missing[0]}); "
                f"pass init_head=True to train a freshly initialised one."
            )
        log.warning("Initialising a fresh %s head (%d weights, e.g. %s)", head, len(missing), missing[0])
    return make_loaded(model, model, tokenizer, objective, checkpoint)


def attention_kwargs(model_class: Any, config: dict[str, Any]) -> dict[str, str]:
    """``from_pretrained``'s keyword for PyTorch's fused attention (``torch.nn.functional.scaled_dot_product_attention``)
    where the class ``model_class`` loads for ``config`` (a checkpoint's ``config.json``) has it (transformers'
    ``_supports_sdpa``); else none, so transformers' default (its own attention) is used. ``model_class`` is a
    transformers model class or an auto class (the class it maps ``config``'s model type to)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = model_class
    if not hasattr(cls, "_supports_sdpa"):  # an auto class
        try:
            cls = model_class._model_mapping[CONFIG_MAPPING[config["model_type"]]]
        except (AttributeError, KeyError):  # no mapping for it: from_pretrained says why, or loads it its own way
            return {}
    return {"attn_implementation": "sdpa"} if getattr(cls, "_supports_sdpa", False) else {}


# ------------------------------------------------------------------------------ the anchor's reference


@dataclass(frozen=True)
class AnchorOriginal:
    """The model a fine-tune's anchor term holds outputs within the old length to.

    ``original``: the original model a checkpoint was extended from (loaded at its own length), and
    ``path`` its folder; None: the checkpoint as loaded, before this run extends it (the behaviour
    without provenance).
    ``note``: one line saying why the original is not used, when that matters; ``exact``: the
    checkpoint's old rows are the original's (a row-keeping strategy, never trained since), so
    holding to the checkpoint is holding to the original.
    """

    original: Checkpoint | None = None
    note: str | None = None
    exact: bool = False

    @property
    def path(self) -> Path | None:
        return None if self.original is None else self.original.directory


def unfit_original(checkpoint: Checkpoint, original: Checkpoint, old_length: int,
                   recorded: int | None = None) -> str | None:
    """Why ``original`` cannot be the anchor's reference for ``checkpoint`` (None: it can).

    It must hold a model of the same type whose table has ``recorded`` usable positions (the old
    length the checkpoint's provenance records), and at least the ``old_length`` the anchor reads.
    """
    from posextend.resize.inspection import inspect_checkpoint

    if original.directory == checkpoint.directory:
        return "is this checkpoint itself"
    try:
        mine = checkpoint.config.get("model_type")
        theirs = original.config.get("model_type")
        usable = inspect_checkpoint(original).usable
    except PosExtendError as exc:
        return f"cannot be read ({str(exc).splitlines()[0]})"
    if theirs != mine:
        return f"holds a {theirs} model, not {mine}"
    if recorded is not None and usable != recorded:
        return f"has {usable} positions, not the {recorded} the checkpoint was extended from"
    if usable < old_length:
        return f"has {usable} positions, fewer than the {old_length} the anchor reads"
    return None


def _keeps_rows(meta: dict[str, str]) -> bool:
    """The recorded strategy left the old rows bit-identical, and no fine-tune has touched them since."""
    from posextend.tables.strategies import available_strategies

    strategy = available_strategies().get(meta.get("posextend.strategy", ""))
    return bool(strategy and strategy.keeps_rows) and "posextend.finetune" not in meta


def find_original(checkpoint: Checkpoint, given: str | Path | None, *, old_length: int, length: int,
                  extended: bool) -> AnchorOriginal:
    """The anchor's reference for a fine-tune of ``checkpoint`` whose old range is ``old_length`` of
    ``length`` positions: ``given`` (checked; an unfit one is refused), else the original that the
    provenance records when it is there and fits, else the checkpoint as loaded, with a note
    when its old rows may differ from the original's. A run that extends the checkpoint itself
    (``extended``) holds to it as loaded: it is that extension's source."""
    directory = checkpoint.directory
    if given is not None:
        original = Checkpoint.resolve(given)
        problem = unfit_original(checkpoint, original, old_length)
        if problem:
            raise TrainingError(f"The anchor's source {original} {problem}: give the model {directory} was extended "
                                "from, or leave the anchor's source unset.")
        return AnchorOriginal(original)
    if extended or old_length >= length:
        return AnchorOriginal()
    meta = checkpoint.provenance
    if "posextend.source" not in meta:
        return AnchorOriginal(note=(
            f"Anchor: {directory} records no original model, so the anchor holds its first {old_length} positions "
            "to this checkpoint as given, whose rows there may already have moved; give the original as the "
            "anchor's source to hold to it."))
    return _recorded_original(checkpoint, meta, old_length)


def _recorded_original(checkpoint: Checkpoint, meta: dict[str, str], old_length: int) -> AnchorOriginal:
    """The original ``meta`` (the checkpoint's provenance) records, or the checkpoint with a note."""
    recorded, old, directory = meta["posextend.source"], meta.get("posextend.old_length"), checkpoint.directory
    try:
        original = Checkpoint.resolve(recorded, revision=meta.get("posextend.source_revision"))
        problem = unfit_original(checkpoint, original, old_length, int(old) if old else None)
    except SourceError:
        problem = "is missing"
    if problem is None:
        return AnchorOriginal(original)
    strategy = meta.get("posextend.strategy", "its strategy")
    head = (f"Anchor: the original model {recorded} that {directory.name} was extended from {problem}, "
            f"so the anchor holds to {directory.name} as given")
    if _keeps_rows(meta):
        return AnchorOriginal(note=f"{head}: exact, since {strategy} kept the original's first {old} rows.", exact=True)
    return AnchorOriginal(note=f"{head}, whose first {old or old_length} rows {strategy} moved; give the original as "
                             "the anchor's source to hold to it.")
