"""The package's import graph: no module imports a module that imports it (at any depth, imports inside
functions and under TYPE_CHECKING included), and the objectives see a fine-tune only through its public
run context (they import nothing from the training loop)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "posextend"


def _imports(path: Path, modules: set[str]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("posextend"):
            parts = node.module.split(".")
            found |= {parts[1]} if len(parts) > 1 else {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("posextend.")}
    return found & modules - {path.stem}


def _graph() -> dict[str, set[str]]:
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    return {p.stem: _imports(p, modules) for p in PACKAGE.glob("*.py")}


def test_no_import_cycle():
    graph = _graph()
    assert graph["training"] and graph["checkpoint"]  # the scan sees imports

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
    for objective in ("objectives", "seq2seq", "context"):
        assert "training" not in graph[objective], objective


def _functions():
    """``(module, qualified name, lines of code without the docstring, parameters)`` of every function."""
    for path in sorted(PACKAGE.glob("*.py")):
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
            yield path.stem, node.name, lines, params


def test_functions_are_small():
    """No function over 60 lines of code (its docstring aside) outside the CLI, none over 8 parameters
    outside the CLI's commands and the public API (whose keyword options may be many)."""
    import posextend

    public = set(posextend.__all__)
    found = list(_functions())
    assert len(found) > 300  # the scan sees the package
    long = [(m, f, n) for m, f, n, _ in found if n > 60 and m != "cli"]
    wide = [(m, f, p) for m, f, _, p in found if p > 8 and m != "cli" and f not in public]
    assert (long, wide) == ([], [])
