"""Scoring a model: loss and perplexity by position, long-document retrieval, what a table learned.

Owns :mod:`.text` (packing training and evaluation text into token windows), :mod:`.by_position` (perplexity
by position and its plots), :mod:`.retrieval` (LongEmbed's passkey and needle tasks) and
:mod:`.analysis` (similarity and rank of a table). Trains nothing. May import: ``posextend.errors``,
``posextend.tables``, ``posextend.files``, ``posextend.data``, ``posextend.families``, ``posextend.resize``.
"""
