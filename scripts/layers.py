"""The package's layers and its import graph, read from the code (imports as written, none run).

    python scripts/layers.py            # rewrite the generated map in docs/concepts/architecture.md
    python scripts/layers.py --check    # exit 1 if the committed map is stale

``tests/test_imports.py`` holds the rules (no import from a layer above, no cycle) on the same graph, and
``tests/test_docs.py`` runs the check, so the page a newcomer reads is the picture the code draws.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "posextend"
PAGE = ROOT / "docs" / "concepts" / "architecture.md"
BEGIN, END = "<!-- layers:begin (python scripts/layers.py) -->", "<!-- layers:end -->"

# Bottom to top: a module may import from its own layer and the layers below it, never from one above.
LAYERS = ["errors", "version", "registry", "options", "tables", "files", "data", "families", "resize", "scoring", "training", "terminal",
          "shell", "commands", "cli"]


def module_name(path: Path) -> str:
    """``posextend/resize/on_disk.py`` -> ``resize.on_disk``; a package's ``__init__`` is the package."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _target(node: ast.ImportFrom, here: str, is_package: bool) -> str:
    if node.level == 0:
        return (node.module or "").removeprefix("posextend").removeprefix(".")
    base = here.split(".") if is_package else here.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` imports, at any depth (in functions, under TYPE_CHECKING)."""
    here, found = module_name(path), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("posextend")):
            target = _target(node, here, path.name == "__init__.py")
            found |= {f"{target}.{a.name}".lstrip(".") if f"{target}.{a.name}".lstrip(".") in modules else target
                      for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("posextend.") for a in node.names if a.name.startswith("posextend.")}
    return {m for m in found if m in modules} - {here}


def graph() -> dict[str, set[str]]:
    """Every module of the package (the top-level ``__init__`` aside) and the modules it imports."""
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports(p, modules) for p in paths if module_name(p)}


def layer(module: str) -> str:
    return module.split(".")[0]


def _summary(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return " ".join(doc.split("\n\n")[0].split())


def render() -> str:
    """The map: one row per layer, top first: its modules, the layers it imports, what it owns."""
    edges = graph()
    rows = ["| layer | modules | imports from | owns |", "|---|---|---|---|"]
    for name in reversed(LAYERS):
        mods = sorted(m for m in edges if layer(m) == name)
        below = sorted({layer(i) for m in mods for i in edges[m]} - {name}, key=LAYERS.index, reverse=True)
        path = PACKAGE / name / "__init__.py" if (PACKAGE / name).is_dir() else PACKAGE / f"{name}.py"
        shown = [m.removeprefix(f"{name}.") for m in mods if m != name] or [name]
        rows.append(f"| `{name}` | {', '.join(f'`{m}`' for m in shown)} | {', '.join(below) or '—'} "
                    f"| {_summary(path).replace('|', '/')} |")
    return "\n".join([BEGIN, *rows, END])


def _rewrite(page: str) -> str:
    head, rest = page.split(BEGIN, 1)
    return head + render() + rest.split(END, 1)[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed map is stale")
    page = PAGE.read_text()
    if parser.parse_args().check:
        return 0 if _rewrite(page) == page else 1
    PAGE.write_text(_rewrite(page))
    return 0


if __name__ == "__main__":
    sys.exit(main())
