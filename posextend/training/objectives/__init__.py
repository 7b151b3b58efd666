"""Fine-tune objectives, one file each, behind one registry (built-ins and entry-point plug-ins alike).

An objective sees a run only through :class:`posextend.training.context.RunContext`; it imports nothing
from the loop. May import: ``posextend.training.context``, ``posextend.training.options``,
``posextend.training.loading`` and every layer below ``posextend.training``.
"""
