"""posextend: give checkpoints with learned absolute position tables a longer context.

The public API is imported lazily so that ``posextend --help`` stays fast.
"""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from .errors import *  # noqa: F403  (small, dependency-free)
from .errors import PosExtendError

try:
    __version__ = version("posextend")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0+local"

_LAZY = {
    "extend_model": "model",
    "resize_checkpoint": "checkpoint",
    "inspect_checkpoint": "checkpoint",
    "ResizeReport": "checkpoint",
    "CheckpointInfo": "checkpoint",
    "register_strategy": "strategies",
    "available_strategies": "strategies",
    "get_strategy": "strategies",
    "resize_table": "strategies",
    "resize_grid": "strategies",
    "finetune": "training",
    "FinetuneReport": "training",
    "FinetuneConfig": "options",
    "evaluate": "heldout",
    "EvalReport": "evaluation",
    "ArchitectureSpec": "specs",
    "SPECS": "specs",
    "GRID_SPECS": "specs",
    "spec_for": "lookup",
    "all_specs": "lookup",
    "register_objective": "objectives",
    "available_objectives": "objectives",
    "evaluate_retrieval": "retrieval",
}

__all__ = ["PosExtendError", "__version__", *_LAZY]

if TYPE_CHECKING:
    from .checkpoint import CheckpointInfo, ResizeReport, inspect_checkpoint, resize_checkpoint
    from .evaluation import EvalReport
    from .heldout import evaluate
    from .lookup import all_specs, spec_for
    from .objectives import available_objectives, register_objective
    from .retrieval import evaluate_retrieval
    from .model import extend_model
    from .options import FinetuneConfig
    from .specs import GRID_SPECS, SPECS, ArchitectureSpec
    from .strategies import available_strategies, get_strategy, register_strategy, resize_grid, resize_table
    from .training import FinetuneReport, finetune


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'posextend' has no attribute {name!r}")
