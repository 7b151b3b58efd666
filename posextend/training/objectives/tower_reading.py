"""How the ``vision`` objective (:mod:`posextend.training.objectives.vision`) reads held-out images: at any size (the
processor sized, the pixels kept when they fit), by any model (the trained one, the source; at another size through
transformers' ``interpolate_pos_encoding`` or a copy resized in memory), into pooled embeddings and logits. A mix-in
of :class:`~posextend.training.objectives.vision.Vision`, as :mod:`~posextend.training.objectives.label_free` is;
its run state holds ``processors``, ``pixels``, ``labels`` and ``warned`` (:class:`~posextend.training.objectives.vision.Seen`)."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator
from typing import Any

import torch

from posextend.errors import PosExtendError
from posextend.scoring.by_position import evaluating
from posextend.training.context import RunContext
from posextend.training.towers.features import Features, features, forward
from posextend.training.towers.sizing import resized_copy, sized

log = logging.getLogger(__name__)

READ_BATCH = 32  # held-out images per forward pass when reading (no gradients)
CACHE_BYTES = 256 * 2**20  # held-out pixels kept per image size when they fit


class TowerReader:
    """Reading held-out images, mixed into the ``vision`` objective (see the module)."""

    def _grid(self, run: RunContext, size: tuple[int, int]) -> tuple[int, int]:
        _, (ph, pw) = run.spec.grid.sizes(run.unwrapped.config.to_dict())
        return size[0] // ph, size[1] // pw

    def _own_size(self, run: RunContext, model: torch.nn.Module) -> tuple[int, int]:
        return tuple(run.spec.grid.sizes(model.config.to_dict())[0])

    def _unextended_size(self, run: RunContext) -> tuple[int, int]:
        """The source's own size: what the baseline found the source to read (``posextend eval`` knows the
        checkpoint's size only), else the run's old size."""
        size = run.state.unextended_size or run.sizes.image.old
        return tuple(size)

    def _processor(self, run: RunContext, size: tuple[int, int]) -> Any:
        """The run's image processor making images of ``size``: itself at the run's size, else a copy (kept)."""
        state = run.state
        if size not in state.processors:
            state.processors[size] = sized(run.processor, tuple(size), old=run.sizes.image.new)
        return state.processors[size]

    def _pixels(self, run: RunContext, images: list[Any], size: tuple[int, int]) -> torch.Tensor:
        return self._processor(run, tuple(size))(images=images, return_tensors="pt")["pixel_values"]

    def _held(self, run: RunContext, size: tuple[int, int]) -> Iterator[torch.Tensor]:
        """The held-out images' pixels at ``size``, :data:`READ_BATCH` at a time (kept when they fit
        :data:`CACHE_BYTES`)."""
        state = run.state
        cached = state.pixels.get(size)
        if cached is not None:
            yield from cached.split(READ_BATCH)
            return
        held, kept = run.eval_samples, []
        for start in range(0, len(held), READ_BATCH):
            images = [held[i]["image"] for i in range(start, min(start + READ_BATCH, len(held)))]
            pixels = self._pixels(run, images, size)
            kept.append(pixels)
            yield pixels
        if sum(p.numel() * p.element_size() for p in kept) <= CACHE_BYTES:
            state.pixels[size] = torch.cat(kept)

    def _reader(self, run: RunContext, model: torch.nn.Module, unwrapped: torch.nn.Module, size: tuple[int, int]
                ) -> tuple[torch.nn.Module, dict[str, Any]] | None:
        """``model`` made to read images of ``size``: itself at its own size; with transformers'
        ``interpolate_pos_encoding`` where the family has it; else a copy with its grid resized in memory."""
        if self._own_size(run, unwrapped) == tuple(size):
            return model, {}
        if "interpolate_pos_encoding" in inspect.signature(unwrapped.forward).parameters:
            return model, {"interpolate_pos_encoding": True}
        try:
            return resized_copy(unwrapped, tuple(size), run.config.strategy, run.config.seed), {}
        except PosExtendError as exc:
            if "resize" not in run.state.warned:
                run.state.warned.add("resize")
                log.warning("Cannot read the model at %dx%d px (%s): that reading is left out", *size, exc)
            return None

    @torch.no_grad()
    def _read(self, run: RunContext, model: torch.nn.Module, unwrapped: torch.nn.Module, size: tuple[int, int]
              ) -> Features | None:
        """The held-out images read by ``model`` at ``size``: their pooled embeddings and logits (on the CPU)."""
        reader = self._reader(run, model, unwrapped, tuple(size))
        if reader is None:
            return None
        module, kwargs = reader
        pooled, logits, grid = [], [], self._grid(run, size)
        device = run.accelerator.device
        with evaluating(module):
            for pixels in self._held(run, tuple(size)):
                out, base = forward(module, unwrapped if module is model else module, pixels.to(device), **kwargs)
                found = features(out, base, grid, len(pixels))
                pooled.append(found.pooled.cpu())
                logits.append(None if found.logits is None else found.logits.float().cpu())
        joined = None if any(x is None for x in logits) else torch.cat(logits)
        return Features(torch.cat(pooled), None, joined)

    def _labelled(self, run: RunContext) -> bool:
        """The held-out images all have labels, of two classes or more."""
        if run.state.labels is None:
            held = run.eval_samples
            column = getattr(held, "dataset", None)
            labels = (column["label"][:] if column is not None and "label" in column.column_names
                      else [held[i]["label"] for i in range(len(held))])
            run.state.labels = [None if y is None or y < 0 else int(y) for y in labels]
        labels = run.state.labels
        return bool(labels) and None not in labels and len(set(labels)) > 1

    def _between(self, run: RunContext, old: tuple[int, int], new: tuple[int, int]) -> tuple[int, int]:
        """The size half-way from ``old`` to ``new``, in whole patches (the evaluation's middle row)."""
        _, (ph, pw) = run.spec.grid.sizes(run.unwrapped.config.to_dict())
        return (round((old[0] + new[0]) / 2 / ph) * ph, round((old[1] + new[1]) / 2 / pw) * pw)
