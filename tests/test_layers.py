"""The package's layers (docs/architecture.md): each package imports only packages below it,
and no module imports itself back through others. Every import statement counts, those
inside functions and under TYPE_CHECKING included: a lazy import is still a dependency."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "jobrunner"

# Top to bottom. Packages on one line are side by side: neither may import the other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("jobrunner.cli", "jobrunner.operator"),
    ("jobrunner.server",),  # `jobrunner serve` (a command of the cli) and its routes
    ("jobrunner.local",),
    ("jobrunner.worker",),
    ("jobrunner.features",),
    ("jobrunner.runtime",),
    ("jobrunner.queue",),
    ("jobrunner.store",),
    ("jobrunner.model",),
    ("jobrunner.observability",),  # traces: imports nothing of jobrunner
)
# The public names at the package's root (`from jobrunner import Task`,
# `jobrunner.openai_batch:handle`): they re-export from the layers and nothing imports them.
PUBLIC = ("jobrunner", "jobrunner.__main__", "jobrunner.openai_batch")


def module_name(path: Path, root: Path = REPO) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports(path: Path, root: Path = REPO) -> Iterator[tuple[int, str]]:
    """(line, absolute module) of every import in the file, wherever it stands."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            yield node.lineno, base
            for alias in node.names:  # `from jobrunner.store import db` names a module
                yield node.lineno, f"{base}.{alias.name}"


def layer_of(module: str) -> int | None:
    for index, layer in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in layer):
            return index
    return None


def package_of(module: str) -> str | None:
    for layer in LAYERS:
        for p in layer:
            if module == p or module.startswith(p + "."):
                return p
    return None


def modules(root: Path = REPO) -> dict[str, Path]:
    return {module_name(p, root): p for p in (root / "jobrunner").rglob("*.py")}


def violations(root: Path = REPO) -> list[str]:
    """Every import that goes up a layer, sideways to another package of its layer, into
    the public root from inside, or from a module outside every layer."""
    known = modules(root)
    found = []
    for name, path in sorted(known.items()):
        here = layer_of(name)
        if here is None and name not in PUBLIC:
            found.append(f"{name}: in no layer (add its package to LAYERS)")
            continue
        for line, target in imports(path, root):
            if target not in known:
                continue  # another project's module, or `from X import name` of a non-module
            where = f"{path.relative_to(root)}:{line}: {name} imports {target}"
            if target in PUBLIC:
                if name not in PUBLIC:
                    found.append(f"{where} (the public root: import from the layer instead)")
                continue
            there = layer_of(target)
            if here is None or there is None:
                continue
            if there < here:
                found.append(f"{where} (up from layer {here} to layer {there})")
            elif there == here and package_of(name) != package_of(target):
                found.append(f"{where} (sideways: {package_of(name)} and {package_of(target)} "
                             "are side by side)")
    return found


def circles(root: Path = REPO) -> list[list[str]]:
    """Strongly connected module groups of more than one module (Tarjan)."""
    known = modules(root)
    edges = {m: set() for m in known}
    for name, path in known.items():
        for _, target in imports(path, root):
            if target in known and target != name and not name.startswith(target + "."):
                edges[name].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for m in sorted(known):
        if m not in index:
            visit(m)
    return groups


def test_every_import_goes_down_a_layer() -> None:
    assert violations() == []


def test_no_import_circles() -> None:
    assert circles() == []


def test_the_check_sees_an_upward_import_inside_a_function(tmp_path: Path) -> None:
    # A copy of the package with one lazy upward import (the store reaching for the
    # worker): the check must name it, and the circle it closes.
    copy = tmp_path / "jobrunner"
    for path in PACKAGE.rglob("*.py"):
        target = copy / path.relative_to(PACKAGE)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    db = copy / "store" / "db.py"
    db.write_text(db.read_text() + "\n\ndef _late():\n    from jobrunner.worker import process\n")
    found = violations(tmp_path)
    assert any("jobrunner.store.db imports jobrunner.worker.process (up" in v for v in found), found
    assert any("jobrunner.store.db" in group for group in circles(tmp_path))


def test_every_module_is_in_a_layer() -> None:
    assert all(layer_of(m) is not None or m in PUBLIC for m in modules())


def module_lines(root: Path = REPO) -> list[str]:
    """docs/architecture.md's list: each module and its docstring's first paragraph."""
    lines = []
    for name, path in sorted(modules(root).items()):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if path.name in ("__main__.py",) and not doc:
            continue
        first = " ".join(doc.split("\n\n")[0].split())  # the docstring's first paragraph
        lines.append(f"- `{name}`: {first}".rstrip(": "))
    return lines


def test_the_architecture_doc_lists_every_module() -> None:
    doc = (REPO / "docs" / "architecture.md").read_text()
    missing = [line for line in module_lines() if line.split("`")[1] not in doc]
    assert missing == [], "regenerate with `python -m tests.test_layers --modules`"


if __name__ == "__main__":  # `python -m tests.test_layers`: the report the test asserts on
    import sys

    if "--modules" in sys.argv:
        print("\n".join(module_lines()))
        raise SystemExit(0)
    for v in violations():
        print(v)
    groups = circles()
    for g in groups:
        print("circle:", " ".join(g))
    print(f"{len(violations())} layer violation(s), {len(groups)} import circle(s) "
          f"over {len(modules())} modules")
