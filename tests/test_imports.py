"""The package's import graph: the layers of the house hold (no module imports from a layer above its own),
no module imports a module that imports it (at any depth, imports inside functions and under TYPE_CHECKING
included), and the objectives see a fine-tune only through its public run context (they import nothing from
the training loop). Functions and modules stay small."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "posextend"

# Bottom to top: a module may import from its own layer and the layers below it, never from one above.
LAYERS = ["errors", "version", "registry", "options", "tables", "files", "families", "resize", "scoring", "training", "cli"]


def _name(path: Path) -> str:
    """``posextend/resize/on_disk.py`` -> ``resize.on_disk``; a package's ``__init__`` is the package."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, level: int, here: str, is_package: bool) -> str:
    if level == 0:
        return module.removeprefix("posextend").removeprefix(".")
    base = here.split(".") if is_package else here.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join([*base, *([module] if module else [])])


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` imports (a package import counts for the module it names)."""
    here, found = _name(path), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("posextend")):
            target = _resolve(node.module or "", node.level, here, path.name == "__init__.py")
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                found.add(sub if sub in modules else target)
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("posextend.") for a in node.names if a.name.startswith("posextend.")}
    return {m for m in found if m in modules} - {here}


def _graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_name(p) for p in paths}
    return {_name(p): _imports(p, modules) for p in paths if _name(p)}


def _layer(module: str) -> int:
    return LAYERS.index(module.split(".")[0])


def test_every_module_is_in_a_layer():
    graph = _graph()
    assert len(graph) > 30 and graph["training.loop"] and graph["resize.on_disk"]  # the scan sees imports
    assert sorted({m.split(".")[0] for m in graph} - set(LAYERS)) == []


def test_no_import_upwards():
    """Each layer imports only its own and those below it (the order of ``LAYERS``)."""
    upwards = sorted((m, i) for m, imported in _graph().items() for i in imported if _layer(i) > _layer(m))
    assert upwards == [], f"imports from a layer above: {upwards}"


def test_no_import_cycle():
    graph = _graph()

    def reaches(start: str) -> set[str]:
        seen, todo = set(), list(graph[start])
        while todo:
            module = todo.pop()
            if module not in seen:
                seen.add(module)
                todo += graph[module]
        return seen

    cycles = sorted(m for m in graph if m in reaches(m))
    assert cycles == [], f"modules in an import cycle: {cycles}"


def test_objectives_import_nothing_from_the_training_loop():
    graph = _graph()
    objectives = [m for m in graph if m.startswith("training.objectives")] + ["training.context"]
    assert len(objectives) >= 3
    for objective in objectives:
        assert "training.loop" not in graph[objective], objective


def _functions():
    """``(module, qualified name, lines of code without the docstring, parameters)`` of every function."""
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = node.body[0] if (node.body and isinstance(node.body[0], ast.Expr)
                                   and isinstance(node.body[0].value, ast.Constant)
                                   and isinstance(node.body[0].value.value, str)) else None
            lines = node.end_lineno - node.lineno + 1 - ((doc.end_lineno - doc.lineno + 1) if doc else 0)
            args = node.args
            names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
            in_class = isinstance(parents.get(node), ast.ClassDef)
            params = len(names) - (1 if in_class and names and names[0] in ("self", "cls") else 0)
            yield _name(path), node.name, lines, params


def test_functions_are_small():
    """No function over 60 lines of code (its docstring aside) outside the CLI, none over 8 parameters
    outside the CLI's commands and the public API (whose keyword options may be many)."""
    import posextend

    public = set(posextend.__all__)
    found = list(_functions())
    assert len(found) > 300  # the scan sees the package
    long = [(m, f, n) for m, f, n, _ in found if n > 60 and not m.startswith("cli")]
    wide = [(m, f, p) for m, f, _, p in found if p > 8 and not m.startswith("cli") and f not in public]
    assert (long, wide) == ([], [])
