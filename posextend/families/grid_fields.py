"""An image-size field of a config (``image_size`` beside ``patch_size``, nested or not), as the grid probes read it.

:func:`image_fields` finds the fields; :class:`FieldFacts` holds what one of them says and the larger image
a second twin gets (:data:`STEP` patches more a side).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from posextend.families.configs import get_path, pair, sub_configs
from posextend.families.specs import GridSpec

STEP = 2  # patches added per side for the second twin


def image_fields(config: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(image_key, patch_key)`` of the config and every sub-config holding an int or ``[h, w]``
    ``image_size`` and ``patch_size`` (dotted: ``vision_config.image_size``)."""
    return [(f"{prefix}image_size", f"{prefix}patch_size") for prefix, sub in sub_configs(config)
            if pair(sub.get("image_size")) and pair(sub.get("patch_size"))]


@dataclass(frozen=True)
class FieldFacts:
    """What one image-size field of a config says: the family, its class, the field and its old value, the
    image and patch sizes, and the larger image the second twin gets (two patches more a side)."""

    model_type: str
    cls: type
    image_key: str
    patch_key: str
    old_value: Any
    sizes: tuple[tuple[int, int], tuple[int, int]]
    up: tuple[int, int]

    @classmethod
    def of(cls_, config: Mapping[str, Any], cls: type, image_key: str, patch_key: str) -> FieldFacts:
        (h, w), (ph, pw) = sizes = GridSpec(image_key, patch_key).sizes(config)
        return cls_(config.get("model_type", "?"), cls, image_key, patch_key, get_path(config, image_key),
                    sizes, (h + STEP * ph, w + STEP * pw))

