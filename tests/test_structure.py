"""The shape of the ``fastddp`` package: no import circle among its modules (imports inside
functions included) and no module over :data:`MAX_LINES` lines."""

import ast
from pathlib import Path
from typing import Optional

PACKAGE = Path(__file__).resolve().parents[1] / "fastddp"
MAX_LINES = 350


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__.py``)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports, at module level or inside functions."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(package, node.module, node.level)
            for alias in node.names:
                # ``from a import b`` imports module ``a.b`` where there is one, else ``a``.
                full = f"{base}.{alias.name}"
                found.add(full if full in modules else base)
    return {m for m in found if m in modules and m != name}


def _absolute(package: str, module: Optional[str], level: int) -> str:
    if level == 0:
        return module or ""
    base = package.split(".")
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each
    with one circle through it, and the modules that import themselves."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(_circle(graph, set(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def _circle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """One circle inside ``component``, as the modules along it, back to the first."""
    start = min(component)
    paths = {start: [start]}
    todo = [start]
    while todo:  # breadth first: the shortest way back to the start
        v = todo.pop(0)
        for w in sorted(graph[v] & component):
            if w == start:
                return paths[v] + [start]
            if w not in paths:
                paths[w] = paths[v] + [w]
                todo.append(w)
    return sorted(component)


def test_the_walk_sees_every_kind_of_import(tmp_path):
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "sub" / "__init__.py").write_text("from pkg.sub.b import x\n")
    (root / "sub" / "a.py").write_text("def f():\n    from . import b\n    from .. import c\n")
    (root / "sub" / "b.py").write_text("from .a import f\nx = 1\n")
    (root / "c.py").write_text("import pkg.sub.a\n")
    modules = {
        "pkg": root / "__init__.py",
        "pkg.sub": root / "sub" / "__init__.py",
        "pkg.sub.a": root / "sub" / "a.py",
        "pkg.sub.b": root / "sub" / "b.py",
        "pkg.c": root / "c.py",
    }
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert graph == {
        "pkg": set(),
        "pkg.sub": {"pkg.sub.b"},
        "pkg.sub.a": {"pkg.sub.b", "pkg.c"},
        "pkg.sub.b": {"pkg.sub.a"},
        "pkg.c": {"pkg.sub.a"},
    }
    # One component of three modules; the circle shown is the shortest through its first.
    assert _cycles(graph) == [["pkg.c", "pkg.sub.a", "pkg.c"]]
    del graph["pkg.c"]
    assert _cycles({**graph, "pkg.sub.a": {"pkg.sub.b"}}) == [
        ["pkg.sub.a", "pkg.sub.b", "pkg.sub.a"]
    ]


def test_no_import_circle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert graph["fastddp.hooks.hook"], "the walk found no import at all"
    circles = [" -> ".join(c) for c in _cycles(graph)]
    assert not circles, "import circles in fastddp:\n" + "\n".join(circles)


def test_no_module_over_the_limit():
    long = {}
    for path in _modules().values():
        name = path.relative_to(PACKAGE.parent).as_posix()
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            long[name] = lines
    assert not long, f"modules over {MAX_LINES} lines (split them by concern): {long}"
