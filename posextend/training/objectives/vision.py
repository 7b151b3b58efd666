"""The ``vision`` objective: a vision tower (ViT, DeiT, DINOv2, CLIP / SigLIP vision …) at a new resolution
(``posextend finetune SRC DST --data FOLDER --image-size N``).

- **Supervised** when the images have labels (class folders) and the family has an image-classification head:
  cross-entropy on the head. The data's class names map to the checkpoint's ``id2label`` by name (a label's
  comma-separated aliases count); only when they differ, or the checkpoint has no head, does the model get a new
  head for the data's classes, and the run says so.
- **Label-free** otherwise (:mod:`posextend.training.objectives.label_free`): the source, frozen, is the teacher at its
  own size. It trains its whole budget.

Judged on held-out images: the head's accuracy where it knows their classes, else the k-nearest-neighbour accuracy
of the pooled embeddings (each held-out image against the others). The baseline is the source reading them at its
own resolution; the control, the trained model reading them there too (what the new resolution itself adds). Held-out
images without labels are labelled by the teacher (the source's head at its own size), and read as the share the model
predicts as it does: the baseline is then the source at the new size untrained (see the label-free module).

One file, registered through the ``posextend.objectives`` entry point, as a third-party objective is.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from posextend.errors import DataError, PosExtendError, TrainingError
from posextend.files.checkpoint import Checkpoint
from posextend.scoring.by_position import Bucket, EvalReport
from posextend.scoring.verdict import Reading
from posextend.training.context import RunContext
from posextend.training.loading import Loaded, attention_kwargs, load_processor, make_loaded
from posextend.training.objectives.base import CheckpointFacts, register_objective, without_dropout
from posextend.training.objectives.image import ImageObjective
from posextend.training.objectives.label_free import TEACHER, LabelFree
from posextend.training.objectives.tower_reading import TowerReader
from posextend.training.towers.features import Features, divergence, features, forward
from posextend.training.towers.heads import NEW_HEAD, label_map, replace_head
from posextend.training.towers.metrics import agreement, knn_accuracy

log = logging.getLogger(__name__)

ACCURACY, KNN, AGREEMENT = "accuracy", "k-NN accuracy", "embedding agreement"


@dataclass
class Seen:
    """What one run found once: processors by image size, held-out pixels and labels, the source's own size, the
    trained model's reading at the source's size (its control), keyed by the parameters' versions."""

    processors: dict[tuple[int, int], Any] = field(default_factory=dict)
    pixels: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    labels: list[int | None] | None = None
    unextended_size: tuple[int, int] | None = None
    unextended_pooled: torch.Tensor | None = None  # the source's held-out embeddings, for the agreement
    teacher: torch.Tensor | None = None  # the teacher's labels of unlabelled held-out images (its head's argmax)
    at_old: tuple[Any, float | None] | None = None
    baseline_metric: str = ACCURACY  # how the baseline read the source: its head, the k-NN, or the teacher's labels
    warned: set[str] = field(default_factory=set)


