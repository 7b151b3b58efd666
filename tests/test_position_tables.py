"""Which parameters count as absolute position tables (posextend.families.twin.absolute_position_tables), the
census's and the run-time-grid observation's first question: tables of a bounding box's coordinates
(LayoutLM, UDOP: indexed by the box's 0-1000 scale, never by a position) are not among them."""

from __future__ import annotations

import transformers

from posextend.families import configs, twin


def _tables(model_type: str) -> list[str]:
    config = configs.shrink(transformers.AutoConfig.for_model(model_type).to_dict())
    return [name for name, _ in twin.absolute_position_tables(twin.build(config, device="meta"))]


def test_box_coordinate_tables_are_not_position_tables():
    assert _tables("udop") == []  # T5's relative buckets, and cell_2d_embedding's x/y tables of box coordinates
    layoutlm = _tables("layoutlm")
    assert layoutlm == ["embeddings.position_embeddings.weight"]
    assert any("x_position_embeddings" in n for n, _ in twin.build(
        configs.shrink(transformers.AutoConfig.for_model("layoutlm").to_dict()), device="meta").named_parameters())
