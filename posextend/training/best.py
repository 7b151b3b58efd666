"""The best check's weights: what a budgeted run writes (:class:`BestWeights`).

A run's held-out reading moves from check to check (a check reads a few sequences, and the lr is still high when a
budget stops the run): the last step is rarely the best one. 0.508 at its best check, 0.48 at its last, in a
10-minute label-free vision run. :class:`BestWeights` keeps a copy of what trains at each better check, on the CPU,
or on disk in the run's state folder when the copy would not fit in half the memory free, and puts it back once the
run ends.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def _free_memory() -> int | None:
    """The machine's memory free now, in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


class BestWeights:
    """A copy of ``model``'s trainable parameters (those with ``requires_grad``, by name) taken with :meth:`take`
    and put back with :meth:`restore`. ``folder``: where the copy goes when it would take over half the memory
    free (as ``best.pt``)."""

    def __init__(self, model: torch.nn.Module, folder: Path):
        self.model, self.folder, self.step = model, folder, None
        self._copy: dict[str, torch.Tensor] | None = None

    def _trained(self) -> dict[str, torch.Tensor]:
        return {name: p for name, p in self.model.named_parameters() if p.requires_grad}

    def take(self, step: int) -> None:
        """Keep the trainable parameters as they are after ``step``."""
        params = self._trained()
        with torch.no_grad():
            copy = {name: p.detach().to("cpu", copy=True) for name, p in params.items()}
        size, free = sum(t.numel() * t.element_size() for t in copy.values()), _free_memory()
        if free is not None and size > free / 2:
            from posextend.files.oserrors import output_errors

            with output_errors(self.folder):  # a full or read-only disk: one line, as the run's other state
                self.folder.mkdir(parents=True, exist_ok=True)
                torch.save(copy, self.folder / "best.pt")
            copy = None
        self._copy, self.step = copy, step

    def restore(self) -> None:
        """Put the kept parameters back (in place: the optimizer and any wrapper keep theirs)."""
        if self.step is None:
            return
        copy = self._copy if self._copy is not None else torch.load(self.folder / "best.pt", weights_only=True)
        with torch.no_grad():
            for name, p in self._trained().items():
                p.copy_(copy[name].to(p.device))
        log.info("Restored the weights of the best check (step %d)", self.step)
