"""The resize: one plan, carried out in memory or on disk, reported and verified.

Owns :mod:`.options` (``ResizeOptions``, what ``resize_checkpoint`` and ``resize-model`` take),
:mod:`.plan` (what a resize changes, group by group), :mod:`.in_memory` (``extend_model`` on a
transformers model), :mod:`.on_disk` (``inspect_checkpoint``, ``resize_checkpoint``, its report, model
card and twin verification) and :mod:`.writer` (the one checkpoint writer, also used by the fine-tune's
save). May import: ``posextend.errors``, ``posextend.options``, ``posextend.version``, ``posextend.tables``, ``posextend.files``,
``posextend.families``.
"""