@register_objective(
    "vision",
    description="Vision towers at a new image size: supervised on class folders (the classifier's "
                "head, cross-entropy), label-free otherwise (the source at its own size as the teacher); judged by "
                "held-out accuracy against the source at its own size.",
)
class Vision(LabelFree, TowerReader, ImageObjective):
    data = ("a folder of images (a subfolder per class; flat without labels), a table of image paths (.csv, .jsonl), a "
            "saved dataset or a Hub dataset id")
    """A vision tower at a new resolution; see the module."""

    model_class = "AutoModelForImageClassification"
    head = "image-classification"
    metric = ACCURACY
    priority = 35  # a vision tower: no other built-in trains one
    State = Seen
    eval_sequences = 256  # held-out images each check reads
    extension, whole = "the larger image", "at the new size"  # its verdict's words
    steps = 300  # without a verdict (no labels, no head to label them): the steps trained when no budget is given
    # what benchmarks/vision.py reads with them (a 2-layer, 128-wide ViT, 16 -> 32 px): docs/reference/benchmarks.md
    lr = {"new-rows": 1e-3, "positions": 1e-3, "all": 1e-4, "lora": 1e-3}
    schedule = {"new-rows": "constant", "positions": "constant", "all": "cosine", "lora": "cosine"}
    # bicubic reproduces transformers' run-time interpolate_pos_encoding (the family's antialias follows its spec)
    strategy = {"new-rows": "bicubic", "positions": "bicubic", "all": "bicubic", "lora": "bicubic"}
    anchor = 0.0  # supervised: the weight of a KL term to the source's head at its own size (label-free: 1 unless set)
    classes: list[str] | None = None  # the data's class names (for_data); None: images without labels
    shift = 0.1  # label-free: how far (a share of the side) each image the model reads moves, at most
    mates = 0  # label-free: images more per sample, drawn by its generator (7: a micro-batch of 4 reads 32)

    def accepts(self, checkpoint: CheckpointFacts) -> bool:
        """A vision tower: a model whose positions are one image grid sized by its own config's image size (not a
        vision-language model's tower, nor a sentence-transformers folder), saved as a base model or an image
        classifier (not a detector's or a segmenter's head: name the objective to train one)."""
        if checkpoint.sentence_transformer:
            return False
        try:
            spec = checkpoint.spec
        except PosExtendError:
            return False
        config = checkpoint.config
        named = (config.get("architectures") or ["Model"])[0]
        return (spec.rank == 2 and spec.grid is not None and "." not in spec.grid.image_key
                and "text_config" not in config and "vision_config" not in config
                and (named.endswith(("Model", "Transformer")) or "ForImageClassification" in named))

    def for_data(self, documents: Sequence[Any]) -> Vision:
        """A copy that knows the data's classes (its label names), or that it has none: label-free, the source kept
        frozen as the teacher (an anchor the user set to 0 is refused then)."""
        if not hasattr(documents, "has_labels"):
            raise DataError("The vision objective reads images: give a folder of them (a subfolder per class), or a "
                            "table or dataset of images.")
        fitted = super().for_data(documents)
        fitted.classes = list(documents.label_names) if documents.has_labels and documents.label_names else None
        if fitted.classes is None:
            fitted._label_free()
        return fitted

    def load_model(self, directory: Path, *, init_head: bool) -> Loaded:
        """Supervised: the family's image classifier, its head mapped to the data's classes by name, or a new one
        for them. Label-free: the model as the checkpoint holds it (its head included)."""
        checkpoint = Checkpoint.of(directory)
        classifier = self.classes is not None and self._has_classifier(checkpoint.config)
        if self.classes is not None and not classifier:
            log.info("%s has no image-classification head: training label-free (the source as the teacher), judged "
                     "by the k-NN accuracy of its embeddings", checkpoint.config.get("model_type"))
            self._label_free()
        result = self._classifier(checkpoint) if classifier else self._as_held(checkpoint)
        without_dropout(result.model)
        return result

    def _has_classifier(self, config: dict[str, Any]) -> bool:
        from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES

        return config.get("model_type") in MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES

    def _classifier(self, checkpoint: Checkpoint) -> Loaded:
        """The family's image classifier as the checkpoint holds it; when it has no head, or its classes are not the
        data's, one for the data's classes (``new_head``), which a fine-tune gives it once it has observed the
        checkpoint's files (:meth:`~posextend.training.loading.Loaded.swap_head`): a run that only reads the checkpoint
        (``posextend eval``) keeps the checkpoint's head."""
        import transformers

        cls, names = transformers.AutoModelForImageClassification, list(self.classes or [])
        model, info = cls.from_pretrained(checkpoint.model_dir, output_loading_info=True,
                                          **attention_kwargs(cls, checkpoint.config))
        result = make_loaded(model, model, load_processor(checkpoint.model_dir, "image"), self.name, checkpoint)
        if not info["missing_keys"] and label_map(names, model.config) is not None:
            return result
        own = ", ".join(map(str, list(model.config.id2label.values())[:4]))
        why = ("the checkpoint has none" if info["missing_keys"] else f"the checkpoint's are {own}"
               + (" …" if len(model.config.id2label) > 4 else ""))
        shown = ", ".join(names[:6]) + (" …" if len(names) > 6 else "")

        def swap() -> None:
            replace_head(model, names)
            setattr(model, NEW_HEAD, f"a new head for the data's {len(names)} classes ({shown}; {why})")
            log.warning("Training %s", getattr(model, NEW_HEAD))

        result.new_head = swap
        return result

    def _as_held(self, checkpoint: Checkpoint) -> Loaded:
        """The class the checkpoint's ``architectures`` names when it loads every weight from the files, else the
        base model (a bare file under a headed class's name)."""
        import transformers

        config = checkpoint.config
        named = getattr(transformers, (config.get("architectures") or [""])[0], None)
        for cls in ([named] if isinstance(named, type) else []) + [transformers.AutoModel]:
            model, info = cls.from_pretrained(checkpoint.model_dir, output_loading_info=True,
                                              **attention_kwargs(cls, config))
            if not info["missing_keys"] or cls is transformers.AutoModel:
                break
        return make_loaded(model, model, load_processor(checkpoint.model_dir, "image"), self.name, checkpoint)

    def loss(self, run: RunContext, positions: range, batch: Sequence[Any]) -> tuple[torch.Tensor, int]:
        """Supervised: cross-entropy of the head at the run's size (plus ``anchor`` × the KL divergence from the
        source's head at its own size). Label-free: :meth:`_distilled`."""
        images = [item["image"] for item in batch]
        ids = self._train_ids(run)
        if ids is None:
            return self._distilled(run, positions, images), len(batch)
        pixels = self._pixels(run, images, run.sizes.image.new).to(run.accelerator.device)
        out, base = forward(run.model, run.unwrapped, pixels)
        student = features(out, base, self._grid(run, run.sizes.image.new), len(images))
        labels = torch.tensor([-100 if it["label"] is None else ids[it["label"]] for it in batch], device=pixels.device)
        loss = F.cross_entropy(student.logits.float(), labels, ignore_index=-100) if (labels >= 0).any() else \
            student.logits.sum() * 0.0
        if run.reference is not None:  # the anchor: the head's outputs held to the source's at its own size
            loss = loss + self.anchor * divergence(student.logits, self._teacher(run, images).logits)
        return loss, len(batch)

    def _train_ids(self, run: RunContext) -> list[int] | None:
        """The model's class id of each of the data's classes (supervised), or None (label-free: the source as the
        teacher, which must be there). Checked once: a new head trains; an anchor has the source's head to hold to."""
        ids = label_map(self.classes, run.unwrapped.config) if self.classes else None
        if "checked" in run.state.warned:
            return ids
        run.state.warned.add("checked")
        if ids is None and run.reference is None:
            raise TrainingError("Label-free training needs the source model as its teacher: leave the anchor unset.")
        if ids is not None and run.reference is not None and label_map(self.classes, run.reference.config) is None:
            raise TrainingError("The anchor holds the head's outputs to the source's, which has no head for these "
                                "classes: leave the anchor unset.")
        if ids is not None and getattr(run.unwrapped, NEW_HEAD, None) and not any(
                p.requires_grad for n, p in run.unwrapped.named_parameters() if "classifier" in n):
            raise TrainingError("The new head for the data's classes would not train with only the positions: train "
                                "every parameter or lora.")
        return ids

    # ------------------------------------------------------------------ scoring held-out readings (tower_reading reads them)

    def _names(self, run: RunContext) -> list[str] | None:
        """The held-out images' class names (their own data's, for held-out images given apart)."""
        return getattr(run.eval_samples, "label_names", None) or self.classes

    def _score(self, run: RunContext, read: Features, config: Any, *, head: bool = True) -> tuple[str, float, float]:
        """``(metric, score, loss)`` of a reading: the head's accuracy (and cross-entropy) where it knows the
        held-out classes (and ``head``), else the k-NN accuracy; without labels, the share read as the teacher
        labels them (a source with a head), else how closely the embeddings find the source's at its own size."""
        if not self._labelled(run):
            if run.state.teacher is not None and read.logits is not None:
                return self._agreed(run, read)
            if run.state.unextended_pooled is None:
                raise DataError("Scoring a vision model needs labelled held-out images (a subfolder per class), or "
                                "a fine-tune's source to compare with.")
            agreed = agreement(read.pooled, run.state.unextended_pooled)
            return AGREEMENT, agreed, 1 - agreed
        labels, ids = run.state.labels, label_map(self._names(run), config) if head else None
        if ids is not None and read.logits is not None:
            target = torch.tensor([ids[y] for y in labels])
            loss = float(F.cross_entropy(read.logits, target))
            return ACCURACY, float((read.logits.argmax(1) == target).float().mean()), loss
        accuracy = knn_accuracy(read.pooled, labels)
        return KNN, accuracy, 1 - accuracy

    def _metric(self, run: RunContext) -> str:
        """What the verdict's readings are: the accuracy on the held-out labels, or on the teacher's."""
        return ACCURACY if run.state.teacher is None else TEACHER

    def _judged(self, run: RunContext) -> bool:
        """The held-out images have labels (:meth:`_labelled`), or the teacher's."""
        return self._labelled(run) or run.state.teacher is not None

    def _accuracy(self, run: RunContext, model: torch.nn.Module, unwrapped: torch.nn.Module,
                  size: tuple[int, int]) -> float | None:
        read = self._read(run, model, unwrapped, size)
        return None if read is None else self._score(run, read, unwrapped.config)[1]

    def _at_old(self, run: RunContext) -> float | None:
        """The trained model's accuracy at the source's size (its control), read once per state of its weights: the
        last check and the verdict read the same ones (known by a few of each trained tensor's values: a fused
        optimizer step leaves the tensors' version counters as they were)."""
        key = torch.cat([p.detach().flatten()[:8].float().cpu() for p in run.unwrapped.parameters() if p.requires_grad])
        if run.state.at_old is None or not torch.equal(run.state.at_old[0], key):
            run.state.at_old = (key, self._accuracy(run, run.model, run.unwrapped, self._unextended_size(run)))
        return run.state.at_old[1]

    # ------------------------------------------------------------------ the verdict and the report

    def baseline(self, run: RunContext, unextended: torch.nn.Module) -> Reading | None:
        """The source reading the held-out images at its own size: the accuracy of its head where it knows their
        classes (not a head made for them), else the k-NN accuracy of its embeddings. Without labels, the source
        read at the run's size untrained against its own labels at its own size (:meth:`_teacher_baseline`)."""
        unextended = unextended.to(run.accelerator.device)
        state: Seen = run.state
        state.unextended_size = self._own_size(run, unextended)
        read = self._read(run, unextended, unextended, state.unextended_size)
        state.unextended_pooled = read.pooled
        if not self._labelled(run):
            return self._teacher_baseline(run, unextended, read)
        own_head = not getattr(unextended, NEW_HEAD, None)  # a head made for the data's classes has learned nothing yet
        state.baseline_metric, accuracy, _ = self._score(run, read, unextended.config, head=own_head)
        return Reading(far=accuracy, original=math.nan, metric=ACCURACY, higher=True)  # one size read: no old range

    def baseline_name(self, run: RunContext) -> str:
        if run.state.baseline_metric == TEACHER:
            return self._teacher_baseline_name(run)
        h, w = self._unextended_size(run)
        knn = " (the k-NN accuracy of its embeddings)" if run.state.baseline_metric == KNN else ""
        return f"the source at its own {h}x{w} px{knn}"

    def reading(self, run: RunContext) -> Reading | None:
        """The trained model's held-out accuracy at the run's size (``far``). No original range: the model is read at
        its new size, so its accuracy at the source's is its control (what the new size adds), not a range to keep."""
        if run.sizes.image.new == self._unextended_size(run) or not self._judged(run):
            return None
        far = self._accuracy(run, run.model, run.unwrapped, run.sizes.image.new)
        return None if far is None else Reading(far=far, original=math.nan, metric=self._metric(run), higher=True)

    def control(self, run: RunContext) -> Reading | None:
        """The same trained model reading the held-out images at the source's size: what the new size itself adds."""
        if run.sizes.image.new == self._unextended_size(run) or not self._judged(run):
            return None
        accuracy = self._at_old(run)
        return None if accuracy is None else Reading(far=accuracy, original=accuracy, metric=self._metric(run),
                                                     higher=True)

    def control_name(self, run: RunContext) -> str:
        h, w = self._unextended_size(run)
        return f"the same model at {h}x{w} px"

    @torch.no_grad()
    def evaluate(self, run: RunContext) -> EvalReport:
        """The held-out images read at the source's size, half-way and the run's size: a row each (``start``: the
        height in pixels), the run's size overall; accuracy (or agreement) and its loss."""
        old, new = self._unextended_size(run), run.sizes.image.new
        if run.state.unextended_pooled is None and run.reference is not None:
            self.baseline(run, run.reference)
        between = self._between(run, old, new)
        buckets, metric, last = [], ACCURACY, (math.nan, math.nan)
        for size in sorted({old, between, new}):
            try:
                read = self._read(run, run.model, run.unwrapped, size)
            except (RuntimeError, ValueError) as exc:  # a size between that the family cannot read (a pixel shuffle's)
                if size != between:
                    raise
                log.info("The model cannot read %dx%d px (%s): that row is left out", *size, str(exc).splitlines()[0])
                read = None
            if read is None:
                continue
            metric, score, loss = self._score(run, read, run.unwrapped.config)
            buckets.append(Bucket(size[0], size[0] + 1, loss, math.exp(min(loss, 50)), len(run.eval_samples), score))
            last = (score, loss) if size == new else last
        score, loss = last
        return EvalReport(self.name, new[0], len(run.eval_samples), loss, math.exp(min(loss, 50)), len(run.eval_samples),
                          buckets, None, accuracy=score, metric=metric, axis="px", noun="images", unit="images")

    def written_config(self, run: RunContext) -> dict[str, Any]:
        """Supervised: the head's classes, ``id2label`` and ``label2id`` (a new head's; the same values otherwise)."""
        config = run.unwrapped.config
        if not (self.classes and label_map(self.classes, config) is not None):
            return {}
        return {"id2label": {str(i): n for i, n in config.id2label.items()},
                "label2id": {n: int(i) for i, n in config.id2label.items()}}

    def notes(self, run: RunContext) -> list[str]:
        """How the run trained: supervised (on the head's own classes, or a new head), or label-free."""
        if self.classes and label_map(self.classes, run.unwrapped.config) is not None:
            head = getattr(run.unwrapped, NEW_HEAD, None) or "the head's own"
            return [f"vision: supervised on {len(self.classes)} classes, {head}"]
        return self._free_notes(run, self._labelled(run))
