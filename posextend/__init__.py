"""posextend: give checkpoints with learned absolute position tables a longer context.

The public API is imported lazily so that ``posextend --help`` stays fast.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from .errors import *  # noqa: F403  (small, dependency-free)
from .errors import PosExtendError
from .version import __version__

_LAZY = {
    "extend_model": "resize.in_memory",
    "resize_checkpoint": "resize.on_disk",
    "inspect_checkpoint": "resize.inspection",
    "ResizeReport": "resize.report",
    "CheckpointInfo": "resize.inspection",
    "register_strategy": "tables.strategies",
    "available_strategies": "tables.strategies",
    "get_strategy": "tables.strategies",
    "resize_table": "tables.strategies",
    "resize_grid": "tables.strategies",
    "finetune": "training.loop",
    "FinetuneReport": "training.report",
    "FinetuneConfig": "training.options",
    "evaluate": "training.evaluate",
    "EvalReport": "scoring.by_position",
    "context_use": "scoring.context_use",
    "ContextUse": "scoring.context_use",
    "ArchitectureSpec": "families.specs",
    "SPECS": "families.catalogue",
    "GRID_SPECS": "families.catalogue",
    "spec_for": "families.lookup",
    "all_specs": "families.lookup",
    "register_objective": "training.objectives",
    "available_objectives": "training.objectives",
    "evaluate_retrieval": "scoring.retrieval",
}

__all__ = ["PosExtendError", "__version__", *_LAZY]

if TYPE_CHECKING:
    from .resize.inspection import CheckpointInfo, inspect_checkpoint
    from .resize.on_disk import resize_checkpoint
    from .resize.report import ResizeReport
    from .scoring.by_position import EvalReport
    from .scoring.context_use import ContextUse, context_use
    from .training.evaluate import evaluate
    from .families.lookup import all_specs, spec_for
    from .training.objectives import available_objectives, register_objective
    from .scoring.retrieval import evaluate_retrieval
    from .resize.in_memory import extend_model
    from .training.options import FinetuneConfig
    from .families.catalogue import GRID_SPECS, SPECS
    from .families.specs import ArchitectureSpec
    from .tables.strategies import available_strategies, get_strategy, register_strategy, resize_grid, resize_table
    from .training.loop import finetune
    from .training.report import FinetuneReport


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'posextend' has no attribute {name!r}")
