"""Model families: where each keeps its positions, written as specs or observed on tiny twins.

Owns :mod:`.specs` (the spec types), :mod:`.catalogue` (the written specs, the one place that names a
family with a learned table) and :mod:`.not_learned` (the families and config fields whose positions are no
learned table); :mod:`.renames` (a file's tensor names against the model's: renames on loading, why a table
is missing); :mod:`.configs` (config paths and shrinking), :mod:`.twin` (meta and tiny twins built from a
checkpoint's own config, the class a checkpoint's names belong to) and :mod:`.twin_runs` (running twins: the
rows a forward looks up, images and patch sequences); :mod:`.probe` (1-D tables no spec states, observed on
twins; verification of a written checkpoint) and, for image grids, :mod:`.grid_probe` (the grids an image
size sizes) with :mod:`.grid_fields`, :mod:`.grid_resampling` (the family's own resampling),
:mod:`.grid_buffers` (buffers that follow the grid) and :mod:`.run_time_grids` (grids adapted to each image);
:mod:`.lookup` (the one lookup of a family's facts that every door uses); and :mod:`.coverage` (how each
model type is covered, as the census record ``census.json`` has it: the ``families`` command and page). May import:
``posextend.errors``, ``posextend.tables``.
"""
