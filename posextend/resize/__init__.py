"""The resize: one plan, carried out in memory or on disk, reported and verified.

Owns :mod:`.options` (``ResizeOptions``, what ``resize_checkpoint`` and ``resize-model`` take),
:mod:`.plan` (what a resize changes, group by group), :mod:`.in_memory` (``extend_model`` on a
transformers model), :mod:`.inspection` (``inspect_checkpoint``: what a checkpoint on disk holds),
:mod:`.on_disk` (``resize_checkpoint`` and its twin verification), :mod:`.report` (``ResizeReport`` and
the model card) and :mod:`.writer` (the one checkpoint writer, also used by the fine-tune's save). May
import: ``posextend.errors``, ``posextend.options``, ``posextend.version``, ``posextend.tables``,
``posextend.files``, ``posextend.families``.
"""
