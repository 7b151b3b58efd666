"""Checkpoint files: where a checkpoint's parts are, reading tensors by name, writing safetensors, atomic output.

Owns the on-disk formats and the operating system: :mod:`.sources` (a checkpoint's folder, config,
sentence-transformers settings, tokenizer files, whether a destination may be written),
:mod:`.checkpoint` (``Checkpoint``: one checkpoint resolved once per command, its facts read once) and :mod:`.io`
(the lazy safetensors/legacy reader, streaming writer, byte copies and the atomic rename, and the
one-line messages of operating-system errors). Never instantiates a model. May import:
``posextend.errors``.
"""
