"""The package's import graph: the layers of the house hold (no module imports from a layer above its own),
no module imports a module that imports it (at any depth, imports inside functions and under TYPE_CHECKING
included), and the objectives see a fine-tune only through its public run context (they import nothing from
the training loop). Functions and modules stay small."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from layers import LAYERS, PACKAGE, graph as _graph, module_name as _name  # noqa: E402  (one graph: the docs' map)


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
    """No function over 60 lines of code (its docstring aside) outside the command line (``cli``, ``commands``),
    none over 8 parameters outside the CLI's commands and the public API (whose keyword options may be many)."""
    import posextend

    public = set(posextend.__all__)
    found = list(_functions())
    assert len(found) > 300  # the scan sees the package
    commands = ("cli", "commands")  # the command line: the entry point and the typer app's commands
    long = [(m, f, n) for m, f, n, _ in found if n > 60 and not m.startswith(commands)]
    wide = [(m, f, p) for m, f, _, p in found if p > 8 and not m.startswith(commands) and f not in public]
    assert (long, wide) == ([], [])


def test_modules_are_small():
    """No module over 500 lines: a bigger one does several jobs (split it by job, as files/ and families/ are)."""
    sizes = {_name(p) or "posextend": len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert len(sizes) > 30
    assert {m: n for m, n in sizes.items() if n > 500} == {}
