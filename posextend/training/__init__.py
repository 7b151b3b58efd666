"""The fine-tune: options, loading, the shared loop, saving, held-out evaluation, and its objectives.

Owns :mod:`.options` (``FinetuneConfig``), :mod:`.context` (what an objective sees of a run),
:mod:`.loading` (the model an objective trains, its tokenizer, the frozen anchor), :mod:`.setup` (a run
set up: loaded, extended, its samples, optimizer and schedule), :mod:`.loop` (``finetune``: the shared
loop), :mod:`.report` (``FinetuneReport``, and the output with its provenance and model card),
:mod:`.saving` (the trained tensors written into the source's files by :mod:`posextend.resize.writer`),
:mod:`.evaluate` (``evaluate``, the ``eval`` command) and :mod:`.objectives` (one file per objective,
behind a registry). May import every layer below it: ``posextend.errors``, ``posextend.registry``,
``posextend.options``, ``posextend.version``, ``posextend.tables``,
``posextend.files``, ``posextend.data``, ``posextend.families``, ``posextend.resize``, ``posextend.scoring``.
"""
