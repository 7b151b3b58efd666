"""Checkpoint files: where a checkpoint's parts are, reading tensors by name, writing safetensors, atomic output.

Owns the on-disk formats and the operating system, one module per job: :mod:`.sources` (a
checkpoint's folder, config, sentence-transformers settings, tokenizer files, whether a destination
may be written), :mod:`.reader` (the lazy safetensors/legacy reader, tensors by name),
:mod:`.tensorfile` (the safetensors format: dtypes, headers, the streaming writer), :mod:`.copying`
(byte copies by the kernel), :mod:`.atomic` (output that appears whole or not at all: temporaries,
fsync, the rename) and :mod:`.oserrors` (operating-system errors as one-line messages). Never
instantiates a model. May import: ``posextend.errors``.
"""
