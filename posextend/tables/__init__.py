"""Position tables as tensors: the strategies that give a table a new size, and a learned position module.

Owns the pure maths of a resize (:mod:`.strategies`: a table's usable rows in, the new rows out, and
their registry; :mod:`.relative`: SAM's relative-position tables, as the family resamples them) and :mod:`.nn`
(a learned position embedding for your own models). Knows nothing of checkpoints, files or model families.
May import: ``posextend.errors``, ``posextend.registry``.
"""
