"""Fine-tune objectives, one file each, behind one registry (built-ins and entry-point plug-ins alike).

The plug-in API: a plug-in writes ``from posextend.training.objectives import Objective, register_objective``
(see :mod:`posextend.training.objectives.base`). Importing this package (or any module in it) registers
the built-ins: :mod:`posextend.training.objectives.causal`, :mod:`posextend.training.objectives.masked` and
:mod:`posextend.training.objectives.contrastive`; :mod:`posextend.training.objectives.seq2seq` is registered
through the ``posextend.objectives`` entry point, as a third-party objective is (so are ``vision`` and
``image-text``, on :class:`posextend.training.objectives.image.ImageObjective`, the base of an objective that reads
images; a dual encoder of another kind, CLAP's audio, takes the pair loss, R@1 and captions as token rows from
:mod:`posextend.training.objectives.dual_encoder`, and its batch-mates from ``draw_mates``: ``docs/guides/plugins.md``
lists what a plug-in imports). An objective sees a run only through
:class:`posextend.training.context.RunContext`; it imports nothing from the loop. May import: ``posextend.training.context``, ``posextend.training.options``,
``posextend.training.loading``, ``posextend.training.towers`` and every layer below
``posextend.training``.
"""

from posextend.training.context import RunContext
from posextend.training.objectives.base import (
    CheckpointFacts,
    Objective,
    available_objectives,
    default_objective,
    draw_mates,
    get_objective,
    register_objective,
)
from posextend.training.objectives.help import defaults_help, objectives_help
from posextend.training.objectives import causal, contrastive, masked  # noqa: F401  (they register the built-ins)

__all__ = ["CheckpointFacts", "Objective", "RunContext", "available_objectives", "default_objective", "draw_mates",
           "get_objective", "defaults_help", "objectives_help", "register_objective"]
