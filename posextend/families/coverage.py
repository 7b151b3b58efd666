"""Is my model supported? How each family is covered, as the census found it (:func:`answer`, :func:`summary`).

The census (``tests/census.py``) builds a tiny twin of every model type the pinned transformers registers,
resizes each of its lengths with posextend and checks the result independently; its record is
``census.json`` beside this module, one entry per model type: the outcome, the class checked, how the
family is covered (a written spec, or observed on a twin), its tables and length fields, each layout's
outcome and the reason for a refusal. The ``families`` command and the families page
(``scripts/gen_families_docs.py``) both read it through this module.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

from posextend.errors import PosExtendError, UnsupportedArchitectureError
from posextend.families.catalogue import VISION_TOWERS

RECORD = Path(__file__).with_name("census.json")
#: The transformers the record was taken with (the ``test`` extra pins it; a test holds the two equal).
TRANSFORMERS = "5.23.0"

#: Every outcome, best first: its title and what it means for a user.
OUTCOMES: dict[str, tuple[str, str]] = {
    "verified": ("Resized and verified",
                 "resized 2x and checked: loads, runs at the new length, short inputs unchanged"),
    "grid-spec": ("Image grids with a written spec",
                  "resized with an image size: the outputs of transformers' run-time interpolation"),
    "grid-probed": ("Image grids observed and checked",
                    "a grid observed on twins, resized to twice the image size, loads and runs"),
    "run-time-grid": ("Grids adapted to each image",
                      "the family resizes its grid to each image on every forward: nothing on disk to resize"),
    "grid": ("Image grids refused", "a grid that cannot be resized on disk safely (the reason says why)"),
    "refused-table": ("Tables refused", "a position-named table that cannot be resized safely (the reason says why)"),
    "refused": ("No learned absolute table",
                "positions are rotary, relative, sinusoidal or absent: no table to extend"),
    "no-twin": ("Not checked", "transformers itself cannot build the type from its default config"),
}


@cache
def record() -> dict[str, dict[str, Any]]:
    """The census record, by model type."""
    return {entry["model_type"]: entry for entry in json.loads(RECORD.read_text(encoding="utf-8"))}


def find(query: str) -> list[dict[str, Any]]:
    """The record's entries for ``query``: a model type (``bert``) or a transformers class name (``BertModel``,
    ``BertForMaskedLM``), matched without regard to case; empty when neither."""
    entries, wanted = record(), query.strip().lower()
    types = [t for t in entries if t.lower() == wanted]
    if not types:
        types = sorted({t for name, t in _class_names().items() if name.lower() == wanted and t in entries})
    return [entries[t] for t in types]


@cache
def _class_names() -> dict[str, str]:
    """Every transformers class name its auto classes map a model type to, and the census's classes: the type."""
    from transformers.models.auto import modeling_auto

    names = {entry["cls"]: t for t, entry in record().items() if entry["cls"]}
    for key, mapping in sorted(vars(modeling_auto).items()):
        if key.startswith("MODEL") and key.endswith("_MAPPING_NAMES") and isinstance(mapping, Mapping):
            for model_type, classes in mapping.items():
                for name in [classes] if isinstance(classes, str) else classes:
                    names.setdefault(name, model_type)
    return names


def answer(query: str) -> str:
    """How the model type or class ``query`` is covered (:func:`describe`), one block per model type.

    Raises:
        UnsupportedArchitectureError: no model type or class of that name is in the record.
    """
    entries = find(query)
    if not entries:
        close = sorted(t for t in record() if query.strip().lower().replace("_", "-") in t.replace("_", "-"))[:8]
        raise UnsupportedArchitectureError(
            f"{query!r} is no model type or transformers class the census knows (transformers {TRANSFORMERS}, "
            f"{len(record())} model types){'; close: ' + ', '.join(close) if close else ''}. Give a model type "
            "(config.json's model_type, such as bert), a class name (BertModel) or a checkpoint folder.")
    return "\n\n".join(describe(e) for e in entries)


