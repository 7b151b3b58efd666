"""A griffe extension for the docs build (``mkdocs.yml`` loads it): the Sphinx roles the docstrings use
(``:class:`~posextend.files.checkpoint.Checkpoint```, ``:func:`resize_table```, ``:mod:`.specs```) become code
that links to the object wherever the site renders it, and stays plain code (no warning) where it does not.

Without it mkdocstrings prints the roles as they are typed (":class:~posextend…").
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):`(~?)([\w.]+)(?:\(\))?`")


class SphinxRoles(griffe.Extension):
    """Rewrites the roles of every docstring of a package once it is loaded (names resolve against its modules)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        for obj in _objects(pkg):
            if obj.docstring:
                obj.docstring.value = ROLE.sub(lambda m, o=obj: reference(o, m.group(2), short=bool(m.group(1))),
                                               obj.docstring.value)


def _objects(obj: griffe.Object):
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _objects(member)


def reference(obj: griffe.Object, target: str, *, short: bool) -> str:
    """An optional cross-reference (mkdocs-autorefs) to ``target`` as seen from ``obj``, titled as Sphinx would."""
    title = target.rsplit(".", 1)[-1] if short else target
    return f'<autoref identifier="{resolve(obj, target)}" optional><code>{title}</code></autoref>'


def resolve(obj: griffe.Object, target: str) -> str:
    """``target``'s full path: relative names (``.specs``) against ``obj``'s package, others in ``obj``'s scope."""
    if target.startswith("."):
        module = obj if obj.is_module else obj.module
        package = module.path if module.is_package else module.path.rpartition(".")[0]
        return f"{package}.{target.lstrip('.')}"
    first, _, rest = target.partition(".")
    try:
        return ".".join(filter(None, [obj.resolve(first), rest]))
    except (griffe.NameResolutionError, AttributeError, KeyError, ValueError):
        return target
