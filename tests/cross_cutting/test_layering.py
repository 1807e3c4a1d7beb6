"""The import layering docs/architecture.md draws is the one the code has: read from the source with ``ast``
(nothing is imported), so it runs in well under a second."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Bottom to top: a module may import its own layer and the layers below it, never one above.
LAYERS = [
    ("ddp_recipes.errors", "ddp_recipes.extras", "ddp_recipes.atomic", "ddp_recipes.storage",
     "ddp_recipes.lightning_seam"),
    ("ddp_recipes.config",),
    ("ddp_recipes.data",),
    ("ddp_recipes.optim",),
    ("ddp_recipes.checkpointing",),
    ("ddp_recipes.ddp",),
    ("ddp_recipes.modules",),
    ("ddp_recipes.train",),
    ("ddp_recipes.bench", "ddp_recipes.doctor"),
    ("recipes",),
    ("benchmarks",),  # the clone's developer benchmarks: not installed, so nothing below may import them
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for top in ("ddp_recipes", "recipes", "benchmarks")
           for p in sorted((ROOT / top).rglob("*.py"))}
PACKAGES = {name for name, path in MODULES.items() if path.name == "__init__.py"}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(name: str) -> list[tuple[str, list[str], int]]:
    """(module, names, line) of every import of the project's modules, at any depth except under
    ``if TYPE_CHECKING:`` (those never run)."""
    path = MODULES[name]
    package = name if name in PACKAGES else name.rpartition(".")[0]
    found: list[tuple[str, list[str], int]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([module] if module else [])])
            found.append((module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            found.extend((a.name, [], node.lineno) for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return [(m, names, line) for m, names, line in found if m.split(".")[0] in ("ddp_recipes", "recipes", "benchmarks")]


def _layer(module: str) -> int | None:
    for rank, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    return None  # the package itself: its lazy public API


def _targets(module: str, names: list[str]) -> list[str]:
    """The modules an import loads: ``from pkg import mod`` names a submodule."""
    subs = [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES]
    return subs or [module]


def test_every_module_has_a_layer():
    assert [m for m in MODULES if m != "ddp_recipes" and _layer(m) is None] == []


def test_no_module_imports_a_layer_above_it():
    upward = []
    for name in MODULES:
        own = _layer(name)
        for module, names, line in _imports(name):
            for target in _targets(module, names):
                layer = _layer(target)
                if own is not None and layer is not None and layer > own:
                    upward.append(f"{name}:{line} imports {target}")
    assert upward == []


def test_the_library_never_imports_the_recipes():
    assert [(name, m) for name in MODULES if name.startswith("ddp_recipes")
            for m, _, _ in _imports(name) if m.split(".")[0] == "recipes"] == []


def test_no_module_below_the_package_imports_its_public_api():
    # `from ddp_recipes import X` inside the package would make every layer depend on all of them.
    assert [f"{name}:{line}" for name in MODULES if name != "ddp_recipes"
            for m, names, line in _imports(name) if m == "ddp_recipes" and _targets(m, names) == ["ddp_recipes"]] == []


def test_no_import_cycles():
    graph = {name: {t for m, names, _ in _imports(name) for t in _targets(m, names) if t in MODULES and t != name}
             for name in MODULES}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def walk(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt):], nxt])
            elif nxt not in state:
                walk(nxt, [*stack, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name, [name])
    assert cycles == []


def _defined(module: str) -> set[str]:
    """Top-level names a module defines itself (def, class, assignment), not the ones it imports."""
    names: set[str] = set()
    for node in ast.parse(MODULES[module].read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.If | ast.Try):
            for child in ast.walk(node):
                if isinstance(child, ast.FunctionDef | ast.ClassDef):
                    names.add(child.name)
                elif isinstance(child, ast.Assign):
                    names |= {t.id for t in child.targets if isinstance(t, ast.Name)}
    return names


# Every module of tests/, its subfolders included (their __init__.py are empty package markers), and examples/.
TEST_FILES = sorted(p for p in (ROOT / "tests").rglob("*.py") if p.parent == ROOT / "tests" or p.name != "__init__.py")
TEST_FILES += sorted((ROOT / "examples").glob("*.py"))


@pytest.mark.parametrize("importer", [*MODULES, *(str(p.relative_to(ROOT)) for p in TEST_FILES)])
def test_names_come_from_the_module_that_defines_them(importer):
    """No re-exports below the package's ``__init__``: ``from ddp_recipes.x import name`` means x defines it."""
    if importer in MODULES:
        imports = _imports(importer)
    else:
        tree = ast.parse((ROOT / importer).read_text(encoding="utf-8"))
        imports = [(n.module, [a.name for a in n.names], n.lineno) for n in ast.walk(tree)
                   if isinstance(n, ast.ImportFrom) and not n.level
                   and (n.module or "").startswith(("ddp_recipes", "benchmarks"))]
    borrowed = [f"{importer}:{line} takes {name} from {module}" for module, names, line in imports
                if module in MODULES and module != "ddp_recipes" for name in names
                if f"{module}.{name}" not in MODULES and name not in _defined(module)]
    assert borrowed == []


def test_public_api_names_the_defining_modules():
    tree = ast.parse(MODULES["ddp_recipes"].read_text(encoding="utf-8"))
    exports = next(ast.literal_eval(n.value) for n in tree.body
                   if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "_EXPORTS" for t in n.targets))
    assert [f"{name} from {module}" for name, module in exports.items()
            if module not in MODULES or name not in _defined(module)] == []


def test_an_editor_finds_every_public_name_where_it_is_defined():
    """The lazy exports have a ``TYPE_CHECKING`` import of each name from the same module, so go-to-definition
    on ``ddp_recipes.build_trainer`` lands in ``train/trainer.py``; ``__all__`` lists the same names."""
    tree = ast.parse(MODULES["ddp_recipes"].read_text(encoding="utf-8"))
    exports = next(ast.literal_eval(n.value) for n in tree.body
                   if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "_EXPORTS" for t in n.targets))
    checked = {f"{alias.name} from {node.module}" for block in tree.body
               if isinstance(block, ast.If) and _is_type_checking(block)
               for node in block.body if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert checked == {f"{name} from {module}" for name, module in exports.items()}
    import ddp_recipes

    assert sorted(ddp_recipes.__all__) == sorted(exports)


def test_one_argument_parser_class_serves_every_command_line():
    """Bad input reads the same on every command of the pack because one class makes it one line."""
    parsers = [f"{name}.{node.name}" for name, path in MODULES.items()
               for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))) if isinstance(node, ast.ClassDef)
               for base in node.bases if ast.unparse(base) in ("argparse.ArgumentParser", "ArgumentParser")]
    assert parsers == ["ddp_recipes.config.cli.FlagParser"]
