"""Model families: where each keeps its positions, written as specs or observed on tiny twins.

Owns :mod:`.specs` (the spec types and the catalogue of written specs), :mod:`.twin` (meta and tiny
twins built from a checkpoint's own config), :mod:`.probe` and :mod:`.grid_probe` (facts no spec states,
observed on twins; verification of a written checkpoint) and :mod:`.lookup` (the one lookup of a family's
facts that every door uses). May import: ``posextend.errors``, ``posextend.tables``.
"""
