"""One registry mechanism for every kind of plug-in (strategies, fine-tune objectives).

Built-ins register when their module is imported; third-party packages register through an
entry-point group (``posextend.strategies``, ``posextend.objectives``) whose entry points name a
module (or callable) whose import registers them. Plug-ins are imported lazily, once, on the first
listing or lookup of a name no built-in has (a built-in's name is never a plug-in's), and a plug-in
that fails to import is skipped with a warning: it never breaks the built-ins or another plug-in.
"""

from __future__ import annotations

import logging
import re
from typing import Generic, TypeVar

from posextend.errors import PosExtendError

log = logging.getLogger(__name__)

T = TypeVar("T")
NAME = re.compile(r"^[a-z][a-z0-9_-]*$")


class Registry(Generic[T]):
    """Named plug-ins of one ``kind`` ("strategy"), found in entry-point ``group``; lookups that fail
    raise ``error`` (a :class:`PosExtendError` subclass)."""

    def __init__(self, kind: str, plural: str, group: str, error: type[PosExtendError]):
        self.kind, self.plural, self.group, self.error = kind, plural, group, error
        self.items: dict[str, T] = {}
        self.plugins_loaded = False

    def check_name(self, name: str) -> None:
        """Refuse a name that is not lowercase letters, digits, '-' and '_', or that is taken."""
        if not isinstance(name, str) or not NAME.match(name):
            raise self.error(f"Invalid {self.kind} name {name!r}: use lowercase letters, digits, '-' and '_', "
                             "starting with a letter.")
        if name in self.items:
            raise self.error(f"A {self.kind} named {name!r} is already registered (by {_owner(self.items[name])}); "
                             "choose another name.")

    def add(self, name: str, item: T) -> None:
        self.check_name(name)
        self.items[name] = item

    def available(self) -> dict[str, T]:
        """Every registered item (built-ins and plug-ins), by name."""
        self._load_plugins()
        return dict(sorted(self.items.items()))

    def get(self, name: str) -> T:
        if name in self.items:  # a built-in (or a plug-in loaded already): no plug-in can take its name
            return self.items[name]
        found = self.available()
        if name not in found:
            raise self.error(f"Unknown {self.kind} {name!r}. Valid {self.plural}: {', '.join(found)}.")
        return found[name]

    def _load_plugins(self) -> None:
        if self.plugins_loaded:
            return
        self.plugins_loaded = True
        from importlib.metadata import entry_points

        for ep in entry_points(group=self.group):
            try:
                ep.load()
            except Exception as exc:  # a broken plug-in must not break the built-ins
                log.warning("Could not load posextend %s plug-in %r: %s", self.kind, ep.name, exc)


def _owner(item: object) -> str:
    """The module that registered ``item`` (a strategy's function, an objective's class)."""
    for target in (getattr(item, "fn", None), type(item), item):
        module = getattr(target, "__module__", None)
        if module and module != "builtins":
            return module
    return "?"