def describe(entry: Mapping[str, Any]) -> str:
    """One model type's coverage: its outcome and what it means, how it is covered, its lengths and image
    grids, each layout's outcome, and the reason for a refusal."""
    meaning = OUTCOMES.get(entry["outcome"], ("", ""))[1]
    lines = [f"{entry['model_type']}: {entry['outcome']}", f"  {meaning}",
             f"  class checked: {entry['cls'] or 'none (transformers has no model class for it)'}"]
    if entry["covered_by"]:
        lines.append("  covered by: " + ("a written spec" if entry["covered_by"] == "spec"
                                         else "observed on a twin of its config (no written spec)"))
    for g in entry["groups"]:
        lines.append(f"  {g['group']} positions: {', '.join(g['tables'])} (reserved rows: {g['reserved']}; "
                     f"length in {g['length']})")
    for g in entry["grids"]:
        lines.append(f"  {g['group']} image grid: {', '.join(g['tables'])} (prefix tokens: {g['prefix']}; size in "
                     f"{g['image']}): {g['outcome']}, checked {_checked(g['reference'])}")
    if entry["model_type"] in VISION_TOWERS:
        tower = VISION_TOWERS[entry["model_type"]]
        lines.append(f"  {tower.group} image grid: a written spec, resized with an image size (size in "
                     f"{tower.length_keys[0]}; not walked by the census)")
    if entry["layouts"]:
        lines.append("  layouts: " + ", ".join(f"{k} {v['outcome']}" for k, v in entry["layouts"].items()))
        lines += [f"  {k}: {v['reason']}" for k, v in entry["layouts"].items() if v["reason"]]
    if entry["reason"] and entry["outcome"] == "grid-spec":  # its reason names the tests that check it
        lines.append(f"  checked by: {entry['reason'].rpartition(': ')[2]}")
    elif entry["reason"]:
        lines.append(f"  reason: {entry['reason']}")
    return "\n".join(lines)


def _checked(reference: str) -> str:
    return reference.replace("load-and-run", "by loading and running it").replace(
        "run-time", "against its run-time interpolation")


def for_config(config: Mapping[str, Any], where: str) -> str:
    """The coverage of the checkpoint at ``where`` (its ``config``): what posextend finds in it now, then its
    model type's census record."""
    from posextend.families.lookup import all_specs

    model_type = config.get("model_type")
    lines = [f"{where}: model type {model_type!r}"]
    try:
        lines += [f"  {s.group} {'image grid' if s.grid else 'positions'}: resizable, "
                  f"{'by a written spec' if s.covered_by == 'spec' else 'observed on a twin of its config'} "
                  f"({'size' if s.grid else 'length'} in {s.length_keys[0]})" for s in all_specs(config)]
    except PosExtendError as exc:
        lines.append(f"  refused: {exc}")
    entry = record().get(model_type)
    lines += [f"In the census (transformers {TRANSFORMERS}):",
              describe(entry) if entry else f"no record of model type {model_type!r}"]
    return "\n".join(lines)


def counts(entries: list[Mapping[str, Any]] | None = None) -> dict[str, int]:
    """Model types by outcome, in the order of :data:`OUTCOMES` (best first)."""
    found = Counter(e["outcome"] for e in (entries if entries is not None else record().values()))
    return {o: found[o] for o in [*OUTCOMES, *sorted(set(found) - set(OUTCOMES))] if found[o]}


def summary() -> str:
    """How many model types each outcome holds, best first, with what it means."""
    entries = list(record().values())
    by = counts(entries)
    spec = sum(1 for e in entries if e["outcome"] == "verified" and e["covered_by"] == "spec")
    width = max(map(len, by))
    lines = [f"The census of the {len(entries)} model types of transformers {TRANSFORMERS}:"]
    for outcome, n in by.items():
        extra = f" ({spec} by a written spec, {n - spec} observed on a twin)" if outcome == "verified" else ""
        lines.append(f"  {outcome:<{width}} {n:>4}  {OUTCOMES.get(outcome, ('', ''))[1]}{extra}")
    return "\n".join(lines)


def reason_of(entry: Mapping[str, Any]) -> str:
    """The entry's reason without the model type it names (``Model type 'x' uses …`` → ``Uses …``)."""
    text = re.sub(r"^Model type '[^']*':? ?", "", entry["reason"])
    return text[:1].upper() + text[1:]
