"""An image classifier's classes by name: the model's class id of each of the data's classes (:func:`label_map`), and a
new head for them (:func:`replace_head`), which the fine-tune gives the model once it has observed the checkpoint's
files (:meth:`posextend.training.loading.Loaded.swap_head`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from posextend.errors import TrainingError

NEW_HEAD = "_posextend_new_head"  # set on a model (and so on its copies) whose head was made for the data's classes


def label_map(names: Sequence[str] | None, config: Any) -> list[int] | None:
    """The model's class id of each of ``names`` (the data's classes), matched by name in ``config.id2label``
    (case, ``_`` and ``-`` aside; a label's comma-separated aliases count: ``"tench, Tinca tinca"``); None when
    one of them is not there, or two share an id."""
    if not names:
        return None
    own: dict[str, int] = {}
    for i, label in sorted((int(k), v) for k, v in (getattr(config, "id2label", None) or {}).items()):
        for alias in str(label).split(","):
            own.setdefault(_plain(alias), i)
    ids = [own.get(_plain(n)) for n in names]
    return None if None in ids or len(set(ids)) < len(ids) else ids  # type: ignore[return-value]


def _plain(name: str) -> str:
    return " ".join(str(name).lower().replace("_", " ").replace("-", " ").split())


def replace_head(model: torch.nn.Module, names: Sequence[str]) -> list[str]:
    """Give an image classifier a head for ``names`` in place: each linear layer outside its base model that has one
    output per class (DeiT's two) becomes a new one with one per name, initialised as the family initialises it; the
    config's labels follow. Returns the layers replaced."""
    base = getattr(model, "base_model", model)
    old = model.config.num_labels
    replaced = []
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear) and module.out_features == old and not _inside(base, model, name):
            new = torch.nn.Linear(module.in_features, len(names), bias=module.bias is not None)
            model._init_weights(new)
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, new)
            replaced.append(name)
    if not replaced:
        raise TrainingError(f"{type(model).__name__} has no linear head of {old} classes to replace.")
    model.config.id2label = dict(enumerate(names))
    model.config.label2id = {n: i for i, n in enumerate(names)}
    if hasattr(model, "num_labels"):
        model.num_labels = len(names)
    return replaced


def _inside(base: torch.nn.Module, model: torch.nn.Module, name: str) -> bool:
    prefix = next((n for n, m in model.named_modules() if m is base and n), None)
    return prefix is not None and (name == prefix or name.startswith(prefix + "."))
